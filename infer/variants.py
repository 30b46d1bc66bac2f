"""``megabase variants``: zero-shot variant effects, ``log p(alt window) - log p(ref window)``.

Windows are tiles of ``window`` bases of a record, aligned to its start; every variant in a tile
shares the tile's reference pass. That pass stops at each variant's position, scores the
alternative from a copy of the carried state there (:func:`megabase.model.fork`) and goes on, so a
variant costs only the pass over the alternative sequence after it: ``delta = sum(log p of alt
bases from the variant on) - sum(log p of ref bases from the variant on)``, the bases before it
being the same in both (nats; negative: the model finds the alternative less likely). The sums
run to the tile's end, or with ``horizon`` over the variant's bases and the ``horizon`` bases
after them. With ``both_strands`` the reverse complement of the tile is scored the same way and
the two deltas averaged.

In a tile a variant's prior context is anything from 0 to ``window`` bases. To ask what context
length does to a score, ``context=C`` gives every variant between ``C`` and ``2C`` bases of
context instead (less only within ``C`` of the record's ends): the variants at ``kC .. (k+1)C``
share one pass that starts at ``(k-1)C``, and ``horizon`` (default 256) fixes the span summed
after each, so that two context lengths compare the same bases. The reverse strand's pass
mirrors it, its context lying 3' of the variants.
"""

from __future__ import annotations

import gzip
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from megabase.core.atomic import writing
from megabase.core.vocab import N_BASES, RC_LUT, SEP, tokenize
from megabase.data import InputError, TokenStore
from megabase.data.names import resolve_name
from megabase.data.progress import progress as progress_of
from megabase.model import advance as _advance
from megabase.model import fork
from megabase.model.stream import one_thread

from .common import check_output_dir, load_model, peak_rss_bytes, sole_writer


if TYPE_CHECKING:
    import pysam

DEFAULT_WINDOW = 65_536
DEFAULT_HORIZON = 256
# pieces up to this many tokens run on one thread: an alternative allele's pass is hundreds of tiny
# ops (257 tokens from an 8k state: 0.31 s on one thread, 7.6 s on two, beside another job)
SHORT = 2048
SYMBOLIC = ("<", "[", "]", "*", ".")


@dataclass
class Variant:
    """One allele of a VCF record: 0-based ``pos`` on ``chrom`` (the store's name), ``ref`` and
    ``alt`` as token arrays, the record's ``line`` in the VCF and the allele's index (1-based)."""

    chrom: str
    pos: int
    ref: str
    alt: str
    line: int
    allele: int = 1
    id: str = "."
    delta_fwd: float = float("nan")
    delta_rev: float = float("nan")

    @property
    def delta(self) -> float:
        rev = self.delta_rev
        return self.delta_fwd if rev != rev else (self.delta_fwd + rev) / 2


@dataclass
class VariantResult:
    variants: list[Variant]
    windows: int
    files: dict[str, str] = field(default_factory=dict)
    window: int = DEFAULT_WINDOW
    context: int | None = None
    horizon: int | None = None
    seconds: float = 0.0
    peak_rss: int = 0


def _header_lines(path: Path, header) -> int:
    """How many ``#`` lines the VCF text at ``path`` (plain, bgzip or gzip) opens with: the
    records' line numbers count from there. htslib's own header is no guide, as it adds a
    ``##FILTER=<ID=PASS>`` line the file may lack; a BCF has no lines and gets its header's."""
    import gzip

    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        opener = gzip.open
    elif magic[:1] == b"#":
        opener = open
    else:
        return len(str(header).splitlines())
    count = 0
    with opener(path, "rb") as fh:
        for line in fh:
            if not line.startswith(b"#"):
                break
            count += 1
    if opener is gzip.open:
        with gzip.open(path, "rb") as fh:
            if fh.read(3) == b"BCF":  # a BCF is gzip too; its header is binary
                return len(str(header).splitlines())
    return count


@dataclass
class _Source:
    """What writing the output VCF needs of the input: its header (completed by htslib with a
    line for each contig or tag the records use but the file never defined), the parsed records
    with their VCF line, and the store's length of each contig the file did not define."""

    header: pysam.VariantHeader
    records: list[tuple[int, pysam.VariantRecord]]
    lengths: dict[str, int]


def read_vcf(path: str | Path, store: TokenStore, multiallelic: str = "split") -> list[Variant]:
    """The alleles of a VCF, checked against the store before anything is scored: one line naming
    the VCF line for an unknown contig (with ``chr22``<->``22``), a position outside the contig, a
    REF that is not the genome's, a symbolic or breakend ALT, or a multi-allelic record with
    ``multiallelic="refuse"``. The VCF may be plain text, bgzip or plain gzip; its header need not
    list the contigs."""
    return _read(path, store, multiallelic)[0]


