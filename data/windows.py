"""Windows: named splits of records or regions, tiled into fixed-length windows and kept as BED rows.

A BED row ``chrom  start  end  split`` (0-based, half-open) describes one window, so users can inspect
windows with any genome tool and reuse them across runs. Tiling is deterministic: splits in the order
given, regions in the order given, windows left to right.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megabase.core.atomic import write_atomic
from megabase.core.errors import InputError
from .names import Region, parse_region
from .store import TokenStore
from megabase.core.vocab import N

SHORT_POLICIES = ("keep", "refuse")


@dataclass(frozen=True, order=True)
class Window:
    """One window: 0-based half-open ``[start, end)`` of record ``chrom``, in split ``split``."""

    chrom: str
    start: int
    end: int
    split: str = ""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class SplitSummary:
    """Per split: what was tiled, kept and dropped."""

    regions: list[str] = field(default_factory=list)
    windows: int = 0
    bases: int = 0
    short: int = 0
    dropped_n: int = 0


_THOUSANDS = re.compile(r"^\d{3}(-\d*)?$")


def parse_split(spec: str) -> tuple[str, list[str]]:
    """``"train=chr01,chr02"`` -> ``("train", ["chr01", "chr02"])``.

    Commas separate regions; commas inside coordinates (``chr22:30,000,001-40,000,000``) are kept.
    """
    name, sep, value = spec.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise InputError(f"{{split}} {spec!r}: expected NAME=REGION[,REGION...]", options=("split",))
    return name.strip(), split_regions(value)


def split_regions(value: str) -> list[str]:
    """``"chr22:30,000,001-40,000,000,chr21"`` -> the two regions: commas separate regions,
    commas inside coordinates are kept."""
    items: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if items and ":" in items[-1] and items[-1][-1].isdigit() and _THOUSANDS.match(part):
            items[-1] += "," + part
        elif part:
            items.append(part)
    return items


def first_overlap(regions: list[tuple[str, Region, int]]) -> tuple[tuple[str, str], ...] | None:
    """The first two regions of different splits that share bases, as ``((split, region),
    (split, region))`` (regions as written); None when the splits are disjoint.

    ``regions``: ``(split, region, end)`` as :func:`resolve_splits` gives them. Each region is
    checked against the furthest-reaching region of every other split seen so far on its record,
    so a region nested in a longer one of its own split cannot hide an overlap."""
    spans = sorted((r.name, r.start, end, split, str(r)) for split, r, end in regions)
    reach: dict[str, tuple[int, str]] = {}  # split -> (end, region) reaching furthest
    record = None
    for name, start, end, split, text in spans:
        if name != record:
            record, reach = name, {}
        if end <= start:  # an empty region shares no bases
            continue
        for other, (other_end, other_text) in reach.items():
            if other != split and start < other_end:
                return (other, other_text), (split, text)
        if end > reach.get(split, (-1, ""))[0]:
            reach[split] = (end, text)
    return None


def _check_overlaps(regions: list[tuple[str, Region, int]]) -> None:
    pair = first_overlap(regions)
    if pair is not None:
        (a, ra), (b, rb) = pair
        raise InputError(f"splits overlap: {a} {ra} and {b} {rb} share bases "
                         "(held-out data must not be trained on)")


def resolve_splits(store: TokenStore, splits: dict[str, list[str]]) -> list[tuple[str, Region, int]]:
    """``(split, region, end)`` for every region of ``splits`` (split name -> region specs), each
    checked to lie within its record; ``end`` is the region's end in bases."""
    resolved: list[tuple[str, Region, int]] = []
    for split, specs in splits.items():
        for spec in specs:
            region = parse_region(spec, store.names, str(store.path))
            size = store.length(region.name)
            end = size if region.end is None else region.end
            if end > size:
                raise InputError(f"region {spec!r} ends at {end:,}, past the record's end ({size:,})",
                                 store.path, region.name)
            resolved.append((split, region, end))
    return resolved


