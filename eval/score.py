"""Scoring held-out windows: per-base NLL from a model or a baseline, the truncation control, the
in-context recall probe.

A *scorer* maps a window's tokens (``uint8 [n]``) to per-base NLL in nats (``float64 [n]``, NaN
where the target is not A/C/G/T); the target at offset ``i`` is predicted from the ``i`` bases
before it in the same window (and a ``<sep>`` start token for the model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from megabase.data.vocab import N_BASES, SEP

Scorer = Callable[[np.ndarray], np.ndarray]


class ModelScorer:
    """A :class:`~megabase.model.HybridLM` as a scorer; windows longer than ``segment`` are
    streamed (KDA states and DSA caches carried), which equals the full pass exactly."""

    def __init__(self, model, segment: int | None = None):
        self.model, self.segment = model.eval(), segment

    @torch.no_grad()
    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        from megabase.model import log_probs

        seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
        seg = self.segment if self.segment and len(tokens) > self.segment else None
        nll = -log_probs(self.model, seq, segment=seg)[0].double().numpy()
        nll[tokens >= N_BASES] = np.nan
        return nll


def markov_scorer(model) -> Scorer:
    """An order-k :class:`~megabase.eval.markov.MarkovModel` as a scorer."""
    return lambda tokens: -model.log_probs(tokens)


def truncated(scorer: Scorer, limit: int) -> Scorer:
    """The control: every target scored with at most ~``limit`` bases of context.

    Targets at offsets ``< limit`` keep their full context (it is already short); a target at
    offset ``i >= limit`` is scored inside the piece ``[(k-1) limit, (k+1) limit)`` with
    ``k = i // limit``, so its context is between ``limit`` and ``2 limit`` bases. Comparing the
    model's curve with this one separates "more context helps" from "later positions are easier".
    """
    if limit < 1:
        raise ValueError(f"context limit must be positive, got {limit}")

    def score(tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        out = np.full(n, np.nan)
        out[: min(limit, n)] = scorer(tokens[: min(limit, n)])
        for k in range(1, -(-n // limit)):
            start = (k - 1) * limit
            piece = scorer(tokens[start : (k + 1) * limit])
            out[k * limit : (k + 1) * limit] = piece[limit : 2 * limit]
        return out

    return score


def recall_windows(tokens: np.ndarray, distances: list[int], copy_len: int, n_per_distance: int,
                   seed: int = 0) -> Iterator[tuple[int, np.ndarray, int]]:
    """Probe windows cut from real held-out sequence: ``window[d : d+m]`` is replaced by a copy of
    ``window[0 : m]``, so the same ``m`` bases appear twice, ``d`` bases apart.

    Yields ``(d, window, m)``. Only stretches without ``N`` are used.
    """
    rng = np.random.default_rng(seed)
    clean = tokens < N_BASES
    for d in distances:
        length = d + copy_len
        if length > len(tokens):
            continue
        bad = np.concatenate([[0], np.cumsum(~clean)])
        starts = np.flatnonzero(bad[length:] - bad[:-length] == 0)
        if len(starts) == 0:
            continue
        for start in rng.choice(starts, size=min(n_per_distance, len(starts)), replace=False):
            window = np.array(tokens[start : start + length])
            window[d:] = window[:copy_len]
            yield d, window, copy_len


def recall_probe(scorer: Scorer, tokens: np.ndarray, distances: list[int], copy_len: int = 200,
                 n_per_distance: int = 4, seed: int = 0) -> list[dict]:
    """Bits/base on the first and second copy, per distance ``d``. A model that uses context
    ``>= d`` predicts the second copy far better than the first."""
    rows: dict[int, list[np.ndarray]] = {}
    for d, window, m in recall_windows(tokens, distances, copy_len, n_per_distance, seed):
        nll = scorer(window)
        rows.setdefault(d, []).append(np.array([np.nansum(nll[:m]), np.nansum(nll[d : d + m]), m]))
    out = []
    for d in sorted(rows):
        first, second, m = np.sum(rows[d], axis=0)
        out.append({"distance": d, "copy_length": copy_len, "n_windows": len(rows[d]),
                    "first_copy_bits_per_base": first / m / np.log(2),
                    "second_copy_bits_per_base": second / m / np.log(2)})
    return out