def _read(path: str | Path, store: TokenStore, multiallelic: str) -> tuple[list[Variant], _Source]:
    """:func:`read_vcf`, with what :func:`_write` needs of the input."""
    try:
        import pysam
    except ImportError:
        raise InputError("reading a VCF needs pysam (pip install pysam)") from None
    path = Path(path)
    if not path.is_file():
        raise InputError("no such VCF file", path)
    with _readable(path) as readable, _htslib_errors_only():
        try:
            vcf = pysam.VariantFile(str(readable))
        except (OSError, ValueError) as exc:
            raise InputError(f"not a readable VCF ({exc})", path) from None
        header, declared = vcf.header, set(vcf.header.contigs)
        first = _header_lines(readable, header) + 1
        with vcf:
            try:
                records = list(enumerate(vcf, first))
            except (OSError, ValueError) as exc:
                raise InputError(f"not a readable VCF ({exc})", path) from None
    out, lengths = [], {}
    for line, rec in records:
        where = f"line {line} ({rec.chrom}:{rec.pos})"
        try:
            chrom = resolve_name(rec.chrom, store.names, str(path))
        except InputError as exc:
            raise InputError(f"{where}: {exc.what}", path) from None
        length = store.length(chrom)
        if rec.chrom not in declared:
            lengths[rec.chrom] = length
        alts = list(rec.alts or ())
        if not alts:
            raise InputError(f"{where}: no ALT allele", path)
        if len(alts) > 1 and multiallelic == "refuse":
            raise InputError(f"{where}: {len(alts)} ALT alleles; split the record (bcftools norm "
                             "-m-) or score each allele ({multiallelic} split)", path,
                             options=("multiallelic",))
        ref = rec.ref.upper()
        if not 1 <= rec.pos <= length:
            raise InputError(f"{where}: position {rec.pos:,} is outside {chrom} (1..{length:,})",
                             path)
        if rec.start + len(ref) > length:
            raise InputError(f"{where}: REF of {len(ref):,} bases runs past the end of {chrom} "
                             f"(1..{length:,})", path)
        genome = np.asarray(store.tokens(chrom)[rec.start : rec.start + len(ref)])
        if not np.array_equal(genome, tokenize(ref)):
            seen = "".join("ACGTN"[min(int(t), 4)] for t in genome)
            raise InputError(f"{where}: REF {ref} does not match the genome ({seen})", path)
        for i, alt in enumerate(alts, 1):
            if alt.startswith(SYMBOLIC) or not set(alt.upper()) <= set("ACGTN"):
                raise InputError(f"{where}: ALT {alt!r} is symbolic or a breakend; only "
                                 "sequence alleles (SNVs, indels) are scored", path)
            out.append(Variant(chrom, rec.start, ref, alt.upper(), line, i, rec.id or "."))
    return out, _Source(header, records, lengths)


def _is_plain_gzip(path: Path) -> bool:
    """gzip but not bgzip: a bgzip block is a gzip member whose extra field holds a ``BC`` subfield
    (SAM/BAM spec, BGZF), which is what htslib needs to read it."""
    with open(path, "rb") as fh:
        head = fh.read(14)
    is_gzip = head[:2] == b"\x1f\x8b"
    is_bgzf = len(head) == 14 and bool(head[3] & 4) and head[12:14] == b"BC"
    return is_gzip and not is_bgzf


