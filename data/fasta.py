"""Streaming FASTA reader: plain, gzip or bgzip in; tokenized records out.

The file is decompressed by ISA-L (``isal``) in a background thread while this thread splits lines
and tokenizes with ``bytes.translate`` and a worker thread hashes, counts and writes, so reading runs
close to the speed of decompression. The file is read once: a caller that needs its checksum passes a
``digest``, fed with the file's bytes (compressed, as on disk) as the parser reads them. Memory is
bounded by the largest selected record; unselected records are scanned and dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from megabase.core.atomic import write_atomic
from megabase.core.errors import InputError
from megabase.core.vocab import INVALID, TOKEN_TABLE

CHUNK = 1 << 20  # small enough that a block's passes (translate, mask, counts, hash) run in cache
_INVALID = bytes([INVALID])
_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"PK\x03\x04": "zip",
}


class RecordSink(Protocol):
    """Receives a record's chunks in order (on the worker thread), then is closed once."""

    def write(self, tokens: bytes, mask: np.ndarray) -> None: ...

    def close(self, record: "Record") -> None: ...


@dataclass
class Record:
    """One FASTA record, tokenized.

    Without a sink, ``tokens`` and ``mask`` hold the record as chunks (``bytes`` of token ids,
    ``bool`` arrays), so a large record is never copied into one buffer. With a sink they stay
    empty: the chunks went to ``sink`` as they were read.
    """

    name: str
    description: str
    index: int
    length: int = 0
    n_count: int = 0
    gc_count: int = 0
    softmasked: int = 0
    tokens: list[bytes] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    _sha: "hashlib._Hash" = field(default_factory=hashlib.sha256, repr=False)
    sink: RecordSink | None = field(default=None, repr=False)
    _pending: list[Future] = field(default_factory=list, repr=False)

    @property
    def tokens_sha256(self) -> str:
        return self._sha.hexdigest()

    def token_array(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.tokens), dtype=np.uint8)

    def mask_array(self) -> np.ndarray:
        return np.concatenate(self.mask) if self.mask else np.zeros(0, dtype=bool)


class _Counting:
    """A raw file wrapper that reports how many (compressed) bytes were consumed and feeds them to
    ``digest``, so the file's checksum comes from the one read that parses it."""

    def __init__(self, raw, on_read: Callable[[int], None] | None, digest=None):
        self.raw, self.on_read, self.digest = raw, on_read, digest

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if self.digest is not None:
            self.digest.update(data)
        if self.on_read is not None:
            self.on_read(len(data))
        return data

    def readinto(self, buf) -> int:
        n = self.raw.readinto(buf)
        if n:
            if self.digest is not None:
                with memoryview(buf) as view:
                    self.digest.update(view[:n])
            if self.on_read is not None:
                self.on_read(n)
        return n

    def drain(self) -> None:
        """Read what the decompressor left unread (padding after the last gzip member), so the
        digest covers the whole file."""
        if self.digest is not None:
            while self.read(CHUNK):
                pass

    def __getattr__(self, item):
        return getattr(self.raw, item)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()


