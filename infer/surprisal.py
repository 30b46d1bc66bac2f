"""``megabase score``: per-base surprisal (and entropy) of regions, as arrays, bedGraph and bigWig."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.data import TokenStore
from megabase.data.vocab import N_BASES, SEP

from .common import (DEFAULT_SEGMENT, LN2, Interval, check_output_dir, load_model, peak_rss_bytes,
                     resolve_regions, tokens_of)
from .tracks import check_disjoint, require_pybigwig, write_bedgraph, write_bigwig


@dataclass
class Track:
    """One region's per-base values: ``bits [n]`` float32, the surprisal ``-log2 p(base | the bases
    before it)`` (NaN where the base is not A/C/G/T), and ``entropy [n]`` of the predicted
    distribution over A/C/G/T in bits (or None)."""

    region: Interval
    bits: np.ndarray
    entropy: np.ndarray | None = None

    @property
    def mean_bits(self) -> float:
        scored = self.bits[~np.isnan(self.bits)]
        return float(scored.mean()) if scored.size else float("nan")


@dataclass
class ScoreResult:
    tracks: list[Track]
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss: int = 0


def score_tokens(model, tokens: np.ndarray, skip: int = 0, segment: int = DEFAULT_SEGMENT,
                 entropy: bool = False, progress=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Surprisal (bits) of ``tokens[skip:]`` given everything before each base (``tokens[:skip]``
    is context only), streamed ``segment`` bases at a time: ``(bits [n - skip], entropy or
    None)``. ``progress``: called with the number of bases of each piece once it is done."""
    from megabase.model import stream

    seq = np.concatenate([[SEP], tokens]).astype(np.int64)
    inputs, targets = torch.from_numpy(seq[:-1])[None], torch.from_numpy(seq[1:])
    n = len(tokens)
    bits = np.full(n, np.nan, dtype=np.float32)
    ent = np.full(n, np.nan, dtype=np.float32) if entropy else None
    for start, logits, _ in stream(model, inputs, segment):
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        end = start + logp.shape[0]
        target = targets[start:end]
        got = -logp.gather(1, target.clamp(max=N_BASES - 1)[:, None])[:, 0] / LN2
        got[target >= N_BASES] = float("nan")
        bits[start:end] = got.numpy()
        if ent is not None:
            ent[start:end] = (-(logp.exp() * logp).sum(-1) / LN2).numpy()
        if progress is not None:
            progress(end - start)
    return bits[skip:], None if ent is None else ent[skip:]


def score(checkpoint: str | Path, data: str | Path, regions: list[str], out: str | Path | None = None,
          entropy: bool = False, context: int = 0, segment: int = DEFAULT_SEGMENT,
          formats: tuple[str, ...] = ("bedgraph", "bigwig"), progress: bool = True,
          dsa_stage: str | None = None) -> ScoreResult:
    """Score ``regions`` of the token store ``data`` with a checkpoint.

    Each region is read from its first base (``context`` > 0: with up to that many bases of the
    record before it as context, not scored) and streamed ``segment`` bases at a time, so memory is
    bounded by the segment plus the DSA layers' key caches (a few hundred bytes a base), not by the
    region. With ``out`` (a folder) writes ``surprisal.bedgraph`` / ``surprisal.bw`` (and
    ``entropy.*``), one value per base, bases that are not A/C/G/T left out.
    """
    from tqdm.auto import tqdm

    from megabase.data import InputError

    if segment < 1 or context < 0:
        raise InputError("{segment} must be positive and {context} at least 0",
                         options=("segment", "context"))
    unknown = set(formats) - {"bedgraph", "bigwig"}
    if unknown:
        raise InputError(f"unknown format(s) {sorted(unknown)}: choose bedgraph, bigwig",
                         options=("formats",))
    started = time.perf_counter()
    store = TokenStore(data)
    intervals = resolve_regions(store, list(regions))
    out = None if out is None else check_output_dir(Path(out))
    if out is not None:
        check_disjoint(intervals)
        if "bigwig" in formats:
            require_pybigwig()
    model = load_model(checkpoint, dsa_stage)
    pieces = [(iv, *tokens_of(store, iv, context)) for iv in intervals]
    tracks = []
    with tqdm(total=sum(len(t) for _, t, _ in pieces), unit="base", unit_scale=True,
              disable=not progress, desc="score") as bar:
        for iv, tokens, skip in pieces:
            bits, ent = score_tokens(model, tokens, skip, segment, entropy, bar.update)
            tracks.append(Track(iv, bits, ent))
    files = {}
    if out is not None:
        sizes = {name: store.length(name) for name in store.names}
        for key in ("bits", "entropy") if entropy else ("bits",):
            stem = "surprisal" if key == "bits" else "entropy"
            values = [(t.region, getattr(t, key)) for t in tracks]
            if "bedgraph" in formats:
                files[f"{stem}.bedgraph"] = str(write_bedgraph(out / f"{stem}.bedgraph", values,
                                                               name=f"megabase {stem}"))
            if "bigwig" in formats:
                files[f"{stem}.bw"] = str(write_bigwig(out / f"{stem}.bw", values, sizes))
    return ScoreResult(tracks, files, time.perf_counter() - started, peak_rss_bytes())
