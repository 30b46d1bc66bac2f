"""``megabase generate``: sample a continuation of a prompt, one base per step through the carried
state (incremental decoding: a new base costs one step, not a pass over the prefix)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.data import InputError, TokenStore
from megabase.core.vocab import N_BASES, SEP, SYMBOLS

from .common import (DEFAULT_SEGMENT, check_output_dir, load_model, peak_rss_bytes,
                     resolve_regions)


@dataclass
class Sample:
    """One generated sequence: ``tokens [n]`` (A/C/G/T ids) and ``log_probs [n]``, the model's
    natural-log probability of each sampled base (temperature 1, no top-k), as a teacher-forced
    pass over prompt + sample gives it."""

    tokens: np.ndarray
    log_probs: np.ndarray
    seed: int

    @property
    def text(self) -> str:
        return "".join(SYMBOLS[t] for t in self.tokens.tolist())

    @property
    def gc(self) -> float:
        return float(np.isin(self.tokens, (1, 2)).mean()) if len(self.tokens) else float("nan")


@dataclass
class GenerateResult:
    samples: list[Sample]
    prompt: str
    prompt_length: int
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    bases_per_s: float = 0.0
    peak_rss: int = 0


def _check_sampling(length: int, temperature: float, top_k: int) -> None:
    if length < 1:
        raise InputError("{length} must be positive", options=("length",))
    if not temperature > 0 or not np.isfinite(temperature):
        raise InputError(f"{{temperature}} must be positive, got {temperature}",
                         options=("temperature",))
    if not 0 <= top_k <= N_BASES:
        raise InputError(f"{{top_k}} must be 0 (off) to {N_BASES}, got {top_k}", options=("top_k",))


@torch.no_grad()
def generate_tokens(model, prompt: np.ndarray, length: int, temperature: float = 1.0,
                    top_k: int = 0, seed: int = 0, segment: int = DEFAULT_SEGMENT,
                    progress=None) -> Sample:
    """Sample ``length`` bases after ``prompt`` (token ids; a ``<sep>`` start is put before it).

    The prompt is read ``segment`` bases at a time; then each base is drawn from the softmax of the
    logits over A/C/G/T divided by ``temperature`` (only the ``top_k`` most likely when > 0) with a
    ``torch.Generator`` seeded by ``seed``, and fed back as one step. ``progress``: called with 1
    after each base."""
    from megabase.model import advance
    from megabase.model.layers import one_thread, untiled

    _check_sampling(length, temperature, top_k)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt]).astype(np.int64))[None]
    state = model.init_state()
    for start in range(0, seq.shape[1], segment):
        logits, _ = advance(model, seq[:, start : start + segment], state)
    gen = torch.Generator().manual_seed(seed)
    tokens = np.empty(length, dtype=np.uint8)
    logps = np.empty(length, dtype=np.float32)
    for i in range(length):
        last = logits[0, -1].float()
        scores = last / temperature
        if top_k:
            scores = scores.masked_fill(scores < scores.topk(top_k).values[-1], float("-inf"))
        base = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
        tokens[i], logps[i] = base, float(torch.log_softmax(last, -1)[base])
        with untiled(), one_thread():
            logits, _ = advance(model, torch.tensor([[base]]), state)
        if progress is not None:
            progress(1)
    return Sample(tokens, logps, seed)


def read_prompt(store: TokenStore | None, region: str | None, fasta: str | None) -> tuple[np.ndarray, str]:
    """The prompt's tokens and a label: a region of a store, or the first record of a FASTA."""
    if (region is None) == (fasta is None):
        raise InputError("give one prompt: {prompt_region} (with a store) or {prompt_fasta}",
                         options=("prompt_region", "prompt_fasta"))
    if region is not None:
        if store is None:
            raise InputError("{prompt_region} needs a token store ({data})",
                             options=("prompt_region", "data"))
        iv = resolve_regions(store, [region])[0]
        return np.asarray(store.tokens(iv.chrom)[iv.start : iv.end]), iv.spec
    from megabase.data.fasta import read_fasta

    for record in read_fasta(fasta):
        if not record.length:
            raise InputError("its first record holds no bases", fasta, record.name)
        return record.token_array(), f"{Path(fasta).name}:{record.name}"
    raise InputError("holds no records", fasta)


def write_fasta(path: Path, samples: list[Sample], header: str, width: int = 80) -> Path:
    from megabase.core.atomic import write_atomic

    lines = []
    for i, s in enumerate(samples):
        lines.append(f">sample{i + 1} seed={s.seed} {header} mean_log2p={s.log_probs.mean() / np.log(2):.4f}")
        text = s.text
        lines.extend(text[j : j + width] for j in range(0, len(text), width))
    return write_atomic(path, ("\n".join(lines) + "\n").encode())


def generate(checkpoint: str | Path, length: int, out: str | Path | None = None,
             data: str | Path | None = None, prompt_region: str | None = None,
             prompt_fasta: str | None = None, samples: int = 1, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, segment: int = DEFAULT_SEGMENT,
             progress: bool = True,
             dsa_stage: str | None = None) -> GenerateResult:
    """Sample ``samples`` continuations (seeds ``seed``, ``seed + 1``, ...) of ``length`` bases
    after a prompt (a region of the store ``data``, or the first record of ``prompt_fasta``);
    with ``out`` (a file) write them as FASTA."""
    from megabase.data.progress import progress as progress_of

    started = time.perf_counter()
    _check_sampling(length, temperature, top_k)
    if samples < 1:
        raise InputError("{samples} must be positive", options=("samples",))
    store = TokenStore(data) if data is not None else None
    prompt, label = read_prompt(store, prompt_region, prompt_fasta)
    if out is not None:
        out = Path(out)
        if out.is_dir():
            raise InputError("is a directory; give a FASTA file name", out, options=("out",))
        check_output_dir(out.parent)
    model = load_model(checkpoint, dsa_stage)
    results = []
    with progress_of(samples * length, "generate", unit="base", enabled=progress) as bar:
        for i in range(samples):
            results.append(generate_tokens(model, prompt, length, temperature, top_k, seed + i,
                                           segment, bar.update))
    seconds = time.perf_counter() - started
    files = {}
    if out is not None:
        header = (f"prompt={label} prompt_length={len(prompt)} temperature={temperature} "
                  f"top_k={top_k}")
        files["fasta"] = str(write_fasta(out, results, header))
    return GenerateResult(results, label, len(prompt), files, seconds,
                          samples * length / max(seconds, 1e-9), peak_rss_bytes())