def make_windows(
    store: TokenStore,
    splits: dict[str, list[str]],
    length: int,
    stride: int | None = None,
    max_n_frac: float = 0.5,
    on_short: str = "keep",
) -> tuple[list[Window], dict[str, SplitSummary]]:
    """Tile the regions of each split into windows.

    Args:
        store: the token store the regions refer to.
        splits: split name -> regions (``chr01``, ``1``, ``chr22:1-1,000,000``).
        length: window length L in bases.
        stride: start-to-start distance; default L (no overlap).
        max_n_frac: drop windows whose fraction of ``N`` exceeds this (counted in the summary).
        on_short: a region shorter than L gives one shorter window (``keep``) or an error
            (``refuse``). The last window of a longer region may be shorter than L; windows never
            run past a region's end.

    Returns:
        windows and a per-split :class:`SplitSummary`.
    """
    if length < 1:
        raise InputError(f"{{length}} must be a positive number of bases, got {length}",
                         options=("length",))
    stride = length if stride is None else stride
    if stride < 1:
        raise InputError(f"{{stride}} must be positive, got {stride}", options=("stride",))
    if not 0.0 <= max_n_frac <= 1.0:
        raise InputError(f"{{max_n_frac}} must be within [0, 1], got {max_n_frac}",
                         options=("max_n_frac",))
    if on_short not in SHORT_POLICIES:
        raise InputError(f"unknown short-record policy {on_short!r}; choose from {SHORT_POLICIES}")
    if not splits:
        raise InputError("no {splits} given (e.g. train=chr01,chr02 and eval=chr22)", options=("splits",))

    resolved = resolve_splits(store, splits)
    _check_overlaps(resolved)

    windows: list[Window] = []
    summary = {split: SplitSummary() for split in splits}
    for split, region, end in resolved:
        info = summary[split]
        info.regions.append(str(region))
        span = end - region.start
        if span < length and on_short == "refuse":
            raise InputError(f"{span:,} bases, shorter than one window ({length:,}); use a shorter "
                             "{length}, or keep short regions ({on_short})", store.path, region.name,
                             options=("length", "on_short"))
        tokens = store.tokens(region.name)
        for start in _starts(region.start, end, length, stride):
            stop = min(start + length, end)
            if stop - start < length:
                info.short += 1
            n_count = int(np.count_nonzero(tokens[start:stop] == N))
            if n_count > max_n_frac * (stop - start):
                info.dropped_n += 1
                continue
            windows.append(Window(region.name, start, stop, split))
            info.windows += 1
            info.bases += stop - start
    return windows, summary


def _starts(begin: int, end: int, length: int, stride: int) -> list[int]:
    if end <= begin:
        return []
    if end - begin <= length:
        return [begin]
    starts = list(range(begin, end - length + 1, stride))
    if starts[-1] + length < end and starts[-1] + stride < end:
        starts.append(starts[-1] + stride)
    return starts


def windows_comment(store: Path, length: int, stride: int | None, max_n_frac: float,
                    splits: dict[str, list[str]]) -> str:
    """The BED header line recording how windows were made (compared to skip remaking them)."""
    split_text = ";".join(k + "=" + ",".join(v) for k, v in splits.items())
    return (f"megabase windows store={Path(store).resolve()} length={length} "
            f"stride={stride or length} max_n_frac={max_n_frac} splits={split_text}")


def write_bed(path: str | Path, windows: list[Window], comment: str | None = None) -> Path:
    """Write windows as BED4 (``chrom start end split``) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {line}" for line in (comment or "").splitlines()]
    lines.append("#chrom\tstart\tend\tsplit")
    lines += [f"{w.chrom}\t{w.start}\t{w.end}\t{w.split}" for w in windows]
    return write_atomic(path, ("\n".join(lines) + "\n").encode())


def select_windows(windows: Sequence[Window] | str | Path, split: str | None = None) -> list[Window]:
    """Windows from a list or a BED path, keeping only ``split`` when given."""
    if isinstance(windows, (str, Path)):
        return read_bed(windows, split)
    return [w for w in windows if split is None or w.split == split]


def read_bed(path: str | Path, split: str | None = None) -> list[Window]:
    """Read BED rows (3 or more columns; the 4th is the split). Optionally keep one split."""
    path = Path(path)
    if not path.is_file():
        raise InputError("no such BED file", path)
    windows = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip() or line.startswith(("#", "track", "browser")):
                continue
            cols = line.rstrip("\n").split("\t")
            try:
                chrom, start, end = cols[0], int(cols[1]), int(cols[2])
            except (IndexError, ValueError):
                raise InputError(f"line {lineno}: expected CHROM<TAB>START<TAB>END[<TAB>SPLIT]",
                                 path) from None
            if not 0 <= start < end:
                raise InputError(f"line {lineno}: need 0 <= start < end, got {start}-{end}", path)
            window = Window(chrom, start, end, cols[3] if len(cols) > 3 else "")
            if split is None or window.split == split:
                windows.append(window)
    if split is not None and not windows:
        raise InputError(f"no windows in split {split!r}", path)
    return windows
