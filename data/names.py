"""Record names: ``chr1``/``1`` style aliases, suggestions, and samtools-style regions."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from megabase.core.errors import InputError

_MITO = ("M", "MT")


def aliases(name: str) -> list[str]:
    """Other spellings of a chromosome name: UCSC ``chr1``/``chrM`` vs Ensembl/NCBI ``1``/``MT``,
    and zero-padded numbers (``chr1``/``chr01``)."""
    bare = name[3:] if name.lower().startswith("chr") else name
    out = [bare, "chr" + bare]
    if bare.isdigit():  # chr1 <-> chr01, as some assemblies (U. maydis) number them
        for alt in (str(int(bare)), f"{int(bare):02d}"):
            out += [alt, "chr" + alt]
    if bare.upper() in _MITO:
        out += [*_MITO, *("chr" + m for m in _MITO)]
    seen = {name}
    return [a for a in out if not (a in seen or seen.add(a))]


def resolve_name(requested: str, available: Iterable[str], source: str | None = None) -> str:
    """Return the record name in ``available`` that ``requested`` means (exactly or by alias).

    Raises:
        InputError: naming ``source``, the missing record, and the nearest names available.
    """
    names = list(available)
    pool = set(names)
    if requested in pool:
        return requested
    for alt in aliases(requested):
        if alt in pool:
            return alt
    hints = difflib.get_close_matches(requested, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(map(repr, hints))}?" if hints else ""
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    raise InputError(f"no record named {requested!r} (have: {shown}){hint}", path=source)


@dataclass(frozen=True)
class Region:
    """A 0-based half-open interval ``[start, end)`` of a record; ``end=None`` means to its end."""

    name: str
    start: int = 0
    end: int | None = None

    def __str__(self) -> str:
        if self.start == 0 and self.end is None:
            return self.name
        end = "" if self.end is None else f"{self.end:,}"
        return f"{self.name}:{self.start + 1:,}-{end}"


_COORDS = re.compile(r"^([0-9,_]+)?(?:-([0-9,_]*))?$")


def parse_region(text: str, available: Iterable[str], source: str | None = None) -> Region:
    """Parse ``chr22``, ``22``, ``chr22:30,000,001-40,000,000`` or ``chr22:30,000,001-``.

    Coordinates are 1-based and inclusive as in samtools; the result is 0-based half-open and
    its name is resolved against ``available`` (aliases accepted). A name that itself contains
    ``:`` (e.g. HLA alleles) is taken whole when it matches a record.
    """
    names = list(available)
    text = text.strip()
    try:
        return Region(resolve_name(text, names, source))
    except InputError:
        if ":" not in text:
            raise
    name, _, coords = text.rpartition(":")
    match = _COORDS.match(coords)
    if not match or not match.group(1):
        raise InputError(f"bad region {text!r}: expected NAME or NAME:START-END (1-based)", source)
    start = int(match.group(1).replace(",", "").replace("_", ""))
    end_text = (match.group(2) or "").replace(",", "").replace("_", "")
    end = int(end_text) if end_text else None
    if start < 1 or (end is not None and end < start):
        raise InputError(f"bad region {text!r}: need 1 <= START <= END", source)
    return Region(resolve_name(name, names, source), start - 1, end)