def sniff_compression(path: Path) -> str:
    """``"plain"`` or ``"gzip"``; raises :class:`InputError` for other formats or an empty file."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    if not head:
        raise InputError("file is empty", path)
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            if kind != "gzip":
                raise InputError(
                    f"file is {kind}-compressed; megabase reads plain, gzip or bgzip FASTA", path
                )
            return kind
    return "plain"


def _decompress_errors() -> tuple[type[BaseException], ...]:
    from isal.isal_zlib import IsalError

    return (OSError, ValueError, IsalError)


def _open_stream(path: Path, on_read: Callable[[int], None] | None, digest=None):
    """(raw file, decompressed stream); the same object twice for plain FASTA."""
    compression = sniff_compression(path)
    raw = _Counting(open(path, "rb"), on_read, digest)
    if compression == "gzip":
        from isal import igzip_threaded

        return raw, igzip_threaded.open(raw, "rb", threads=1)
    return raw, raw


def read_fasta(
    path: str | Path,
    keep: Callable[[str], bool] | None = None,
    on_read: Callable[[int], None] | None = None,
    sink: Callable[[Record], RecordSink] | None = None,
    digest: "hashlib._Hash | None" = None,
) -> Iterator[Record]:
    """Yield the records of a FASTA file, tokenized.

    Args:
        path: plain, gzip or bgzip FASTA. Any line width, CRLF or CR-only line ends, blank lines,
            lower case, IUPAC. A regular file: pipes and devices are refused.
        keep: called with each record name; records it rejects are skipped (not tokenized).
        on_read: called with the number of (compressed) bytes consumed, for progress bars.
        sink: called when a kept record starts; its result receives the record's chunks as they
            are read and is closed before the record is yielded, so memory stays at one chunk.
        digest: a ``hashlib`` object updated with every byte of the file as it is read (the
            compressed bytes of a gzip file); once the records are exhausted it holds the whole
            file's checksum, with no second read.

    Yields:
        :class:`Record` with token chunks, mask chunks and counts. Names must be unique.

    Raises:
        InputError: missing/empty/not-FASTA file, truncated or corrupt gzip, an invalid character
            (with record and base offset), an unnamed or duplicate record, no records at all.
    """
    path = Path(path)
    if not path.exists():
        raise InputError("no such file", path)
    if path.is_dir():
        raise InputError("is a directory, not a FASTA file", path)
    if not path.is_file():  # checked by stat, so a FIFO cannot hang us here
        raise InputError("is not a regular file (a pipe, FIFO or device): megabase reads FASTA from "
                         "a file, whose size and date tell whether a store made from it is current; "
                         "save it to a file first", path)
    try:
        raw, stream = _open_stream(path, on_read, digest)
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", path) from None
    # Checksums and counts run on a worker thread (hashlib and numpy release the GIL) while this
    # thread splits and translates the next block and ISA-L decompresses the one after.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megabase-fasta")
    parser = _Parser(path, keep, pool, sink)
    try:
        with raw, stream:
            for block in _line_blocks(stream, path, parser):
                yield from parser.feed(block)
            raw.drain()
        yield from parser.finish()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _line_blocks(stream, path: Path, parser: "_Parser") -> Iterator[bytes]:
    """Decompressed data in blocks that never end inside a header line (a block may end inside a
    line of bases; the parser goes on with it); decompression errors become InputError.

    A block is the chunk as read, not a copy, unless a header straddles two chunks.
    Errors raised by the consumer of this generator (a full disk, say) do not pass through here.
    """
    carry, cr_only, line_start = b"", None, True  # line_start: the last block ended a line
    try:
        while True:
            chunk = stream.read(CHUNK)
            if not chunk:
                break
            if cr_only is None:  # classic Mac OS line ends, "\r" alone: read them as "\n"
                cr_only = b"\r" in chunk and b"\n" not in chunk
            if cr_only:
                chunk = chunk.replace(b"\r", b"\n")
            data = carry + chunk if carry else chunk
            last = data.rfind(b"\n") + 1  # where the unfinished last line starts
            if data[last:last + 1] == b">" and (last or line_start):  # a header, cut short: keep
                carry = data[last:]                                 # it for the next chunk
                if not last:
                    continue
                data = data[:last]
            else:
                carry = b""
            line_start = data.endswith(b"\n")
            yield data
    except EOFError:
        raise InputError(parser.where("gzip stream is truncated (file ends early)"), path) from None
    except _decompress_errors() as exc:
        raise InputError(parser.where(f"corrupt compressed data ({exc})"), path) from None
    if carry:
        yield carry + b"\n"


_IN_FLIGHT = 4
"""Chunks of a record handed to the worker and not yet done; the parser waits beyond that, so a
slow disk bounds memory instead of the record's length."""


def _chunk_stats(record: Record, seq: bytes, tokens: bytes) -> None:
    """Mask, hash, count and write one chunk of valid bases; runs on the worker thread, in
    submission order (hashlib and numpy release the GIL, so it overlaps the parser)."""
    mask = np.frombuffer(seq, dtype=np.uint8) >= ord("a")
    record._sha.update(tokens)
    if record.sink is not None:
        record.sink.write(tokens, mask)
    else:
        record.mask.append(mask)
    arr = np.frombuffer(tokens, dtype=np.uint8)
    record.n_count += int(np.count_nonzero(arr == 4))
    record.gc_count += int(np.count_nonzero(arr == 1)) + int(np.count_nonzero(arr == 2))
    record.softmasked += int(np.count_nonzero(mask & (arr < 4)))


