"""Sampling: the one batched sampler (:func:`sample`) and ``megabase generate`` on top of it.

A sampler reads the prompts once (:func:`megabase.model.prefill`), then draws a base per sequence
per step and feeds it back as one decoding step (:func:`megabase.model.decode_step`): a new base
costs one step, not a pass over the prefix. ``megabase generate`` samples one sequence at a time
(a seed each); RL's generator samples a batch of groups and changes the weights between steps
(``before_step``); the Hugging Face wrapper's generation takes the same decoding step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megabase.core.errors import TrainingError
from megabase.core.vocab import N_BASES, SEP, SYMBOLS, gc_fraction
from megabase.data import InputError, TokenStore
from megabase.data.fasta import read_fasta, write_fasta
from megabase.data.progress import progress as progress_of
from megabase.model import Piece, decode_step, prefill, repeat_state, state_bytes

from .common import DEFAULT_SEGMENT, check_output_dir, load_model, peak_rss_bytes, resolve_regions


class SamplingError(TrainingError):
    """The sampling probabilities became NaN or infinite at ``base`` (1-based): a temperature so
    small that ``logits / temperature`` overflows, or a model whose weights broke."""

    def __init__(self, base: int):
        super().__init__(f"sampling probabilities became non-finite at base {base}")
        self.base = base


@dataclass
class Decoded:
    """A batch's samples: ``tokens [N, L]`` (A/C/G/T ids), ``log_probs [N, L]`` (natural log of
    each base under the model, temperature 1), ``sampled_log_probs [N, L]`` (under the distribution
    it was drawn from: temperature and top-k applied) and, when recorded, ``routing``: per MoE
    layer the experts ``[N, P + L - 1, k]`` (uint8) of every input token, prompt included;
    ``state_bytes``: what the batch's state held after its last base (every row's copy of its
    prompt's KDA states and DSA caches, and the bases drawn)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    sampled_log_probs: torch.Tensor
    routing: list[torch.Tensor] | None = None
    state_bytes: int = 0


@torch.no_grad()
def sample(model, prompts: torch.Tensor, length: int, temperature: float = 1.0, top_k: int = 0,
           gen: torch.Generator | None = None, segment: int = DEFAULT_SEGMENT,
           before_step: Callable[[int], bool] | None = None,
           after_step: Callable[[int], None] | None = None,
           record_routing: bool = False, group: int = 1) -> Decoded:
    """Draw ``length`` bases ``group`` times after each row of ``prompts [n, P]`` (token ids, the
    ``<sep>`` start included), all ``N = n * group`` samples as one batch (rows ``g * group ..
    (g + 1) * group - 1`` follow prompt ``g``).

    Each prompt is read once, ``segment`` tokens at a time, and its state copied for its
    ``group`` samples (:func:`~megabase.model.stream.repeat_state`); each base is drawn from the
    softmax of the logits over A/C/G/T divided by ``temperature`` (only the ``top_k`` most likely
    when > 0) with ``gen``. ``before_step(i)`` runs before base ``i`` (1-based from the second
    base) is drawn: the weights may change there, and when it returns True the state is read
    again under the new weights: each prompt once more, then each sample's bases drawn so far
    (the routing recorded so far is dropped with it). ``after_step(i)`` runs after base ``i`` is
    drawn. Raises :class:`SamplingError` when the probabilities are not finite.
    """
    n, P = prompts.shape
    N = n * group
    out = torch.empty(N, P + length, dtype=torch.int64)
    out[:, :P] = prompts.repeat_interleave(group, 0)
    logps = torch.empty(N, length)
    sampled = torch.empty(N, length)

    def read(drawn: int):
        state, piece = prefill(model, prompts, segment)
        state = repeat_state(state, group)
        logits = piece.logits.repeat_interleave(group, 0)
        routes = [r.repeat_interleave(group, 0) for r in piece.routing]
        if drawn:
            state, more = prefill(model, out[:, P : P + drawn], segment, state)
            logits, routes = more.logits, [torch.cat(pair, 1) for pair in zip(routes, more.routing)]
        return state, Piece(logits, routes)

    state, piece = read(0)
    routing = [piece.routing] if record_routing else None
    for i in range(length):
        if i and before_step is not None and before_step(i):
            state, piece = read(i)
            routing = [piece.routing] if record_routing else None
        last = piece.logits[:, -1].float()
        scores = last / temperature
        if top_k:
            scores = scores.masked_fill(scores < scores.topk(top_k, -1).values[:, -1:], float("-inf"))
        probs = torch.softmax(scores, -1)
        if not bool(torch.isfinite(probs).all()):  # else multinomial's RuntimeError
            raise SamplingError(i + 1)
        base = torch.multinomial(probs, 1, generator=gen)[:, 0]
        out[:, P + i] = base
        logps[:, i] = torch.log_softmax(last, -1).gather(1, base[:, None])[:, 0]
        sampled[:, i] = torch.log_softmax(scores, -1).gather(1, base[:, None])[:, 0]
        if after_step is not None:
            after_step(i + 1)
        if i + 1 < length:  # the last base is never an input
            piece = decode_step(model, base[:, None], state)
            if record_routing:
                routing.append(piece.routing)
    if record_routing:
        routing = [torch.cat(layer, 1) for layer in zip(*routing)]
    return Decoded(out[:, P:], logps, sampled, routing, state_bytes(state))


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
        return gc_fraction(self.tokens)


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


def generate_tokens(model, prompt: np.ndarray, length: int, temperature: float = 1.0,
                    top_k: int = 0, seed: int = 0, segment: int = DEFAULT_SEGMENT,
                    progress=None) -> Sample:
    """Sample ``length`` bases after ``prompt`` (token ids; a ``<sep>`` start is put before it)
    with :func:`sample` and a ``torch.Generator`` seeded by ``seed``. ``progress``: called with 1
    after each base."""
    _check_sampling(length, temperature, top_k)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt]).astype(np.int64))[None]
    gen = torch.Generator().manual_seed(seed)
    after = None if progress is None else (lambda i: progress(1))
    done = sample(model, seq, length, temperature, top_k, gen, segment, after_step=after)
    return Sample(done.tokens[0].numpy().astype(np.uint8),
                  done.log_probs[0].numpy().astype(np.float32), seed)


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
    for record in read_fasta(fasta):
        if not record.length:
            raise InputError("its first record holds no bases", fasta, record.name)
        return record.token_array(), f"{Path(fasta).name}:{record.name}"
    raise InputError("holds no records", fasta)


def generate(checkpoint: str | Path, length: int, out: str | Path | None = None,
             data: str | Path | None = None, prompt_region: str | None = None,
             prompt_fasta: str | None = None, samples: int = 1, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, segment: int = DEFAULT_SEGMENT,
             progress: bool = True,
             dsa_stage: str | None = None) -> GenerateResult:
    """Sample ``samples`` continuations (seeds ``seed``, ``seed + 1``, ...) of ``length`` bases
    after a prompt (a region of the store ``data``, or the first record of ``prompt_fasta``);
    with ``out`` (a file) write them as FASTA."""
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
        records = [(f"sample{i + 1} seed={s.seed} {header} "
                    f"mean_log2p={s.log_probs.mean() / np.log(2):.4f}", s.text)
                   for i, s in enumerate(results)]
        files["fasta"] = str(write_fasta(out, records))
    return GenerateResult(results, label, len(prompt), files, seconds,
                          samples * length / max(seconds, 1e-9), peak_rss_bytes())