@contextmanager
def _readable(path: Path) -> Iterator[Path]:
    """``path`` as htslib can read it: itself, or for plain gzip (which htslib cannot open: pysam
    seeks in it) a decompressed copy in a temporary folder that is removed when the block ends,
    however it ends."""
    if not _is_plain_gzip(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="megabase-vcf-") as tmp:
        copy = Path(tmp) / "input.vcf"
        try:
            with gzip.open(path, "rb") as src, open(copy, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise InputError(f"not a readable gzip file ({exc})", path) from None
        yield copy


@contextmanager
def _htslib_errors_only() -> Iterator[None]:
    """Silence htslib's warnings while a VCF is read: for a contig or tag the header does not
    define it warns per record and advises indexing with tabix, but the records read fine and the
    output header gets the missing lines (:func:`_write`), so the advice would only mislead."""
    import pysam

    before = pysam.set_verbosity(1)
    try:
        yield
    finally:
        pysam.set_verbosity(before)


def _logp(logits: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    """Natural-log probability of each target ``[n]`` under ``logits [1, n, 4]`` (0 for non-bases:
    they carry no information)."""
    logp = torch.log_softmax(logits[0].float(), -1)
    t = torch.from_numpy(targets.astype(np.int64))
    got = logp.gather(1, t.clamp(max=N_BASES - 1)[:, None])[:, 0].double().numpy()
    return np.where(targets < N_BASES, got, 0.0)


@torch.no_grad()
def score_tile(model, tile: np.ndarray, edits: list[tuple[int, np.ndarray, np.ndarray]],
               horizon: int | None = None) -> list[float]:
    """``log p(alt tile) - log p(tile)`` for each edit ``(offset, ref tokens, alt tokens)`` of
    ``tile`` (offsets within it, ``ref`` as in the tile), the tile read from a ``<sep>`` start;
    with ``horizon`` only the edit's bases and the ``horizon`` bases after them are summed.

    Each alternative is scored as soon as the reference pass reaches it, from a fork of the
    state there, and only its sum is kept: a fork holds the DSA caches up to its position, so
    keeping them all until the reference pass ends would take memory in variants x window."""
    seq = np.concatenate([[SEP], tile]).astype(np.int64)
    inputs = torch.from_numpy(seq[:-1])[None]
    state, done, ref_logp = model.init_state(), 0, np.zeros(len(tile))

    def advance(inputs, state):
        if inputs.shape[1] > SHORT:
            return _advance(model, inputs, state)
        with one_thread():  # a short piece is many tiny ops: threads only slow it
            return _advance(model, inputs, state)

    alt_sums = [0.0] * len(edits)
    ends = [len(tile) if horizon is None else min(p + len(ref) + horizon, len(tile))
            for p, ref, _ in edits]
    for i in sorted(range(len(edits)), key=lambda i: edits[i][0]):
        p, ref, alt = edits[i]
        if p > done:
            logits, _ = advance(inputs[:, done:p], state)
            ref_logp[done:p] = _logp(logits, tile[done:p])
            done = p
        rest = np.concatenate([alt, tile[p + len(ref) : ends[i]]])
        alt_inputs = np.concatenate([[seq[p]], rest[:-1]]).astype(np.int64)
        logits, _ = advance(torch.from_numpy(alt_inputs)[None], fork(state))
        alt_sums[i] = float(_logp(logits, rest).sum())
    if done < len(tile):
        logits, _ = advance(inputs[:, done:], state)
        ref_logp[done:] = _logp(logits, tile[done:])
    suffix = np.concatenate([np.cumsum(ref_logp[::-1])[::-1], [0.0]])
    return [alt_sums[i] - float(suffix[edits[i][0]] - suffix[ends[i]]) for i in range(len(edits))]


def _spans(variants: list[Variant], window: int, context: int | None, horizon: int | None,
           length: int) -> list[tuple[int, int, int, int, list[Variant]]]:
    """The passes over one record: ``(forward lo, hi, reverse lo, hi, variants)``, spans of the
    record whose forward pass (and reverse complement) scores the variants. Tiles of ``window``
    from the record's start, or with ``context`` the spans that give each variant ``C .. 2C``
    bases of context before it (forward) and after it (reverse)."""
    groups: dict[int, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.pos // (context or window), []).append(v)
    out = []
    for k, members in groups.items():
        last = max(v.pos + len(v.ref) for v in members)
        if context is None:
            lo = k * window
            hi = max(min(lo + window, length), last)
            out.append((lo, hi, lo, hi, members))
            continue
        after = horizon or 0
        lo, hi = max((k - 1) * context, 0), max(min((k + 1) * context + after, length), last)
        rlo, rhi = max(k * context - after, 0), max(min((k + 2) * context, length), last)
        out.append((lo, hi, rlo, rhi, members))
    return out


def _rc(tokens: np.ndarray) -> np.ndarray:
    return RC_LUT[tokens][::-1].copy()


def score_variants(checkpoint: str | Path, data: str | Path, vcf: str | Path,
                   out: str | Path | None = None, window: int = DEFAULT_WINDOW,
                   both_strands: bool = False, multiallelic: str = "split",
                   progress: bool = True, dsa_stage: str | None = None,
                   context: int | None = None, horizon: int | None = None) -> VariantResult:
    """Score every allele of ``vcf`` against the store ``data`` (see the module). With ``out`` (a
    folder) writes ``variants.tsv`` and ``variants.vcf.gz`` (INFO ``MB_LLR``, one value per ALT).
    ``multiallelic``: ``split`` scores each allele, ``refuse`` stops at the first such record.
    ``context``: give each variant ``context .. 2 context`` bases of context (``window`` is then
    unused; ``horizon`` defaults to 256)."""
    if window < 16:
        raise InputError("{window} must be at least 16 bases", options=("window",))
    if context is not None and context < 16:
        raise InputError("{context} must be at least 16 bases", options=("context",))
    if horizon is not None and horizon < 0:
        raise InputError("{horizon} must be 0 or more bases", options=("horizon",))
    if multiallelic not in ("split", "refuse"):
        raise InputError("{multiallelic} must be split or refuse", options=("multiallelic",))
    if context is not None and horizon is None:
        horizon = DEFAULT_HORIZON
    started = time.perf_counter()
    store = TokenStore(data)
    variants, source = _read(vcf, store, multiallelic)
    if out is not None:
        out = check_output_dir(Path(out))
    with sole_writer(out, "variants", ("variants.tsv", "variants.vcf.gz")):
        model = load_model(checkpoint, dsa_stage)
        by_chrom: dict[str, list[Variant]] = {}
        for v in variants:
            by_chrom.setdefault(v.chrom, []).append(v)
        passes = 0
        with progress_of(len(variants), "variants", unit="variant", enabled=progress) as bar:
            for chrom, members_of in by_chrom.items():
                tokens = store.tokens(chrom)
                for lo, hi, rlo, rhi, members in _spans(members_of, window, context, horizon,
                                                        store.length(chrom)):
                    tile = np.asarray(tokens[lo:hi])
                    edits = [(v.pos - lo, tokenize(v.ref), tokenize(v.alt)) for v in members]
                    for v, d in zip(members, score_tile(model, tile, edits, horizon)):
                        v.delta_fwd = d
                    if both_strands:
                        tile = np.asarray(tokens[rlo:rhi])
                        rc = [(rhi - v.pos - len(v.ref), _rc(tokenize(v.ref)), _rc(tokenize(v.alt)))
                              for v in members]
                        for v, d in zip(members, score_tile(model, _rc(tile), rc, horizon)):
                            v.delta_rev = d
                    passes += 1
                    bar.update(len(members))
        result = VariantResult(variants, passes, window=window, context=context, horizon=horizon)
        if out is not None:
            result.files = _write(out, source, variants, window, both_strands, context, horizon)
    result.seconds, result.peak_rss = time.perf_counter() - started, peak_rss_bytes()
    return result


def scope(window: int, context: int | None, horizon: int | None) -> str:
    """How the scores were made, in words (the VCF header's and the summary's)."""
    after = "to the window's end" if horizon is None else f"over the variant and {horizon:,} bases after"
    if context is None:
        return f"{window:,}-base windows, summed {after}"
    return f"{context:,} to {2 * context:,} bases of prior context, summed {after}"


# a contig line htslib adds to a header for a record whose contig the file did not define
_BARE_CONTIG = re.compile(r"^##contig=<ID=([^,>]+)>$")


def _write(out: Path, source: _Source, variants: list[Variant], window: int,
           both_strands: bool, context: int | None = None,
           horizon: int | None = None) -> dict[str, str]:
    """``variants.tsv`` and ``variants.vcf.gz`` (bgzip), both or neither: each is written to a
    temporary sibling, removed on any error, and both are renamed into place at the end.

    The VCF is written as text, not through htslib's writer: a record read against a header that
    lacked its contig or a tag carries an error flag that makes htslib end the process (not
    raise) when it is written, leaving the temporary file behind. Contigs the input did not
    define get a ``##contig`` line with the store's length, so the output is indexable."""
    import pysam

    rows = ["#chrom\tpos\tid\tref\talt\tvcf_line\tllr_fwd\tllr_rev\tllr"]
    for v in variants:
        rows.append(f"{v.chrom}\t{v.pos + 1}\t{v.id}\t{v.ref}\t{v.alt}\t{v.line}\t"
                    f"{v.delta_fwd:.6g}\t{v.delta_rev:.6g}\t{v.delta:.6g}")
    by_line: dict[int, list[float]] = {}
    for v in variants:
        by_line.setdefault(v.line, []).append(v.delta)
    header = source.header
    strands = "both strands averaged" if both_strands else "forward strand"
    header.add_meta("INFO", items=[
        ("ID", "MB_LLR"), ("Number", "A"), ("Type", "Float"),
        ("Description", "megabase: log p(alt window) - log p(ref window), nats, "
                        f"{scope(window, context, horizon)}, {strands}")])
    lines = []
    for line in str(header).splitlines():
        bare = _BARE_CONTIG.match(line)
        if bare and bare.group(1) in source.lengths:
            line = f"##contig=<ID={bare.group(1)},length={source.lengths[bare.group(1)]}>"
        lines.append(line + "\n")
    tsv, vcf = out / "variants.tsv", out / "variants.vcf.gz"
    # the VCF, the one more likely to fail (the larger, written last), is renamed first, so that
    # its failure also takes the finished TSV's temporary away
    with writing(tsv) as tsv_tmp, writing(vcf) as vcf_tmp:
        tsv_tmp.write_bytes(("\n".join(rows) + "\n").encode())
        with pysam.BGZFile(str(vcf_tmp), "wb") as dst:
            dst.write("".join(lines).encode())
            for line, rec in source.records:
                rec.info["MB_LLR"] = [round(x, 6) for x in by_line[line]]
                dst.write(str(rec).encode())
    return {"tsv": str(tsv), "vcf": str(vcf)}
