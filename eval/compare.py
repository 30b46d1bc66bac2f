"""Side-by-side bits/base per prior-context bin for several reports (files or MLflow runs)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megabase.core.errors import InputError

from .report import series


@dataclass
class Comparison:
    """``columns``: one name per curve; ``rows``: ``(context_lo, context_hi)`` per bin, ``None``
    for the overall row; ``bits[c][r]``: bits/base (NaN where a curve has no such bin);
    ``tokens[c][r]``: scored bases; ``windows[c]``: the digest of the windows the curve scored
    (``windows_sha256`` of its report; None for reports written before it was recorded)."""

    columns: list[str]
    rows: list[tuple[int, int] | None]
    bits: list[list[float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    windows: list[str | None] = field(default_factory=list)

    def comparable(self, column: int, reference: int = 0) -> list[bool]:
        """Per row, whether ``column`` and ``reference`` scored the same bases there: the same
        windows (where both reports record them) and as many bases. Only then is a difference of
        bits/base a gain, rather than the difference between two sets of bases."""
        if self._other_windows(column, reference):
            return [False] * len(self.rows)
        return [x == y for x, y in zip(self.tokens[reference], self.tokens[column])]

    def _other_windows(self, column: int, reference: int = 0) -> bool:
        a, b = (self.windows[c] if c < len(self.windows) else None for c in (reference, column))
        return a is not None and b is not None and a != b

    def gain(self, column: int, reference: int = 0) -> list[float]:
        """Bits/base saved by ``column`` relative to ``reference`` (positive: ``column`` is
        better); NaN where they did not score the same bases (:meth:`comparable`)."""
        return [a - b if ok else float("nan") for a, b, ok in
                zip(self.bits[reference], self.bits[column], self.comparable(column, reference))]

    def notes(self) -> list[str]:
        """One line per curve whose gain is left out somewhere, saying why."""
        out = []
        ref = self.columns[0]
        for c in range(1, len(self.columns)):
            ok = self.comparable(c)
            both = [self.tokens[0][r] and self.tokens[c][r] for r in range(len(self.rows))]
            if all(o for o, b in zip(ok, both) if b):
                continue
            if self._other_windows(c):
                why = (f"scored other windows ({self.tokens[c][-1]:,} bases against "
                       f"{self.tokens[0][-1]:,})")
            else:
                r = [r for r, (o, b) in enumerate(zip(ok, both)) if b and not o][-1]
                lo_hi = self.rows[r]
                where = "all" if lo_hi is None else f"[{lo_hi[0]:,}, {lo_hi[1]:,})"
                why = (f"scored other bases ({self.tokens[c][r]:,} against {self.tokens[0][r]:,} "
                       f"in {where})")
            out.append(f"no gain of {self.columns[c]!r} where it {why} than {ref!r}: "
                       "bits/base of different bases are not a gain")
        return out

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["context_lo", "context_hi", *[f"{c} bits/base" for c in self.columns],
                         *[f"{c} gain vs {self.columns[0]}" for c in self.columns[1:]]])
        for r, row in enumerate(self.rows):
            lo, hi = row if row else ("all", "all")
            writer.writerow([lo, hi, *[b[r] for b in self.bits],
                             *[self.gain(c)[r] for c in range(1, len(self.columns))]])
        return buf.getvalue()


def _label(report: dict, ref: str) -> str:
    """A report's name; reports written before evaluate named a run's checkpoints by their run
    ("model step-000128") get the run's name too."""
    name, ckpt = report.get("name", ref), Path(report.get("checkpoint", ""))
    if name.startswith("model ") and ckpt.parent.name == "checkpoints":
        return f"{ckpt.parent.parent.name} {ckpt.name}"
    return name


def compare(refs: list[str], load: Callable[[str], dict],
            with_baselines: bool = False) -> Comparison:
    """Load every report in ``refs`` with ``load`` (a report.json, its directory, or a tracking
    run id: :func:`megabase.pipeline.tracking.load_report`) and line up their bins.
    ``with_baselines`` adds each report's controls and baselines as curves."""
    if not refs:
        raise InputError("compare needs at least one report file, report directory or run id")
    curves: dict[str, tuple[dict, str | None]] = {}
    for ref in refs:
        report = load(ref)
        named = series(report) if with_baselines else {_label(report, ref): report}
        for name, summary in named.items():
            label, n = name, 2
            while label in curves:  # two runs of one name stay two columns
                label, n = f"{name} ({n})", n + 1
            curves[label] = summary, report.get("windows_sha256")  # a report's curves share it
    rows = sorted({(b["context_lo"], b["context_hi"]) for s, _ in curves.values()
                   for b in s["bins"]})
    table = Comparison(list(curves), [*rows, None])
    for summary, windows in curves.values():
        by_bin = {(b["context_lo"], b["context_hi"]): b for b in summary["bins"]}
        cells = [by_bin.get(r) for r in rows] + [summary["overall"]]
        table.bits.append([c["bits_per_base"] if c and c["n_tokens"] else float("nan")
                           for c in cells])
        table.tokens.append([c["n_tokens"] if c else 0 for c in cells])
        table.windows.append(windows if isinstance(windows, str) else None)
    return table
