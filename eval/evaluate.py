"""The evaluate and baseline commands: windows -> scores -> binned report on disk."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from megabase.data import InputError, TokenStore, make_windows, read_bed
from megabase.data.names import parse_region

from .bins import check_edges, default_edges
from .markov import MarkovModel
from .report import score_series, write_report
from .score import ModelScorer, markov_scorer, recall_probe, truncated


def eval_windows(store: TokenStore, windows: str | Path | None, split: str, regions: list[str],
                 length: int):
    """Windows from a BED (one split), or tiles of ``length`` over ``regions`` (every base kept)."""
    if windows is not None:
        return read_bed(windows, split)
    tiles, _ = make_windows(store, {split: regions}, length, max_n_frac=1.0)
    return tiles


def region_tokens(store: TokenStore, specs: list[str]) -> list[np.ndarray]:
    out = []
    for spec in specs:
        region = parse_region(spec, store.names, str(store.path))
        out.append(np.array(store.tokens(region.name)[region.start : region.end]))
    return out


def fit_markov(store: TokenStore, order: int, train: list[str]) -> MarkovModel:
    model = MarkovModel(order)
    for tokens in region_tokens(store, train):
        model.fit(tokens)
    return model


def evaluate(checkpoint: str | Path, data: str | Path, out: str | Path | None = None,
             windows: str | Path | None = None, split: str = "eval",
             regions: tuple[str, ...] = ("chr22",), length: int | None = None,
             edges: list[int] | None = None, controls: tuple[int, ...] = (1_000,),
             probe: bool = True, baselines: tuple[int, ...] = (), train: tuple[str, ...] = (),
             segment: int = 65_536, n_boot: int = 1000, seed: int = 0,
             progress: bool = True) -> dict:
    """Score a checkpoint on held-out windows; write report.json/csv/png into ``out``.

    ``controls``: context limits for the truncation control; ``baselines``: Markov orders fitted
    on ``train`` regions and scored on the same windows; ``probe``: the in-context recall probe.
    """
    from megabase.model import load_checkpoint, read_checkpoint_config

    started = time.perf_counter()
    config = read_checkpoint_config(checkpoint)
    model = load_checkpoint(checkpoint)
    store = TokenStore(data)
    length = length or int(config.get("window_length", 65_536))
    wins = eval_windows(store, windows, split, list(regions), length)
    if not wins:
        raise InputError(f"no windows to evaluate in split {split!r}", data)
    longest = max(w.length for w in wins)
    edges = check_edges(edges) if edges else default_edges(longest)
    if baselines and not train:
        raise InputError("--baseline needs --train regions to fit the Markov models on")
    scorer = ModelScorer(model, segment)
    report = {"name": f"model {Path(checkpoint).name}", "checkpoint": str(Path(checkpoint).resolve()),
              "data": str(Path(data).resolve()), "split": split, "n_windows": len(wins),
              "window_length": longest, "edges": edges,
              **score_series(scorer, store, wins, edges, n_boot, seed, progress, "model")}
    report["controls"] = {
        str(c): score_series(truncated(scorer, c), store, wins, edges, n_boot, seed, progress,
                             f"control <= {c}")
        for c in controls if c < longest
    }
    report["baselines"] = {
        f"markov order {k}": score_series(markov_scorer(fit_markov(store, k, list(train))), store,
                                          wins, edges, n_boot, seed, progress, f"markov {k}")
        for k in baselines
    }
    if probe:
        held_out = np.concatenate(region_tokens(store, list(regions)))
        distances = [d for d in (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000) if d < longest]
        report["probe"] = recall_probe(scorer, held_out, distances, seed=seed)
    report["seconds"] = time.perf_counter() - started
    out = Path(out) if out else Path(checkpoint) / "eval"
    report["files"] = {k: str(p) for k, p in write_report(report, out).items()}
    return report


def markov_baseline(data: str | Path, order: int, train: list[str], eval_regions: list[str],
                    out: str | Path, length: int = 65_536, edges: list[int] | None = None,
                    n_boot: int = 1000, seed: int = 0, progress: bool = True) -> dict:
    """Fit an order-``order`` Markov model on ``train`` and report it on ``eval_regions``."""
    started = time.perf_counter()
    store = TokenStore(data)
    wins = eval_windows(store, None, "eval", eval_regions, length)
    edges = check_edges(edges) if edges else default_edges(max(w.length for w in wins))
    scorer = markov_scorer(fit_markov(store, order, train))
    report = {"name": f"markov order {order}", "data": str(Path(data).resolve()),
              "train": train, "eval": eval_regions, "n_windows": len(wins),
              "window_length": length, "edges": edges,
              **score_series(scorer, store, wins, edges, n_boot, seed, progress, f"markov {order}")}
    report["seconds"] = time.perf_counter() - started
    report["files"] = {k: str(p) for k, p in write_report(report, out).items()}
    return report
