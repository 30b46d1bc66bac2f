"""The in-context recall probe: real held-out sequence in which a stretch reappears ``d`` bases later.

A model that uses ``d`` bases of context predicts the second copy far better than the first; one
that does not scores both alike. Beside the bits/base of each copy (with bootstrap CIs over
windows), a model's probe reports, per DSA layer, how often the top-k of a second-copy query holds
the aligned key of the first copy: the key a copying head must attend to. A hit rate near the
chance rate ``topk / d`` means the indexer cannot find the first copy, whatever the attention
would do with it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megabase.core.vocab import N_BASES
from megabase.data.progress import Progress
from megabase.model.dsa import capture_selections

from .bins import LN2


PROBE_DISTANCES = (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000)


def probe_distances(window_length: int, copy_len: int) -> list[int]:
    """The standard distances whose probe window (``d + copy_len``) fits ``window_length``, and
    the longest that fits, so the probe reaches the length the model was trained on."""
    longest = window_length - copy_len
    out = [d for d in PROBE_DISTANCES if d < longest]
    if longest > copy_len and (not out or longest > out[-1] * 1.05):
        out.append(longest)
    return out


def recall_windows(tokens: np.ndarray, distances: list[int], copy_len: int, n_per_distance: int,
                   seed: int = 0, max_n_frac: float = 0.5, pairs: int = 1
                   ) -> Iterator[tuple[int, np.ndarray, int, list[int]]]:
    """Probe windows cut from real held-out sequence: ``window[o + d : o + d + m]`` is replaced by
    a copy of ``window[o : o + m]`` for each offset ``o``, so the same ``m`` bases appear twice,
    ``d`` bases apart.

    Yields ``(d, window, m, offsets)``. With ``pairs = 1`` the one copy starts the window
    (``offsets == [0]``, the window ``d + m`` long); with more, up to ``pairs`` copies start at
    random ``m``-aligned offsets of the window's first ``min(5 * m * pairs, d)`` bases (the window
    that much longer than ``d``), so one pass over a megabase window probes several copies: at
    ``d`` = 1M, 32 windows cost 32 passes of 1M bases, 4 windows of 8 pairs four. The copied
    stretches hold no ``N``, and the window as a whole at most ``max_n_frac`` of them: in an
    assembly with gaps every few kb (the human subset's runs of real sequence have a median of
    1.5 kb) windows without any ``N`` at 16 kb would all come from the same few long runs.
    """
    rng = np.random.default_rng(seed)
    clean = tokens < N_BASES
    bad = np.concatenate([[0], np.cumsum(~clean)])
    m = copy_len
    for d in distances:
        span = m if pairs == 1 else max(m, min(5 * m * pairs, d))
        length = d + span
        if length > len(tokens):
            continue
        n_in_window = bad[length:] - bad[:-length]
        ok = n_in_window <= max_n_frac * length
        if pairs == 1:
            ok &= (bad[m:] - bad[:-m])[: len(n_in_window)] == 0
        starts = np.flatnonzero(ok)
        if len(starts) == 0:
            continue
        for start in rng.choice(starts, size=min(n_per_distance, len(starts)), replace=False):
            window = np.array(tokens[start : start + length])
            if pairs == 1:
                offsets = [0]
            else:
                slots = [o for o in range(0, span - m + 1, m) if (window[o : o + m] < N_BASES).all()]
                if not slots:
                    continue
                offsets = sorted(int(o) for o in rng.choice(slots, min(pairs, len(slots)),
                                                            replace=False))
            for o in offsets:
                window[o + d : o + d + m] = window[o : o + m]
            yield d, window, m, offsets


def _score(scorer, window: np.ndarray, d: int, m: int, offsets: list[int]):
    """NLL of the window and, for a model scorer, each DSA layer's hit rate on each second copy
    (``[pairs][layers]``)."""
    model = getattr(scorer, "model", None)
    if model is None:
        return scorer(window), None, None
    lo, hi = offsets[0] + d, offsets[-1] + d + m
    captures = capture_selections(model, lo, hi)
    nll = scorer(window, ctx=model.context(capture=captures))
    hits, chance = [], []
    for o in offsets:
        rows = slice(o + d - lo, o + d + m - lo)
        aligned = np.arange(o + d, o + d + m) - d + 1  # query i predicts window[i]; key i - d + 1
        hits.append([float((cap.rows[rows] == aligned[:, None]).any(1).mean())
                     if cap.seen[rows].all() else None for cap in captures])
        chance.append(float(np.minimum(1.0, model.cfg.topk / np.arange(o + d + 1, o + d + m + 1)).mean()))
    return nll, hits, chance


def recall_probe(scorer, tokens: np.ndarray, distances: list[int], copy_len: int = 200,
                 n_per_distance: int = 32, seed: int = 0, n_boot: int = 1000,
                 pairs: int = 1, progress: bool = False, journal=None) -> list[dict]:
    """Per distance ``d``: bits/base on the first and the second copy, the second's 95% bootstrap
    CI over copies and the gain's (first minus second), and ``dsa_hit_rate`` per DSA layer (None
    where a layer ran dense or for a scorer that is not a model) beside ``chance_hit_rate``, what
    a selection blind to content would reach (``topk`` of the ``i + 1`` keys of query ``i``).
    ``n_per_distance`` windows, each with up to ``pairs`` copies (:func:`recall_windows`).
    ``progress``: windows scored, as :mod:`megabase.data.progress` shows them (at most
    ``n_per_distance`` per distance: a distance too long for ``tokens`` has none). ``journal``
    (:class:`~megabase.eval.journal.Journal`): windows a stopped try scored are read from it (the
    windows are drawn again, in the same order, and only the rest are scored)."""
    rows: dict[int, list] = {}
    windows: dict[int, int] = {}
    with Progress(len(distances) * n_per_distance, "recall probe", unit="window",
                  enabled=progress) as bar:
        for j, (d, window, m, offsets) in enumerate(recall_windows(
                tokens, distances, copy_len, n_per_distance, seed, pairs=pairs)):
            windows[d] = windows.get(d, 0) + 1
            done = journal.get("recall probe", j) if journal is not None else None
            if done is None:
                nll, hits, chance = _score(scorer, window, d, m, offsets)
                done = {"copies": [
                    [float(np.nansum(nll[o : o + m])), float(np.nansum(nll[o + d : o + d + m])), m,
                     None if hits is None else hits[i], None if chance is None else chance[i]]
                    for i, o in enumerate(offsets)]}
                if journal is not None:
                    journal.add("recall probe", j, **done)
            rows.setdefault(d, []).extend(tuple(c) for c in done["copies"])
            bar.update(1, bases=len(window))
    rng = np.random.default_rng(seed)
    out = []
    for d in sorted(rows):
        first, second, m = (np.array([r[i] for r in rows[d]], dtype=float) for i in range(3))
        n = len(first)
        boot = rng.integers(0, n, size=(n_boot, n))
        per_base = m[boot].sum(1) * LN2
        second_ci = np.quantile(second[boot].sum(1) / per_base, [0.025, 0.975])
        gain_ci = np.quantile((first - second)[boot].sum(1) / per_base, [0.025, 0.975])
        hits = [r[3] for r in rows[d] if r[3] is not None]
        rate = None
        if hits:
            rate = [None if any(h[i] is None for h in hits) else float(np.mean([h[i] for h in hits]))
                    for i in range(len(hits[0]))]
        chance = [r[4] for r in rows[d] if r[4] is not None]
        out.append({"distance": d, "copy_length": copy_len, "n_windows": windows[d], "n_copies": n,
                    "first_copy_bits_per_base": first.sum() / m.sum() / LN2,
                    "second_copy_bits_per_base": second.sum() / m.sum() / LN2,
                    "second_copy_ci": [float(x) for x in second_ci],
                    "gain_bits_per_base": (first - second).sum() / m.sum() / LN2,
                    "gain_ci": [float(x) for x in gain_ci],
                    "dsa_hit_rate": rate,
                    "chance_hit_rate": float(np.mean(chance)) if chance else None})
    return out
