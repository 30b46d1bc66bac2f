"""Side-by-side bits/base per prior-context bin for several reports (files or MLflow runs)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

from megabase.data.errors import InputError

from .report import series
from .tracking import load_report


@dataclass
class Comparison:
    """``columns``: one name per curve; ``rows``: ``(context_lo, context_hi)`` per bin, ``None``
    for the overall row; ``bits[c][r]``: bits/base (NaN where a curve has no such bin);
    ``tokens[c][r]``: scored bases."""

    columns: list[str]
    rows: list[tuple[int, int] | None]
    bits: list[list[float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    def gain(self, column: int, reference: int = 0) -> list[float]:
        """Bits/base saved by ``column`` relative to ``reference`` (positive: ``column`` is better)."""
        return [a - b for a, b in zip(self.bits[reference], self.bits[column])]

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


def compare(refs: list[str], tracking_uri: str | None = None,
            with_baselines: bool = False) -> Comparison:
    """Load every report in ``refs`` (a report.json, its directory, or an MLflow run id) and line
    up their bins. ``with_baselines`` adds each report's controls and baselines as curves."""
    if not refs:
        raise InputError("compare needs at least one report file, report directory or run id")
    curves: dict[str, dict] = {}
    for ref in refs:
        report = load_report(ref, tracking_uri)
        named = series(report) if with_baselines else {_label(report, ref): report}
        for name, summary in named.items():
            label, n = name, 2
            while label in curves:  # two runs of one name stay two columns
                label, n = f"{name} ({n})", n + 1
            curves[label] = summary
    rows = sorted({(b["context_lo"], b["context_hi"]) for s in curves.values() for b in s["bins"]})
    table = Comparison(list(curves), [*rows, None])
    for summary in curves.values():
        by_bin = {(b["context_lo"], b["context_hi"]): b for b in summary["bins"]}
        cells = [by_bin.get(r) for r in rows] + [summary["overall"]]
        table.bits.append([c["bits_per_base"] if c and c["n_tokens"] else float("nan")
                           for c in cells])
        table.tokens.append([c["n_tokens"] if c else 0 for c in cells])
    return table
