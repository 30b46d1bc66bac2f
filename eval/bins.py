"""Per-token NLL aggregated into prior-context bins, split repeat / unique, with bootstrap CIs.

A target base at offset ``i`` of its window has ``i`` bases of prior context. Bins are half-open
``[lo, hi)`` ranges of that context length, log-spaced by default. Every number is a ratio of sums
(total nats / scored bases), so bins and windows combine exactly; confidence intervals resample
whole windows (the unit that is independent), not single bases. With few long windows (ten of a
megabase), ten units make a CI that means little: ``block`` then makes each window's consecutive
stretches of ``block`` bases the units, and each bin resamples those that scored a base in it.
Stretches of one window are not independent (a repeat family or an isochore spans several), so
such CIs are somewhat narrow; the report names its unit.
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
    """Running sums ``[n_units, n_bins, 2 (unique, repeat)]`` of NLL and of scored bases; a unit
    is a window, or with ``block`` each stretch of ``block`` bases of a window (the bootstrap's
    resampling unit, see the module's docs)."""

    edges: list[int]
    nats: list[np.ndarray] = field(default_factory=list)
    counts: list[np.ndarray] = field(default_factory=list)
    block: int | None = None
    n_windows: int = 0

    def __post_init__(self) -> None:
        self.edges = check_edges(self.edges)
        if self.block is not None and self.block < 1:
            raise ValueError(f"a CI block must be a positive number of bases, got {self.block}")

    def window_rows(self, nll: np.ndarray, scored: np.ndarray, repeat: np.ndarray,
                    context: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One window's sums, ``(nats, counts)``, each ``[units, n_bins, 2]``: ``nll``,
        ``scored`` (bool), ``repeat`` (bool), all ``[n]``.

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
        units = 1 if self.block is None else max(1, -(-n // self.block))
        unit = np.zeros(n, np.int64) if self.block is None else np.arange(n) // self.block
        slot = (unit[keep] * nbins + b[keep]) * 2 + np.asarray(repeat, bool)[keep]
        size = units * nbins * 2
        nats = np.bincount(slot, weights=np.asarray(nll, np.float64)[keep], minlength=size)
        count = np.bincount(slot, minlength=size)
        return nats.reshape(units, nbins, 2), count.reshape(units, nbins, 2)

    def add_window(self, nll: np.ndarray, scored: np.ndarray, repeat: np.ndarray,
                   context: np.ndarray | None = None) -> None:
        """One window (:meth:`window_rows`' arguments)."""
        self.add_rows(*self.window_rows(nll, scored, repeat, context))

    def add_rows(self, nats: np.ndarray, counts: np.ndarray) -> None:
        """One window's :meth:`window_rows` (e.g. read back from a stopped evaluation's journal)."""
        self.nats.extend(np.asarray(nats, np.float64))
        self.counts.extend(np.asarray(counts, np.int64))
        self.n_windows += 1

    def unit(self) -> dict:
        """What the CIs resample: ``{"kind": "window"}`` or ``{"kind": "block", "bases": B}``,
        with ``n_units`` and ``n_windows``."""
        kind = {"kind": "window"} if self.block is None else {"kind": "block", "bases": self.block}
        return {**kind, "n_units": len(self.nats), "n_windows": self.n_windows}

    def summary(self, n_boot: int = 1000, seed: int = 0, ci: float = 0.95) -> dict:
        """``{"bins": [...], "overall": {...}, "n_windows", "ci_unit"}``; each entry has
        n_tokens, nats/bits per base, perplexity, repeat/unique splits and a bootstrap CI of bits
        per base over the units that scored a base in it (``n_units``)."""
        nats = np.stack(self.nats) if self.nats else np.zeros((0, len(self.edges) - 1, 2))
        counts = np.stack(self.counts) if self.counts else np.zeros_like(nats)
        rng = np.random.default_rng(seed)
        W = nats.shape[0]
        boot = rng.integers(0, W, size=(n_boot, W)) if W and n_boot else None
        bins = []
        for i, (lo, hi) in enumerate(zip(self.edges, self.edges[1:])):
            rows, sel = _units(counts[:, i].sum(-1), boot, n_boot, (seed, i))
            bins.append({"context_lo": lo, "context_hi": hi,
                         **_entry(nats[rows, i], counts[rows, i], sel, ci)})
        rows, sel = _units(counts.sum((1, 2)), boot, n_boot, (seed, len(bins)))
        overall = {"context_lo": self.edges[0], "context_hi": self.edges[-1],
                   **_entry(nats[rows].sum(1), counts[rows].sum(1), sel, ci)}
        return {"bins": bins, "overall": overall, "n_windows": self.n_windows,
                "ci_unit": self.unit()}


def unit_words(unit: dict | None) -> str:
    """A report's ``ci_unit`` in words: ``windows`` or ``blocks of 65,536 bases``."""
    if not unit or unit.get("kind") != "block":
        return "windows"
    return f"blocks of {unit['bases']:,} bases"


def _units(counts: np.ndarray, boot, n_boot: int, seed) -> tuple[np.ndarray, np.ndarray | None]:
    """The units a bin resamples, those with a scored base in it (``counts``: ``[units]``), and
    their bootstrap draws: ``boot`` itself when every unit has one (whole windows: the draws, and
    so the CIs, of reports made before blocks existed), else draws of the ones that do."""
    rows = np.flatnonzero(counts > 0)
    if boot is None or len(rows) == len(counts):
        return np.arange(len(counts)), boot
    if not len(rows):
        return rows, None
    return rows, np.random.default_rng(seed).integers(0, len(rows), size=(n_boot, len(rows)))


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
    out["n_units"] = int((counts.sum(1) > 0).sum())
    return out


def paired_gain(base: BinAccumulator, other: BinAccumulator, n_boot: int = 1000, seed: int = 0,
                ci: float = 0.95) -> list[dict]:
    """Bits/base of ``other`` minus ``base`` per bin, on the same windows (a control against the
    model: positive means the model gains from its longer context), overall and repeat / unique,
    with a paired bootstrap CI: each resample takes the same units (windows, or blocks of them)
    for both, so the spread between units that both curves share cancels."""
    a_n, a_c = np.stack(base.nats), np.stack(base.counts)
    b_n, b_c = np.stack(other.nats), np.stack(other.counts)
    if a_n.shape != b_n.shape:
        raise ValueError("paired_gain needs the same windows and bins on both sides")
    rng = np.random.default_rng(seed)
    boot = rng.integers(0, a_n.shape[0], size=(n_boot, a_n.shape[0])) if n_boot and len(a_n) \
        else None
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
            units, draws = _units(a_c[:, i][:, sel].sum(-1), boot, n_boot, (seed, i))
            entry["n_units"] = int((a_c[units, i][:, sel].sum(-1) > 0).sum())
            if draws is not None and entry["gain_bits_per_base"] is not None:
                an, ac, bn, bc = (x[units, i] for x in (a_n, a_c, b_n, b_c))
                diff = f(bn[draws].sum(1), bc[draws].sum(1)) - f(an[draws].sum(1), ac[draws].sum(1))
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
    out = BinAccumulator([0, e, acc.edges[-1]], block=acc.block, n_windows=acc.n_windows)
    for nats, counts in zip(acc.nats, acc.counts):
        out.nats.append(np.stack([nats[:i].sum(0), nats[i:].sum(0)]))
        out.counts.append(np.stack([counts[:i].sum(0), counts[i:].sum(0)]))
    return out


def whole(acc: BinAccumulator) -> BinAccumulator:
    """``acc`` with one bin, every context length pooled."""
    out = BinAccumulator([acc.edges[0], acc.edges[-1]], block=acc.block, n_windows=acc.n_windows)
    out.nats = [n.sum(0, keepdims=True) for n in acc.nats]
    out.counts = [c.sum(0, keepdims=True) for c in acc.counts]
    return out


def gain_beyond(full: BinAccumulator, control: BinAccumulator, lo: int, n_boot: int = 1000,
                seed: int = 0) -> dict:
    """:func:`paired_gain` of ``control`` over ``full`` pooled over every bin beyond ``lo``: one
    row ``{context_lo, context_hi, all, unique, repeat}``."""
    return paired_gain(pooled(full, lo), pooled(control, lo), n_boot, seed)[1]
