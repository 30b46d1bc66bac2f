"""``megabase score``: per-base surprisal (and entropy) of regions, as arrays, bedGraph and bigWig.

An output folder holds the tracks of one score run and ``score.json``, which says what they are
(checkpoint, store, regions, options, files): a run replaces every track an earlier run left there,
never a mix of two runs, and only one runs on a folder at a time (:func:`.common.sole_writer`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.core.atomic import writing
from megabase.core.vocab import N_BASES, SEP
from megabase.data import InputError, TokenStore
from megabase.data.progress import progress as progress_of
from megabase.model import stream
from megabase.model.checkpoint import resolve_checkpoint, weights_sha256

from .common import (DEFAULT_SEGMENT, LN2, Interval, check_output_dir, load_model, peak_rss_bytes,
                     resolve_regions, sole_writer, tokens_of)
from .tracks import check_disjoint, require_pybigwig, write_bedgraph, write_bigwig


MANIFEST = "score.json"
# every track file a score run may write: the ones a run does not write are an earlier run's
TRACK_FILES = ("surprisal.bedgraph", "surprisal.bw", "entropy.bedgraph", "entropy.bw")


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
    ``entropy.*``), one value per base, bases that are not A/C/G/T left out, and ``score.json``
    (what was scored, how, and the files); track files of an earlier run that this one does not
    write are removed (see the module's docs), other files are left alone.
    """

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
    with sole_writer(out, "score", (*TRACK_FILES, MANIFEST)):
        ckpt = resolve_checkpoint(checkpoint)
        model = load_model(ckpt, dsa_stage)
        pieces = [(iv, *tokens_of(store, iv, context)) for iv in intervals]
        tracks = []
        with progress_of(sum(len(t) for _, t, _ in pieces), "score", unit="base",
                         enabled=progress) as bar:
            for iv, tokens, skip in pieces:
                bits, ent = score_tokens(model, tokens, skip, segment, entropy, bar.update)
                tracks.append(Track(iv, bits, ent))
        files = {}
        if out is not None:
            run = {"checkpoint": str(Path(ckpt).resolve()),
                   "checkpoint_sha256": weights_sha256(ckpt),
                   "data": str(store.path.resolve()), "regions": [iv.spec for iv in intervals],
                   "context": context, "entropy": entropy, "formats": list(formats),
                   "dsa_stage": model.cfg.dsa_stage.summary}
            files = _write_tracks(out, store, tracks, entropy, formats, run)
    return ScoreResult(tracks, files, time.perf_counter() - started, peak_rss_bytes())


def _write_tracks(out: Path, store: TokenStore, tracks: list[Track], entropy: bool,
                  formats: tuple[str, ...], run: dict) -> dict[str, str]:
    """Write this run's tracks and ``score.json`` (``run`` plus the files) into ``out``; returns
    file name -> path. Every file is written to a temporary sibling first, so a failure (a full
    disk) leaves ``out`` as it was, naming the file it could not write; then the earlier
    manifest and the track files this run does not write go (an earlier run's: left, they would
    sit beside this run's as if from it), the tracks are renamed into place and the manifest
    last, so a folder with a manifest holds exactly that run's tracks."""
    from contextlib import ExitStack

    sizes = {name: store.length(name) for name in store.names}
    stems = {"surprisal": "bits", **({"entropy": "entropy"} if entropy else {})}
    ext = {"bedgraph": "bedgraph", "bigwig": "bw"}
    written = sorted({f"{stem}.{ext[fmt]}" for stem in stems for fmt in formats})
    with ExitStack() as renames:  # on leaving, last entered first: the manifest is renamed last
        manifest_tmp = renames.enter_context(writing(out / MANIFEST))
        tmp = {name: renames.enter_context(writing(out / name)) for name in written}
        for stem, key in stems.items():
            values = [(t.region, getattr(t, key)) for t in tracks]
            if "bedgraph" in formats:
                write_bedgraph(tmp[f"{stem}.bedgraph"], values, name=f"megabase {stem}")
            if "bigwig" in formats:
                write_bigwig(tmp[f"{stem}.bw"], values, sizes)
        manifest = {"command": "megabase score", **run,
                    "files": {name: tmp[name].stat().st_size for name in written}}
        manifest_tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        (out / MANIFEST).unlink(missing_ok=True)
        for name in set(TRACK_FILES) - set(written):
            (out / name).unlink(missing_ok=True)
    return {**{name: str(out / name) for name in written}, MANIFEST: str(out / MANIFEST)}