class _Parser:
    """Line-aligned blocks in, complete records out."""

    def __init__(self, path: Path, keep, pool: ThreadPoolExecutor, sink):
        self.path, self.keep, self.pool, self.sink = path, keep, pool, sink
        self.record: Record | None = None
        self.skipping = False
        self.seen: dict[str, int] = {}
        self.count = 0
        self.mid_line = False  # the last block ended inside a sequence line

    def where(self, what: str) -> str:
        if self.record is None:
            return what
        return f"{what} (in record {self.record.name!r}, after {self.record.length:,} bases)"

    def feed(self, block: bytes) -> Iterator[Record]:
        """Parse ``block``: whole lines, or a piece of a long sequence line (then the next block
        goes on with that line, and a '>' at its start is a stray character, not a header)."""
        pos, size = 0, len(block)
        if self.mid_line and block[:1] == b">":
            self._invalid(self.record.length if self.record else 0, ord(">"))
        self.mid_line = not block.endswith(b"\n")
        while pos < size:
            if block[pos] == 0x3E:  # '>'
                eol = block.index(b"\n", pos)
                done = self._start(block[pos + 1 : eol].rstrip(b"\r"))
                if done is not None:
                    yield done
                pos = eol + 1
                continue
            nxt = block.find(b">", pos)
            end = size if nxt < 0 else nxt
            self._sequence(block[pos:end])
            if 0 <= nxt and block[nxt - 1] != 0x0A:
                self._invalid(self.record.length if self.record else 0, ord(">"))
            pos = end

    def finish(self) -> Iterator[Record]:
        if self.count == 0:
            raise InputError("not FASTA: no '>' header line found", self.path)
        if self.record is not None and not self.skipping:
            yield self._complete(self.record)
        self.record = None

    def _start(self, header: bytes) -> Record | None:
        done = None
        if self.record is not None and not self.skipping:
            done = self._complete(self.record)
        text = header.decode("utf-8", errors="replace").rstrip()
        name, _, description = text.partition(" ")
        name = name.split("\t")[0]
        self.count += 1
        if not name:  # "> desc only": the description is not a name
            raise InputError(f"record {self.count} has an empty name (header {'>' + text[:60]!r})",
                             self.path)
        if any(ord(c) < 32 or ord(c) == 127 for c in name):  # ESC & co. would reach terminals
            raise InputError(f"record {self.count}'s name holds a control character "
                             f"({name[:60]!r})", self.path)
        if name in self.seen:
            raise InputError(
                f"duplicate record name (records {self.seen[name]} and {self.count})",
                self.path,
                name,
            )
        self.seen[name] = self.count
        self.record = Record(name=name, description=description.strip(), index=self.count - 1)
        self.skipping = self.keep is not None and not self.keep(name)
        if self.sink is not None and not self.skipping:
            self.record.sink = self.sink(self.record)
        return done

    def _sequence(self, raw: bytes) -> None:
        record = self.record
        if record is None:
            if raw.strip():
                first = raw.strip().split(b"\n", 1)[0][:40]
                raise InputError(
                    f"not FASTA: text before the first '>' header ({first.decode('latin-1')!r})",
                    self.path,
                )
            return
        if self.skipping:
            return
        seq = raw.replace(b"\n", b"")
        tokens = seq.translate(TOKEN_TABLE)
        if _INVALID in tokens:  # CR (CRLF files), blanks or tabs to drop, or a character no base
            for junk in (b"\r", b" ", b"\t"):
                if junk in seq:
                    seq = seq.replace(junk, b"")
            tokens = seq.translate(TOKEN_TABLE)
            bad = tokens.find(_INVALID)
            if bad >= 0:
                self._invalid(record.length + bad, seq[bad])
        if not seq:
            return
        pending = record._pending
        if len(pending) >= _IN_FLIGHT:
            pending.pop(0).result()
        pending.append(self.pool.submit(_chunk_stats, record, seq, tokens))
        if record.sink is None:
            record.tokens.append(tokens)
        record.length += len(tokens)

    def _complete(self, record: Record) -> Record:
        for future in record._pending:
            future.result()  # a worker's error (a full disk, say) is raised here
        record._pending.clear()
        if record.sink is not None:
            record.sink.close(record)
        return record

    def _invalid(self, offset: int, byte: int):
        char = chr(byte)
        shown = repr(char) if char.isprintable() else f"byte 0x{byte:02x}"
        raise InputError(
            f"invalid character {shown} at base {offset + 1:,} (not a nucleotide, IUPAC code or gap)",
            self.path,
            self.record.name if self.record else None,
        )


def write_fasta(path: str | Path, records: Iterable[tuple[str, str]], width: int = 80) -> Path:
    """Write ``(header, sequence)`` records (header without the ``>``) as FASTA, ``width`` bases a
    line, atomically: the file appears whole or not at all."""
    lines = []
    for header, text in records:
        lines.append(f">{header}")
        lines.extend(text[j : j + width] for j in range(0, len(text), width))
    return write_atomic(path, ("\n".join(lines) + "\n").encode())
