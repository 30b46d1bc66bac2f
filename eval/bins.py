"""Per-token NLL aggregated into prior-context bins, split repeat / unique, with bootstrap CIs.

A target base at offset ``i`` of its window has ``i`` bases of prior context. Bins are half-open
``[lo, hi)`` ranges of that context length, log-spaced by default. Every number is a ratio of sums
(total nats / scored bases), so bins and windows combine exactly; confidence intervals resample
whole windows (the unit that is independent), not single bases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LN2 = math.log(2.0)
DEFAULT_EDGES = (0, 1_000, 4_000, 16_000, 64_000, 256_000, 512_000, 1_048_576)


def default_edges(length: int) -> list[int]:
    """Log-spaced edges covering ``[0, length)``: the standard ones below ``length``, then ``length``."""
    if length < 1:
        raise ValueError(f"window length must be positive, got {length}")
    return [e for e in DEFAULT_EDGES if e < length] + [length]


def check_edges(edges) -> list[int]:
    edges = [int(e) for e in edges]
    if len(edges) < 2 or edges[0] != 0 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bin edges must start at 0 and increase strictly, got {edges}")
    return edges


def cover_edges(edges, length: int) -> list[int]:
    """``edges`` (checked) with one more bin, ``[edges[-1], length)``, when they stop short of a
    window of ``length`` bases: every scored base then falls in a bin, so the overall row covers
    them all, and the bins asked for stay as they were. ``[0, 100, 1000]`` for 20,000 ->
    ``[0, 100, 1000, 20000]``."""
    edges = check_edges(edges)
    return edges + [int(length)] if edges[-1] < length else edges


@dataclass
class BinAccumulator:
    """Running sums ``[n_windows, n_bins, 2 (unique, repeat)]`` of NLL and of scored bases."""

    edges: list[int]
    nats: list[np.ndarray] = field(default_factory=list)
    counts: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.edges = check_edges(self.edges)

    def add_window(self, nll: np.ndarray, scored: np.ndarray, repeat: np.ndarray,
                   context: np.ndarray | None = None) -> None:
        """One window: ``nll``, ``scored`` (bool), ``repeat`` (bool), all ``[n]``.

        ``context`` (prior-context length per position) defaults to ``0..n-1``; a scored
        position past the last edge is a ValueError (the edges must cover the window).
        """
        n = len(nll)
        context = np.arange(n) if context is None else np.asarray(context)
        nbins = len(self.edges) - 1
        b = np.searchsorted(self.edges, context, side="right") - 1
        scored = np.asarray(scored, bool)
        if (scored & (b >= nbins)).any():  # dropped, they would vanish from the overall row too
            raise ValueError(f"a scored base has {int(context[scored].max())} bases of context, "
                             f"past the last bin edge {self.edges[-1]} (see cover_edges)")
        keep = scored & (b >= 0)
        slot = b[keep] * 2 + np.asarray(repeat, bool)[keep]
        nats = np.bincount(slot, weights=np.asarray(nll, np.float64)[keep], minlength=2 * nbins)
        count = np.bincount(slot, minlength=2 * nbins)
        self.nats.append(nats.reshape(nbins, 2))
        self.counts.append(count.reshape(nbins, 2))

    def summary(self, n_boot: int = 1000, seed: int = 0, ci: float = 0.95) -> dict:
        """``{"bins": [...], "overall": {...}}``; each entry has n_tokens, nats/bits per base,
        perplexity, repeat/unique splits and a bootstrap CI of bits per base over windows."""
        nats = np.stack(self.nats) if self.nats else np.zeros((0, len(self.edges) - 1, 2))
        counts = np.stack(self.counts) if self.counts else np.zeros_like(nats)
        rng = np.random.default_rng(seed)
        W = nats.shape[0]
        boot = rng.integers(0, W, size=(n_boot, W)) if W and n_boot else None
        bins = []
        for i, (lo, hi) in enumerate(zip(self.edges, self.edges[1:])):
            bins.append({"context_lo": lo, "context_hi": hi,
                         **_entry(nats[:, i], counts[:, i], boot, ci)})
        overall = {"context_lo": self.edges[0], "context_hi": self.edges[-1],
                   **_entry(nats.sum(1), counts.sum(1), boot, ci)}
        return {"bins": bins, "overall": overall, "n_windows": W}


def _stats(nats: float, count: float) -> dict:
    if count <= 0:
        return {"n_tokens": 0, "nats_per_base": None, "bits_per_base": None, "perplexity": None}
    npb = nats / count
    return {"n_tokens": int(count), "nats_per_base": npb, "bits_per_base": npb / LN2,
            "perplexity": math.exp(npb)}


def _entry(nats: np.ndarray, counts: np.ndarray, boot, ci: float) -> dict:
    """``nats, counts``: ``[n_windows, 2 (unique, repeat)]``."""
    out = _stats(nats.sum(), counts.sum())
    out["unique"] = _stats(nats[:, 0].sum(), counts[:, 0].sum())
    out["repeat"] = _stats(nats[:, 1].sum(), counts[:, 1].sum())
    lo = hi = None
    if boot is not None and out["n_tokens"]:
        tot_n, tot_c = nats.sum(1)[boot].sum(1), counts.sum(1)[boot].sum(1)
        ok = tot_c > 0
        if ok.any():
            bpb = tot_n[ok] / tot_c[ok] / LN2
            lo, hi = (float(q) for q in np.quantile(bpb, [(1 - ci) / 2, (1 + ci) / 2]))
    out["bits_per_base_ci"] = [lo, hi]
    return out


def paired_gain(base: BinAccumulator, other: BinAccumulator, n_boot: int = 1000, seed: int = 0,
                ci: float = 0.95) -> list[dict]:
    """Bits/base of ``other`` minus ``base`` per bin, on the same windows (a control against the
    model: positive means the model gains from its longer context), overall and repeat / unique,
    with a paired bootstrap CI: each resample takes the same windows for both, so the window-to-
    window spread that both curves share cancels."""
    a_n, a_c = np.stack(base.nats), np.stack(base.counts)
    b_n, b_c = np.stack(other.nats), np.stack(other.counts)
    if a_n.shape != b_n.shape:
        raise ValueError("paired_gain needs the same windows and bins on both sides")
    rng = np.random.default_rng(seed)
    boot = rng.integers(0, a_n.shape[0], size=(n_boot, a_n.shape[0])) if n_boot else None
    q = [(1 - ci) / 2, (1 + ci) / 2]

    def gain(sel):  # sel: [..., 2] -> sum over the chosen kinds
        def per(n, c):
            tot_c = c[..., sel].sum(-1)
            return np.where(tot_c > 0, n[..., sel].sum(-1) / np.maximum(tot_c, 1), np.nan) / LN2
        return per

    rows = []
    for i, (lo, hi) in enumerate(zip(base.edges, base.edges[1:])):
        row = {"context_lo": lo, "context_hi": hi}
        for name, sel in (("all", [0, 1]), ("unique", [0]), ("repeat", [1])):
            f = gain(sel)
            value = f(b_n[:, i].sum(0), b_c[:, i].sum(0)) - f(a_n[:, i].sum(0), a_c[:, i].sum(0))
            entry = {"gain_bits_per_base": None if np.isnan(value) else float(value),
                     "n_tokens": int(a_c[:, i][:, sel].sum()), "ci": [None, None]}
            if boot is not None and entry["gain_bits_per_base"] is not None:
                diff = f(b_n[:, i][boot].sum(1), b_c[:, i][boot].sum(1)) - \
                    f(a_n[:, i][boot].sum(1), a_c[:, i][boot].sum(1))
                diff = diff[~np.isnan(diff)]
                if diff.size:
                    entry["ci"] = [float(x) for x in np.quantile(diff, q)]
            row[name] = entry
        rows.append(row)
    return rows


def pooled(acc: BinAccumulator, lo: int) -> BinAccumulator:
    """``acc`` with two bins: context ``[0, e)`` and ``[e, end)``, ``e`` the first edge >= ``lo``
    (so a control's limit that is not an edge pools the bins that lie wholly beyond it)."""
    e = next((x for x in acc.edges[1:-1] if x >= lo), None)
    if e is None:
        raise ValueError(f"no bin starts at or beyond {lo} (edges {acc.edges})")
    i = acc.edges.index(e)
    out = BinAccumulator([0, e, acc.edges[-1]])
    for nats, counts in zip(acc.nats, acc.counts):
        out.nats.append(np.stack([nats[:i].sum(0), nats[i:].sum(0)]))
        out.counts.append(np.stack([counts[:i].sum(0), counts[i:].sum(0)]))
    return out


def whole(acc: BinAccumulator) -> BinAccumulator:
    """``acc`` with one bin, every context length pooled."""
    out = BinAccumulator([acc.edges[0], acc.edges[-1]])
    out.nats = [n.sum(0, keepdims=True) for n in acc.nats]
    out.counts = [c.sum(0, keepdims=True) for c in acc.counts]
    return out


def gain_beyond(full: BinAccumulator, control: BinAccumulator, lo: int, n_boot: int = 1000,
                seed: int = 0) -> dict:
    """:func:`paired_gain` of ``control`` over ``full`` pooled over every bin beyond ``lo``: one
    row ``{context_lo, context_hi, all, unique, repeat}``."""
    return paired_gain(pooled(full, lo), pooled(control, lo), n_boot, seed)[1]
