"""The evaluate and baseline commands: windows -> scores -> binned report on disk."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

from megabase.core.errors import Interrupted
from megabase.data import InputError, TokenStore, make_windows, read_bed
from megabase.data.names import Region, parse_region
from megabase.data.windows import first_overlap, resolve_splits
from megabase.model import load_checkpoint, read_checkpoint_config
from megabase.model.checkpoint import held_checkpoint, weights_sha256

from .ablate import ablated, label
from .bins import cover_edges, default_edges, gain_beyond, paired_gain, whole
from .config import EvalConfig, check_controls
from .copymodel import CopyModel, CopySpec
from .journal import Journal
from .markov import MarkovModel
from .probe import probe_distances, recall_probe
from .rebalance import rebalance_moe
from .report import accumulate, score_series, windows_sha256, write_report
from .score import ModelScorer, markov_scorer, truncated


def eval_windows(store: TokenStore, windows: str | Path | None, split: str, regions: list[str],
                 length: int):
    """Windows from a BED (one split), or tiles of ``length`` over ``regions`` (every base kept;
    tiles without a single A/C/G/T, which have nothing to score, are left out)."""
    if windows is not None:
        return read_bed(windows, split)
    tiles, _ = make_windows(store, {split: regions}, length, max_n_frac=1.0)
    return [w for w in tiles if (np.asarray(store.tokens(w.chrom)[w.start : w.end]) < 4).any()]


def region_tokens(store: TokenStore, specs: list[str]) -> list[np.ndarray]:
    out = []
    for spec in specs:
        region = parse_region(spec, store.names, str(store.path))
        out.append(np.array(store.tokens(region.name)[region.start : region.end]))
    return out


def check_apart(store: TokenStore, train: list[str], scored: list[str], wins=()) -> None:
    """Refuse ``train`` regions (what the baselines and the copy model are fitted on) that share
    bases with the ``scored`` regions or windows ``wins``: fitted on the bases they score, they
    report too few bits/base (an order-8 Markov chain: 1.07 instead of 2.10), and the model looks
    worse beside them. The same check as ``megabase windows`` makes between its splits."""
    regions = resolve_splits(store, {"train": train, "scored": scored})
    names: dict[str, str] = {}
    for w in wins:  # a BED's windows, by the store's name for their record
        name = names.setdefault(w.chrom, parse_region(w.chrom, store.names, str(store.path)).name)
        regions.append(("scored", Region(name, w.start, w.end), w.end))
    pair = first_overlap(regions)
    if pair is not None:
        fitted, scoring = sorted(pair, key=lambda p: p[0] != "train")
        raise InputError(f"{{train}} region {fitted[1]} shares bases with the scored {scoring[1]}: "
                         "baselines fitted on the bases they score report too few bits/base; "
                         "fit them on other regions", store.path, options=("train",))


def fit_markov(store: TokenStore, order: int, train: list[str]) -> MarkovModel:
    model = MarkovModel(order)
    for tokens in region_tokens(store, train):
        model.fit(tokens)
    return model


def copy_reference(store: TokenStore, spec: CopySpec, train: list[str], wins, edges,
                   controls: list[int], n_boot: int, seed: int, progress: bool = True,
                   block: int | None = None, journal: Journal | None = None):
    """The copy-model reference (:mod:`megabase.eval.copymodel`) fitted on ``train`` and scored on
    ``wins``, in full and under each context limit of ``controls``: its report entry, and the
    accumulators of its full curve and of each control (to pair with the model's). ``block``,
    ``journal``: :func:`~megabase.eval.report.accumulate`'s."""
    started = time.perf_counter()
    model = CopyModel(spec).fit(region_tokens(store, train))
    kw = {"block": block, "journal": journal, "counter": model.stats}
    full = accumulate(model, store, wins, edges, progress, "copy model", **kw)
    entry = {"name": "copy model", "label": spec.label(), "orders": list(spec.orders),
             "seeds": list(spec.seeds), "max_miss": spec.max_miss, "lr": spec.lr,
             **full.summary(n_boot=n_boot, seed=seed), "controls": {}, "context_gain": {}}
    accs = {}
    for c in controls:
        accs[c] = accumulate(truncated(model, c), store, wins, edges, progress,
                             f"copy model <= {c}", **kw)
        entry["controls"][str(c)] = accs[c].summary(n_boot=n_boot, seed=seed)
        entry["context_gain"][str(c)] = paired_gain(full, accs[c], n_boot, seed)
    matches, predictions, hits = (int(v) for v in model.stats)
    entry["copies"] = {"matches": matches, "predictions": predictions,
                       "hit_rate": hits / predictions if predictions else None}
    entry["seconds"] = time.perf_counter() - started
    return entry, full, accs


def context_worth(model: tuple, copy: tuple, limit: int, n_boot: int, seed: int) -> dict:
    """What context beyond ``limit`` gives the model and the copy model, each paired with its own
    control (``(full, control)`` accumulators), pooled over the bins beyond it; ``share``: the
    model's gain over the copy model's (None unless the copy model gains)."""
    m = gain_beyond(*model, limit, n_boot, seed)
    c = gain_beyond(*copy, limit, n_boot, seed)
    gm, gc = m["all"]["gain_bits_per_base"], c["all"]["gain_bits_per_base"]
    return {"context_lo": m["context_lo"], "context_hi": m["context_hi"], "model": m,
            "copy": c, "share": gm / gc if gm is not None and gc else None}


def evaluate(checkpoint: str | Path, data: str | Path, options: EvalConfig | None = None,
             out: str | Path | None = None, windows: str | Path | None = None, split: str = "eval",
             progress: bool = True) -> dict:
    """Score a checkpoint on held-out windows; write report.json/csv/png into ``out``.

    ``options`` (:class:`EvalConfig`, its defaults when None): the regions to tile (or a BED of
    ``windows``, one ``split`` of it), the truncation controls (each with the model's paired
    gain over it per bin, ``context_gain``), the Markov baselines (fitted on the training regions
    and scored on the same windows; the best in ``best_baseline``), the recall probe. Empty
    ``regions`` / ``train`` are the held-out / training regions the checkpoint's run recorded.
    ``checkpoint``: a checkpoint folder, or a run folder (its latest checkpoint); held while it is
    read, so that the rotation of a run training meanwhile keeps it (``held_checkpoint``).
    ``out``: default :func:`report_folder`, never inside a run's checkpoint (rotation removes
    those). Baselines and the copy model fitted on bases they score are refused
    (:func:`check_apart`). A stopped evaluation resumes from the windows it finished
    (:mod:`megabase.eval.journal`, kept in ``out``), with the numbers of an uninterrupted one;
    the report's ``seconds`` counts all its ``tries``.
    Logging the report to a tracking run is the pipeline's
    (:func:`megabase.pipeline.tracking.evaluate_tracked`).
    """
    o = (options or EvalConfig()).check()
    with held_checkpoint(checkpoint) as held:
        out = Path(out) if out else report_folder(held)
        check_output(out)
        return _evaluate(held, data, o, windows, split, progress, out)


def report_folder(checkpoint: Path) -> Path:
    """Where a checkpoint's report goes by default: ``RUN/eval/step-N`` for a checkpoint of a run
    (``RUN/checkpoints/step-N``, which the run's rotation will remove, report and all), else
    ``CHECKPOINT/eval``."""
    ckpt = Path(checkpoint)
    if ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent / "eval" / ckpt.name
    return ckpt / "eval"


def _evaluate(checkpoint: Path, data, o: EvalConfig, windows, split: str, progress: bool,
              out: Path) -> dict:
    """:func:`evaluate`'s scoring of a held ``checkpoint``: the report, written in ``out``."""

    config = read_checkpoint_config(checkpoint)
    recorded = config.get("regions") or {}
    regions = list(o.regions or recorded.get("eval") or [])
    if not regions and (windows is None or o.probe):
        raise InputError("name the regions to evaluate ({regions}): this checkpoint records no "
                         "held-out regions", checkpoint, options=("regions",))
    train = list(o.train or recorded.get("train") or [])
    baselines = list(o.baselines)
    if baselines and not train:
        raise InputError("{baselines}: fitting the Markov models needs {train} regions, and the "
                         "checkpoint records none (or leave {baselines} empty)", checkpoint,
                         options=("baselines", "train"))
    if o.copy and not train:
        raise InputError("{copy}: fitting the copy-model reference needs {train} regions, and the "
                         "checkpoint records none (or turn {copy} off)", checkpoint,
                         options=("copy", "train"))
    store = TokenStore(data)
    # a checkpoint saved outside training records no window length: tiles of one segment
    length = o.length or int(config.get("window_length", o.segment))
    wins = eval_windows(store, windows, split, regions, length)
    if not wins:
        raise InputError(f"no windows to evaluate in split {split!r}", data)
    if baselines or o.copy:
        check_apart(store, train, regions if windows is None else [],
                    wins if windows is not None else ())
    model = load_checkpoint(checkpoint, **({"dsa_stage": o.dsa_stage} if o.dsa_stage else {}))
    longest = max(w.length for w in wins)
    edges = cover_edges(o.edges, longest) if o.edges else default_edges(longest)
    sums = {"checkpoint_sha256": weights_sha256(checkpoint),
            "windows_sha256": windows_sha256(store, wins)}
    journal = Journal(out, {**sums, "split": split, "edges": edges, "regions": regions,
                            "train": train, "window_length": length,
                            "options": {k: v for k, v in dataclasses.asdict(o).items()
                                        if k not in ("enabled", "regions", "train", "length")}})
    if len(journal):
        say(progress, f"megabase: evaluate: resuming {out}: {len(journal)} windows finished by "
                      f"{journal.tries - 1} earlier {'try' if journal.tries == 2 else 'tries'}")
    try:
        report = _score(checkpoint, data, o, store, wins, model, edges, train, regions, split,
                        longest, windows, length, progress, journal)
        report.update(sums)
        report["seconds"], report["tries"] = journal.seconds(), journal.tries
        report = written(report, out)
    except KeyboardInterrupt as exc:
        journal.close(finished=False)  # kept for the next try
        if len(journal):
            raise Interrupted(f"the {len(journal)} windows scored so far are kept in "
                              f"{journal.path}; the same command resumes from them") from exc
        raise
    except BaseException:
        journal.close(finished=False)
        raise
    journal.close(finished=True)
    return report


def say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _score(checkpoint: Path, data, o: EvalConfig, store, wins, model, edges, train, regions,
           split, longest, windows, length, progress, journal) -> dict:
    """:func:`_evaluate`'s scoring: the report (without its digests and cost)."""
    n_boot, seed, block, baselines = o.bootstrap, o.seed, o.ci_block, list(o.baselines)
    kw = {"block": block, "journal": journal}
    scorer = ModelScorer(model, o.segment)
    fit_on = rebalance_windows(store, regions if windows is None else [], o, length)
    rebalanced = None
    if fit_on:  # the same windows with the trained selection first: a paired comparison
        with scorer.counting_load() as trained_load:
            trained = accumulate(scorer, store, wins, edges, progress, "trained routing", **kw,
                                 counter=trained_load)
        rebalanced = {"regions": list(o.rebalance),
                      **rebalance_moe(scorer, fit_on, o.rebalance_rounds, progress=progress)}
    with scorer.counting_load() as load:
        scored = accumulate(scorer, store, wins, edges, progress, "model", **kw, counter=load)
    ckpt = Path(checkpoint).resolve()
    # a run's checkpoint is named by its run, so that a sweep's reports stay apart in `compare`
    owner = ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else "model"
    # checkpoint_sha256 (added by _evaluate): what export-model matches the report to, wherever
    # the folder is moved
    report = {"name": f"{owner} {ckpt.name}", "checkpoint": str(Path(checkpoint).resolve()),
              "data": str(Path(data).resolve()), "split": split, "n_windows": len(wins),
              "window_length": longest, "edges": edges,
              **scored.summary(n_boot=n_boot, seed=seed), "moe_load": moe_load_summary(load)}
    if rebalanced:
        report["moe_rebalance"] = {
            **rebalanced, "trained": {**trained.summary(n_boot=n_boot, seed=seed)["overall"],
                                      "moe_load": moe_load_summary(trained_load)},
            # trained minus re-fitted routing, paired per window: what the imbalance costs
            "cost": paired_gain(whole(scored), whole(trained), n_boot, seed)[0]}
    report["controls"], report["context_gain"] = {}, {}
    controls = {}
    for c in o.controls:
        if c < longest:
            controls[c] = accumulate(truncated(scorer, c), store, wins, edges, progress,
                                     f"control <= {c}", **kw)
            report["controls"][str(c)] = controls[c].summary(n_boot=n_boot, seed=seed)
            report["context_gain"][str(c)] = paired_gain(scored, controls[c], n_boot, seed)
    if o.ablations:
        limit = o.limit_of_ablations()
        report["ablations"] = {}
        for name in o.ablations:
            acc = accumulate(ablated(scorer, name, limit), store, wins, edges, progress,
                             f"{name} at {limit}", **kw)
            report["ablations"][name] = {
                "label": label(name, limit), "limit": limit, **acc.summary(n_boot=n_boot, seed=seed),
                # ablated minus the model, paired: positive where the cut context helped
                "cost": paired_gain(scored, acc, n_boot, seed),
                "cost_beyond": gain_beyond(scored, acc, limit, n_boot, seed)
                if any(e >= limit for e in edges[1:-1]) else None}
    if o.copy:
        entry, full, accs = copy_reference(store, o.copy_spec(), train, wins, edges,
                                           list(controls), n_boot, seed, progress, **kw)
        report["copy_reference"] = entry
        report["context_worth"] = {
            str(c): context_worth((scored, controls[c]), (full, accs[c]), c, n_boot, seed)
            for c in controls if any(e >= c for e in edges[1:-1])}
    report["baselines"] = {
        f"markov order {k}": score_series(markov_scorer(fit_markov(store, k, train)), store,
                                          wins, edges, n_boot, seed, progress, f"markov {k}",
                                          **kw)
        for k in baselines
    }
    if report["baselines"]:
        best = min(report["baselines"], key=lambda k: report["baselines"][k]["overall"]["bits_per_base"])
        report["best_baseline"] = {"name": best,
                                   "bits_per_base": report["baselines"][best]["overall"]["bits_per_base"]}
    if o.probe:
        held_out = np.concatenate(region_tokens(store, regions))
        distances = list(o.probe_distances) or probe_distances(longest, 200)
        report["probe"] = recall_probe(scorer, held_out, distances, n_per_distance=o.probe_windows,
                                       seed=seed, n_boot=n_boot, pairs=o.probe_pairs,
                                       progress=progress, journal=journal)
    return report


def rebalance_windows(store: TokenStore, scored: list[str], o: EvalConfig,
                      length: int) -> list[np.ndarray]:
    """``o.rebalance``'s bases in windows of ``length`` (token arrays), refusing regions that share
    bases with the ``scored`` ones; checked before any scoring."""
    if not o.rebalance:
        return []
    splits = {"rebalance": list(o.rebalance), **({"scored": scored} if scored else {})}
    tiles, _ = make_windows(store, splits, length, max_n_frac=1.0)
    wins = [np.array(store.tokens(w.chrom)[w.start : w.end]) for w in tiles if w.split == "rebalance"]
    wins = [t for t in wins if (t < 4).any()]
    if not wins:
        raise InputError("{rebalance}: its regions hold no A/C/G/T to route", store.path,
                         options=("rebalance",))
    return wins


def moe_load_summary(load) -> list[dict]:
    """Per MoE layer, over the held-out windows: max/mean routed load, idle experts, the counts."""
    out = []
    for i, row in enumerate(load.tolist()):
        mean = sum(row) / len(row) if row else 0.0
        out.append({"layer": i, "max_over_mean": max(row) / mean if mean else None,
                    "idle_experts": sum(1 for c in row if c == 0), "tokens": [int(c) for c in row]})
    return out


def check_output(out: Path) -> None:
    """The report folder, checked before minutes of scoring."""
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a directory; choose another output folder", out)
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(parent, os.W_OK):
        raise InputError("is not writable; choose another output folder", parent)


def written(report: dict, out: Path) -> dict:
    """``report`` with its files written in ``out`` (``report["files"]``: name -> path)."""
    files = write_report(report, out)
    report["files"] = {k: str(p) for k, p in files.items()}
    return report


def scored_windows(store: TokenStore, train: list[str], eval_regions: list[str], length: int):
    """A baseline's windows: ``eval_regions`` tiled by ``length``, checked apart from ``train``
    (:func:`check_apart`) and not empty."""
    check_apart(store, train, eval_regions)
    wins = eval_windows(store, None, "eval", eval_regions, length)
    if not wins:
        raise InputError(f"no windows to score in {', '.join(eval_regions)}", store.path)
    return wins


def markov_baseline(data: str | Path, order: int, train: list[str], eval_regions: list[str],
                    out: str | Path, length: int = 65_536, edges: list[int] | None = None,
                    n_boot: int = EvalConfig.bootstrap, seed: int = 0,
                    progress: bool = True) -> dict:
    """Fit an order-``order`` Markov model on ``train`` and report it on ``eval_regions`` (files
    in ``out``; its ``name`` is ``markov order K``)."""
    started = time.perf_counter()
    store = TokenStore(data)
    wins = scored_windows(store, train, eval_regions, length)
    edges = cover_edges(edges, length) if edges else default_edges(max(w.length for w in wins))
    scorer = markov_scorer(fit_markov(store, order, train))
    report = {"name": f"markov order {order}", "data": str(Path(data).resolve()),
              "train": train, "eval": eval_regions, "n_windows": len(wins),
              "window_length": length, "edges": edges, "windows_sha256": windows_sha256(store, wins),
              **score_series(scorer, store, wins, edges, n_boot, seed, progress, f"markov {order}")}
    report["seconds"] = time.perf_counter() - started
    return written(report, Path(out))


def copy_baseline(data: str | Path, train: list[str], eval_regions: list[str], out: str | Path,
                  spec: CopySpec | None = None, controls: list[int] = (1000,),
                  length: int = 65_536, edges: list[int] | None = None,
                  n_boot: int = EvalConfig.bootstrap, seed: int = 0,
                  progress: bool = True) -> dict:
    """The copy-model reference alone: fitted on ``train``, reported on ``eval_regions`` with its
    gain over each context limit in ``controls`` (the report format of every baseline; its
    controls are the reference's own), files in ``out``."""
    started = time.perf_counter()
    spec = (spec or CopySpec()).check()
    controls = check_controls(controls)
    store = TokenStore(data)
    wins = scored_windows(store, train, eval_regions, length)
    longest = max(w.length for w in wins)
    edges = cover_edges(edges, longest) if edges else default_edges(longest)
    entry, _, _ = copy_reference(store, spec, train, wins, edges,
                                 [c for c in controls if c < longest], n_boot, seed, progress)
    report = {**entry, "data": str(Path(data).resolve()), "train": train, "eval": eval_regions,
              "n_windows": len(wins), "window_length": longest, "edges": edges,
              "windows_sha256": windows_sha256(store, wins)}
    report["seconds"] = time.perf_counter() - started
    return written(report, Path(out))
