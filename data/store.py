"""The token store: one ``uint8`` token array and one ``bool`` repeat mask per record + ``manifest.json``.

Layout of a store directory::

    manifest.json                 vocabulary, source (path, size, sha256), records (see below)
    records/<name>.tokens.npy     uint8 [length]  token ids (megabase.core.vocab)
    records/<name>.mask.npy       bool  [length]  True where the FASTA had lower case (soft-masked)

Each record entry holds ``name, description, length, n_count, softmasked, gc_count, tokens, mask,
tokens_sha256, mask_sha256`` (paths relative to the store). ``n_count`` counts ``N`` tokens; ``softmasked`` and
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

from megabase.core.atomic import building_dir, file_sha256, naming, remove_stale_temps
from megabase.core.errors import InputError
from .fasta import Record, read_fasta
from megabase.core.locks import holding
from .names import aliases, resolve_name
from megabase.core.vocab import N, vocab_dict

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
        self._mask_sha = hashlib.sha256()
        for fh, descr in zip(self._files, ("|u1", "|b1")):
            fh.write(_npy_header(descr, 0))

    def write(self, tokens: bytes, mask: np.ndarray) -> None:
        for fh, data in zip(self._files, (tokens, mask)):
            with naming(fh.name):
                fh.write(data)
        self._mask_sha.update(np.ascontiguousarray(mask).view(np.uint8))

    @property
    def mask_sha256(self) -> str:
        return self._mask_sha.hexdigest()

    def close(self, record: Record) -> None:
        for fh, descr in zip(self._files, ("|u1", "|b1")):
            with naming(fh.name):  # buffered bytes reach the disk here
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
    problem = store_problem(out, manifest)
    if problem is not None:
        print(f"{out}: {problem}; rebuilding it", file=sys.stderr)
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
    _existing_manifest(out)  # a folder megabase did not make is refused before any lock file
    # one builder per store: a second prepare waits, then finds the first one's store current
    with holding(out, f"the store {out.name!r}", wait=True):
        return _prepare(fasta, out, chroms, progress, source, selection)


def _prepare(fasta: Path, out: Path, chroms: list[str] | None, progress: bool, source: dict,
             selection: list[str] | None) -> PrepareResult:
    manifest = _existing_manifest(out)
    if _is_current(manifest, out, fasta, source, selection):
        return PrepareResult(out, manifest["records"], source["size"], 0.0, skipped=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent, glob.escape(out.name))
    with building_dir(out, install=lambda tmp, out: _install(tmp, out, _existing_manifest(out))) as tmp:
        started = time.perf_counter()
        digest = hashlib.sha256()  # of the file's bytes, fed by the one read that parses them
        records, seen = _write_records(fasta, tmp, chroms, progress, source["size"], digest)
        seconds = time.perf_counter() - started
        if _source_info(fasta) != source:
            raise InputError("changed while it was being read; run prepare again once it is "
                             "complete", fasta)
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
        source["sha256"] = digest.hexdigest()
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
    fasta: Path, tmp: Path, chroms: list[str] | None, progress: bool, size: int, digest=None
) -> tuple[list[dict], list[str]]:
    """Write every selected record; return their manifest entries and all record names seen.
    ``digest`` (a hashlib object) is fed the file's bytes as they are read."""
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
    bar = None
    if progress and sys.stderr.isatty():  # else tqdm (disable=None) would hide the bar, yet its
        from tqdm import tqdm            # import, lock and monitor thread would still cost ~30 ms

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"prepare {fasta.name}", leave=False)
    try:
        for rec in read_fasta(fasta, keep=keep, on_read=None if bar is None else bar.update,
                              sink=sink, digest=digest):
            records.append(_manifest_entry(rec))
            if bar is not None:
                bar.set_postfix_str(rec.name, refresh=False)
    finally:
        if bar is not None:
            bar.close()
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
        "mask_sha256": rec.sink.mask_sha256,
    }


def _read_record_file(root: Path, rec: dict, kind: str) -> tuple[np.ndarray | None, str | None]:
    """``(memory map, None)`` of a record's ``kind`` file (``"tokens"`` or ``"mask"``) when it
    matches its manifest entry, else ``(None, what differs)``: shape, sha256 (hashing runs at
    ~0.7 GB/s, once per record and process) and, for tokens, that every value is a stored base."""
    try:
        arr = np.load(root / rec[kind], mmap_mode="c")  # copy-on-write: writes stay private
    except (OSError, ValueError) as exc:
        return None, f"cannot read {rec[kind]} ({exc})"
    if arr.shape != (rec["length"],) or arr.dtype != (np.uint8 if kind == "tokens" else np.bool_):
        return None, f"{rec[kind]} holds {arr.dtype} {arr.shape}, the manifest {rec['length']:,} values"
    recorded = rec.get(f"{kind}_sha256")  # stores written before the mask had one lack it
    if recorded is not None and recorded != hashlib.sha256(
            memoryview(np.ascontiguousarray(arr).view(np.uint8))).hexdigest():
        return None, f"{rec[kind]} was changed after prepare (its sha256 is not the manifest's)"
    if kind == "tokens" and arr.size and int(arr.max()) > N:  # prepare stores only A C G T N
        return None, f"{rec[kind]} holds token {int(arr.max())}, outside the vocabulary (0-{N})"
    return arr, None


def check_record_file(root: Path, rec: dict, kind: str, manifest: dict) -> np.ndarray:
    """The checked memory map of :func:`_read_record_file`; InputError names the store, the
    record, what differs and how to rebuild."""
    arr, problem = _read_record_file(root, rec, kind)
    if problem is not None:
        source = manifest.get("source", {}).get("path", "FASTA")
        raise InputError(f"{problem}; rebuild the store: `megabase prepare {source} --out {root}`",
                         root, rec["name"])
    return arr


def store_problem(root: Path, manifest: dict) -> str | None:
    """What in the store at ``root`` no longer matches ``manifest``; None if it all does."""
    for rec in manifest.get("records", []):
        for kind in ("tokens", "mask"):
            problem = _read_record_file(root, rec, kind)[1]
            if problem is not None:
                return f"record {rec['name']!r}: {problem}"
    return None


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
        """The record's memory map, checked against the manifest the first time it is opened."""
        key = (name, kind)
        if key not in self._maps:
            rec = self.records[self.resolve(name)]
            # Copy-on-write: slices are writable (torch.from_numpy takes them without a copy or a
            # warning) and a write lands in private memory, never in the store.
            self._maps[key] = check_record_file(self.path, rec, kind, self.manifest)
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
        """Check every record's files against the manifest (what a stage does on first use)."""
        for name in self.records:
            self.tokens(name), self.mask(name)

    def __repr__(self) -> str:
        total = sum(r["length"] for r in self.records.values())
        return f"TokenStore({str(self.path)!r}, {len(self.records)} records, {total:,} bases)"
