"""The token store: one ``uint8`` token array and one ``bool`` repeat mask per record + ``manifest.json``.

Layout of a store directory::

    manifest.json                 vocabulary, source (path, size, sha256), records (see below)
    records/<name>.tokens.npy     uint8 [length]  token ids (megabase.data.vocab)
    records/<name>.mask.npy       bool  [length]  True where the FASTA had lower case (soft-masked)

Each record entry holds ``name, description, length, n_count, softmasked, gc_count, tokens, mask,
tokens_sha256`` (paths relative to the store). ``n_count`` counts ``N`` tokens; ``softmasked`` and
``gc_count`` count A/C/G/T bases that were lower case, and that are C or G. Arrays open with ``numpy.load(path, mmap_mode="r")``.

:func:`prepare` builds the store in a temporary sibling directory and renames it into place, so a
failure or Ctrl-C leaves no half-written store; it returns at once when the store already matches
the input. The FASTA is only read, so it may sit on read-only storage.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic import building_dir, file_sha256, remove_stale_temps
from .errors import InputError
from .fasta import Record, read_fasta
from .names import aliases, resolve_name
from .vocab import vocab_dict

FORMAT = "megabase-token-store"
VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class PrepareResult:
    """What :func:`prepare` did: the store, its records, and how long reading took."""

    store: Path
    records: list[dict]
    source_bytes: int
    seconds: float
    skipped: bool


def _source_info(fasta: Path) -> dict:
    st = fasta.stat()
    return {"path": str(fasta.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _safe_filename(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "record"
    if len(base) > 100:  # file names stop at 255 bytes; the manifest keeps the whole name
        base = f"{base[:80]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    stem, k = base, 1
    while stem.lower() in taken:
        k += 1
        stem = f"{base}-{k}"
    taken.add(stem.lower())
    return stem


NPY_HEADER = 128


def _npy_header(descr: str, length: int) -> bytes:
    """A version-1.0 ``.npy`` header of fixed size, so it can be rewritten once the length is known."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({length},), }}"
    body = text.ljust(NPY_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin-1")


class _RecordFiles:
    """Token and mask ``.npy`` files of one record, written chunk by chunk as the FASTA is read."""

    def __init__(self, root: Path, stem: str):
        self.tokens, self.mask = f"records/{stem}.tokens.npy", f"records/{stem}.mask.npy"
        self._files = [open(root / self.tokens, "wb"), open(root / self.mask, "wb")]
        for fh, descr in zip(self._files, ("|u1", "|b1")):
            fh.write(_npy_header(descr, 0))

    def write(self, tokens: bytes, mask: np.ndarray) -> None:
        self._files[0].write(tokens)
        self._files[1].write(mask)

    def close(self, record: Record) -> None:
        for fh, descr in zip(self._files, ("|u1", "|b1")):
            fh.seek(0)
            fh.write(_npy_header(descr, record.length))
            fh.close()


def _install(tmp: Path, out: Path, old: dict | None) -> None:
    """Move the store built in ``tmp`` to ``out``. An earlier store there loses only the files
    its manifest lists (what megabase wrote); anything else in the folder stays. The manifest
    is replaced after the records it names, so a reader never sees it ahead of them."""
    if not out.exists():
        os.replace(tmp, out)
        return
    (out / "records").mkdir(exist_ok=True)
    new_files = set()
    for path in (tmp / "records").iterdir():
        os.replace(path, out / "records" / path.name)
        new_files.add(f"records/{path.name}")
    os.replace(tmp / MANIFEST, out / MANIFEST)
    for rec in (old or {}).get("records", []):
        for key in ("tokens", "mask"):
            name = rec.get(key)
            if isinstance(name, str) and name not in new_files and name.startswith("records/") \
                    and "/" not in name[len("records/"):]:
                (out / name).unlink(missing_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)


def _existing_manifest(out: Path) -> dict | None:
    """The manifest of a store at ``out``; None if there is nothing there. Refuses foreign dirs."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise InputError("exists and is not a directory; choose another {out}", out, options=("out",))
    manifest = out / MANIFEST
    if not manifest.exists():
        if any(out.iterdir()):
            raise InputError("exists, is not empty and holds no megabase store; choose another {out}", out,
                             options=("out",))
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"holds a {MANIFEST} that megabase did not write; megabase replaces only "
                         "stores it made: choose another {out}", out, options=("out",))
    return data


def _is_current(manifest: dict | None, out: Path, fasta: Path, source: dict, selection) -> bool:
    if not manifest or manifest.get("version") != VERSION or manifest.get("selection") != selection:
        return False
    old = manifest.get("source", {})
    if old.get("path") != source["path"] or old.get("size") != source["size"]:
        return False
    for rec in manifest.get("records", []):
        for key, itemsize in (("tokens", 1), ("mask", 1)):
            f = out / rec[key]
            if not f.exists() or f.stat().st_size < rec["length"] * itemsize:
                return False
    if old.get("mtime_ns") == source["mtime_ns"]:
        return True
    return old.get("sha256") == file_sha256(fasta)


def prepare(
    fasta: str | Path,
    out: str | Path,
    chroms: list[str] | None = None,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize a FASTA file into a token store at ``out``.

    Args:
        fasta: plain, gzip or bgzip FASTA (read only; may be on read-only storage).
        out: store directory; replaced atomically if it holds an out-of-date store.
        chroms: record names to keep (aliases such as ``chr1``/``1`` accepted); default all.
        progress: show a progress bar on a terminal.

    Returns:
        :class:`PrepareResult`; ``skipped`` is True when the store was already up to date.
    """
    fasta, out = Path(fasta), Path(out)
    if not fasta.exists():
        raise InputError("no such file", fasta)
    if fasta.is_dir():
        raise InputError("is a directory, not a FASTA file", fasta)
    source = _source_info(fasta)
    selection = list(chroms) if chroms else None
    manifest = _existing_manifest(out)
    if _is_current(manifest, out, fasta, source, selection):
        return PrepareResult(out, manifest["records"], source["size"], 0.0, skipped=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent, glob.escape(out.name))
    with building_dir(out, install=lambda tmp, out: _install(tmp, out, _existing_manifest(out))) as tmp:
        started = time.perf_counter()
        records, seen = _write_records(fasta, tmp, chroms, progress, source["size"])
        seconds = time.perf_counter() - started
        for requested in selection or []:
            resolve_name(requested, seen, str(fasta))
        if not records:
            raise InputError("contains no sequence records", fasta)
        if not any(rec["length"] for rec in records):
            raise InputError(f"its {len(records)} record(s) hold no bases", fasta)
        for rec in records:
            if not rec["length"]:
                print(f"warning: {fasta}: record {rec['name']!r} holds no bases; windows leave it "
                      "out", file=sys.stderr)
        source["sha256"] = file_sha256(fasta)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "vocab": vocab_dict(),
            "source": source,
            "selection": selection,
            "records": records,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return PrepareResult(out, records, source["size"], seconds, skipped=False)


def _write_records(
    fasta: Path, tmp: Path, chroms: list[str] | None, progress: bool, size: int
) -> tuple[list[dict], list[str]]:
    """Write every selected record; return their manifest entries and all record names seen."""
    from tqdm import tqdm

    (tmp / "records").mkdir()
    wanted = None
    if chroms:
        wanted = set(chroms).union(*(aliases(c) for c in chroms))
    seen: list[str] = []

    def keep(name: str) -> bool:
        seen.append(name)
        return wanted is None or name in wanted

    taken: set[str] = set()

    def sink(rec: Record) -> _RecordFiles:
        return _RecordFiles(tmp, _safe_filename(rec.name, taken))

    records = []
    with tqdm(
        total=size, unit="B", unit_scale=True, desc=f"prepare {fasta.name}",
        disable=None if progress else True, leave=False,
    ) as bar:
        for rec in read_fasta(fasta, keep=keep, on_read=bar.update, sink=sink):
            records.append(_manifest_entry(rec))
            bar.set_postfix_str(rec.name, refresh=False)
    return records, seen


def _manifest_entry(rec: Record) -> dict:
    return {
        "name": rec.name,
        "description": rec.description,
        "length": rec.length,
        "n_count": rec.n_count,
        "softmasked": rec.softmasked,
        "gc_count": rec.gc_count,
        "tokens": rec.sink.tokens,
        "mask": rec.sink.mask,
        "tokens_sha256": rec.tokens_sha256,
    }


class TokenStore:
    """Read access to a token store written by :func:`prepare`.

    Arrays are memory-mapped on first use, so opening a store costs one JSON read and fetching a
    window touches only that window's pages.

    Example::

        store = TokenStore("store/")
        tokens, mask = store.fetch("chr22", 30_000_000, 31_048_576)   # uint8 [L], bool [L]
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not self.path.is_dir():
            raise InputError("no token store here (run `megabase prepare FASTA --out DIR`)", self.path)
        if not manifest.exists():
            raise InputError(f"not a token store: {MANIFEST} is missing", self.path)
        try:
            self.manifest = json.loads(manifest.read_text())
        except ValueError as exc:
            raise InputError(f"{MANIFEST} is not valid JSON ({exc})", self.path) from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise InputError(f"not a version-{VERSION} megabase token store", self.path)
        if self.manifest["vocab"] != vocab_dict():
            raise InputError("store was written with a different vocabulary; re-run prepare", self.path)
        self.records: dict[str, dict] = {r["name"]: r for r in self.manifest["records"]}
        self._maps: dict[tuple[str, str], np.ndarray] = {}

    @property
    def names(self) -> list[str]:
        return list(self.records)

    def resolve(self, name: str) -> str:
        """The stored name that ``name`` means (exact or ``chr1``/``1`` alias)."""
        return resolve_name(name, self.records, str(self.path))

    def length(self, name: str) -> int:
        return self.records[self.resolve(name)]["length"]

    def _array(self, name: str, kind: str) -> np.ndarray:
        key = (name, kind)
        if key not in self._maps:
            rec = self.records[self.resolve(name)]
            path = self.path / rec[kind]
            try:
                # Copy-on-write: slices are writable (torch.from_numpy takes them without a copy
                # or a warning) and a write lands in private memory, never in the store.
                arr = np.load(path, mmap_mode="c")
            except (OSError, ValueError) as exc:
                raise InputError(f"cannot read {rec[kind]} ({exc})", self.path, rec["name"]) from None
            if arr.shape != (rec["length"],):
                raise InputError(f"{rec[kind]} has shape {arr.shape}, manifest says {rec['length']}",
                                 self.path, rec["name"])
            self._maps[key] = arr
        return self._maps[key]

    def tokens(self, name: str) -> np.ndarray:
        """Memory map (copy-on-write), ``uint8 [length]``."""
        return self._array(name, "tokens")

    def mask(self, name: str) -> np.ndarray:
        """Memory map (copy-on-write), ``bool [length]``: True for soft-masked (repeat) bases."""
        return self._array(name, "mask")

    def _interval(self, name: str, start: int, end: int | None) -> tuple[int, int]:
        length = self.length(name)
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise InputError(f"interval [{start}, {end}) is outside 0..{length}", self.path, name)
        return start, end

    def fetch(self, name: str, start: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copies of tokens and repeat mask for ``[start, end)`` (0-based, half-open)."""
        start, end = self._interval(name, start, end)
        return np.array(self.tokens(name)[start:end]), np.array(self.mask(name)[start:end])

    def tensors(self, name: str, start: int = 0, end: int | None = None):
        """Tokens (``torch.uint8 [n]``) and repeat mask (``torch.bool [n]``) of ``[start, end)``.

        Zero-copy: the tensors are views of the memory map, so reading a window costs no copy and
        touches only its pages; writing to them never reaches the store (copy-on-write).
        """
        import torch

        start, end = self._interval(name, start, end)
        return (torch.from_numpy(self.tokens(name)[start:end]),
                torch.from_numpy(self.mask(name)[start:end]))

    def verify(self) -> None:
        """Recompute every record's token checksum; raise :class:`InputError` on a mismatch."""
        for name, rec in self.records.items():
            digest = hashlib.sha256(memoryview(np.ascontiguousarray(self.tokens(name)))).hexdigest()
            if digest != rec["tokens_sha256"]:
                raise InputError("token checksum mismatch: the store is corrupt", self.path, name)

    def __repr__(self) -> str:
        total = sum(r["length"] for r in self.records.values())
        return f"TokenStore({str(self.path)!r}, {len(self.records)} records, {total:,} bases)"
