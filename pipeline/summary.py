"""Short human-readable summaries that end each command (rich tables on stdout)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}" if whole else "-"


def print_prepare(fasta: Path, result) -> None:
    """Per record: length, N % (of length), repeat % and GC % (of ACGT bases); totals; throughput."""
    console = Console()
    if result.skipped:
        console.print(f"[green]up to date[/]: {result.store} already holds {fasta} "
                      f"({len(result.records)} records); nothing to do")
        return
    table = Table(title=f"token store {result.store}", title_justify="left")
    for col in ("record", "length", "N %", "repeat % of ACGT", "GC % of ACGT"):
        table.add_column(col, justify="left" if col == "record" else "right")
    total = dict(length=0, n_count=0, softmasked=0, gc_count=0)
    rows = result.records if len(result.records) <= 40 else result.records[:40]
    for rec in result.records:
        for key in total:
            total[key] += rec[key]
    for rec in rows:
        table.add_row(*_prepare_cells(rec["name"], rec))
    if len(result.records) > len(rows):
        table.add_row(f"... {len(result.records) - len(rows)} more", "", "", "", "")
    table.add_row(*_prepare_cells(f"total ({len(result.records)})", total), style="bold")
    console.print(table)
    secs = max(result.seconds, 1e-9)
    console.print(f"{total['length'] / 1e6:,.1f} Mbp in {result.seconds:.2f} s: "
                  f"{total['length'] / 1e6 / secs:,.0f} Mbp/s, "
                  f"{result.source_bytes / 1e6 / secs:,.0f} MB/s of {fasta.name}")


def _prepare_cells(name: str, rec: dict) -> list[str]:
    acgt = rec["length"] - rec["n_count"]
    return [name, f"{rec['length']:,}", _pct(rec["n_count"], rec["length"]),
            _pct(rec["softmasked"], acgt), _pct(rec["gc_count"], acgt)]


def print_windows(out: Path, length: int, per_split: dict) -> None:
    """Per split: regions, windows kept, bases, short windows, windows dropped for N."""
    console = Console()
    table = Table(title=f"windows of {length:,} bases -> {out}", title_justify="left")
    for col in ("split", "regions", "windows", "bases", "short", "dropped (N)"):
        table.add_column(col, justify="left" if col in ("split", "regions") else "right")
    for name, info in per_split.items():
        regions = ", ".join(info.regions)
        table.add_row(name, regions if len(regions) < 60 else regions[:57] + "...",
                      f"{info.windows:,}", f"{info.bases:,}", f"{info.short:,}",
                      f"{info.dropped_n:,}")
    console.print(table)
