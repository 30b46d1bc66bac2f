"""``megabase embed``: hidden states of a chosen layer for windows or regions, mean-pooled per
window or per base, as a Hugging Face ``datasets.Dataset`` and ``.npy``."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.core.atomic import building_dir, retarget, writing
from megabase.core.vocab import SEP
from megabase.data import InputError, TokenStore, read_bed
from megabase.data.progress import progress as progress_of
from megabase.model import stream

from .common import (DEFAULT_SEGMENT, Interval, check_output_dir, load_model, peak_rss_bytes,
                     resolve_regions, sole_writer)


DATASET, ARRAY = "embeddings.dataset", "embeddings.npy"


@dataclass
class EmbedResult:
    windows: list[Interval]
    embeddings: np.ndarray  # [windows, d] mean-pooled, or [bases of all windows, d] per base
    offsets: np.ndarray  # [windows + 1]: window i's rows of a per-base array (i, i + 1 when pooled)
    layer: int
    per_base: bool
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss: int = 0


def embed_tokens(model, tokens: np.ndarray, layer: int | None = None, per_base: bool = False,
                 segment: int = DEFAULT_SEGMENT) -> np.ndarray:
    """The residual stream after block ``layer`` (default: the last) at each base of ``tokens``
    (having read that base and the ones before it, after a ``<sep>`` start), streamed ``segment``
    bases at a time: ``[n, d]`` float32 per base, or its mean ``[d]`` (summed in fp64)."""
    layer = len(model.blocks) if layer is None else layer
    seq = torch.from_numpy(np.concatenate([[SEP], tokens]).astype(np.int64))[None]
    total = np.zeros(model.cfg.d_model, dtype=np.float64)
    rows = []
    for start, _, hidden in stream(model, seq, segment, layer=layer):
        h = hidden[0].float()
        if start == 0:
            h = h[1:]  # the <sep> start is not a base
        if per_base:
            rows.append(h.numpy())
        else:
            total += h.double().sum(0).numpy()
    if per_base:
        return np.concatenate(rows).astype(np.float32, copy=False)
    return (total / max(len(tokens), 1)).astype(np.float32)


def _intervals(store: TokenStore, windows: str | Path | None, split: str | None,
               regions: list[str] | None) -> list[Interval]:
    if (windows is None) == (not regions):
        raise InputError("give windows as a BED ({windows}) or as {regions}, not both",
                         options=("windows", "regions"))
    if regions:
        return resolve_regions(store, list(regions))
    out = []
    for w in read_bed(windows, split):
        name = store.resolve(w.chrom)
        if w.end > store.length(name):
            raise InputError(f"window {w.chrom}:{w.start}-{w.end} ends past {name} "
                             f"({store.length(name):,} bases)", windows)
        out.append(Interval(name, w.start, w.end, f"{name}:{w.start + 1:,}-{w.end:,}"))
    return out


def _check_dataset_dir(path: Path) -> None:
    """``embeddings.dataset`` is replaced only if it is one (never a folder megabase did not write)."""
    if path.exists() and not (path / "dataset_info.json").exists():
        raise InputError("exists and is not a saved dataset; choose another {out}", path,
                         options=("out",))


def _write(out: Path, result: EmbedResult, progress: bool = True) -> dict[str, str]:
    """``embeddings.npy`` and ``embeddings.dataset``, both or neither: the array's temporary is
    renamed into place only once the dataset is; a write that fails (a full disk) is the
    OSError naming the file, not the ``datasets`` error wrapped around it. ``progress``: False
    silences ``datasets``' own bars too."""
    import datasets

    d = result.embeddings.shape[-1]
    feature = (datasets.Array2D(shape=(None, d), dtype="float32") if result.per_base
               else datasets.Sequence(datasets.Value("float32"), length=d))
    features = datasets.Features({"chrom": datasets.Value("string"), "start": datasets.Value("int64"),
                                  "end": datasets.Value("int64"), "row": datasets.Value("int64"),
                                  "embedding": feature})

    def rows():
        for i, w in enumerate(result.windows):
            lo, hi = int(result.offsets[i]), int(result.offsets[i + 1])
            value = result.embeddings[lo:hi] if result.per_base else result.embeddings[i]
            yield {"chrom": w.chrom, "start": w.start, "end": w.end, "row": lo, "embedding": value}

    quiet = not progress and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        _write_pair(out, result, features, rows)
    finally:
        if quiet:
            datasets.enable_progress_bars()
    return {"npy": str(out / ARRAY), "dataset": str(out / DATASET)}


def _write_pair(out: Path, result: EmbedResult, features, rows) -> None:
    """:func:`_write`'s two files, the dataset built from ``rows()`` with ``features``."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    with writing(out / ARRAY) as array_tmp:
        with open(array_tmp, "wb") as fh:
            np.save(fh, result.embeddings)
        with tempfile.TemporaryDirectory(prefix=".embed-cache-", dir=out) as cache, \
                building_dir(out / DATASET) as tmp:
            try:
                ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=cache)
            except DatasetGenerationError as exc:  # its cache is written first: a full disk
                cause = exc.__cause__
                if isinstance(cause, OSError):
                    raise retarget(cause, out / DATASET) from None
                raise
            ds.save_to_disk(str(tmp))


def embed(checkpoint: str | Path, data: str | Path, windows: str | Path | None = None,
          regions: list[str] | None = None, split: str | None = None, layer: int | None = None,
          per_base: bool = False, out: str | Path | None = None, segment: int = DEFAULT_SEGMENT,
          progress: bool = True,
          dsa_stage: str | None = None) -> EmbedResult:
    """Embed the windows of a BED (``windows``, optionally one ``split``) or ``regions`` of the
    store ``data``: the hidden state after block ``layer`` (1..n_layers, default the last),
    mean-pooled per window or ``per_base``, each window streamed ``segment`` bases at a time from
    its own start. With ``out`` (a folder) writes ``embeddings.npy`` and ``embeddings.dataset``
    (``datasets.load_from_disk``: columns chrom, start, end, row, embedding)."""
    started = time.perf_counter()
    store = TokenStore(data)
    intervals = _intervals(store, windows, split, regions)
    if out is not None:
        out = check_output_dir(Path(out))
        _check_dataset_dir(out / DATASET)
    with sole_writer(out, "embed", (ARRAY, DATASET)):
        model = load_model(checkpoint, dsa_stage)
        n_layers = len(model.blocks)
        layer = n_layers if layer is None else layer
        if not 1 <= layer <= n_layers:
            raise InputError(f"{{layer}} must be 1..{n_layers} for this model, got {layer}",
                             options=("layer",))
        parts = []
        with progress_of(sum(iv.length for iv in intervals), "embed", unit="base",
                         enabled=progress) as bar:
            for iv in intervals:
                tokens = np.asarray(store.tokens(iv.chrom)[iv.start : iv.end])
                parts.append(embed_tokens(model, tokens, layer, per_base, segment))
                bar.update(iv.length)
        sizes = [len(p) if per_base else 1 for p in parts]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        array = np.concatenate(parts) if per_base else np.stack(parts)
        result = EmbedResult(intervals, array, offsets, layer, per_base)
        if out is not None:
            result.files = _write(out, result, progress)
    result.seconds, result.peak_rss = time.perf_counter() - started, peak_rss_bytes()
    return result
