"""Running a model over a long sequence piece by piece: memory bounded by the piece, the numbers of
the full pass; and the two moves of every sampler, :func:`prefill` and :func:`decode_step`.

Each piece continues from the carried state (KDA states, conv tails, DSA key caches, the k-mer
tables' last tokens). :func:`stream` commits state only at multiples of ``ROW_TILE`` positions,
where every canonical tile of the full pass begins; the tokens of an unfinished tile are recomputed
with the next piece (at most ``ROW_TILE - 1`` tokens of extra work per piece), so on CPU all but a
few tokens come out bit for bit as in one pass (see the README). :func:`advance` commits wherever
it stops (incremental decoding, variants scored from a shared prefix): the same numbers to fp32
round-off. :func:`decode_step` is :func:`advance` of one new token per sequence with untiled
products on one thread, what generation, RL rollouts and the Hugging Face wrapper all take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .context import Context
from .layers import ROW_TILE
from .lm import HybridLM


@dataclass
class Piece:
    """What a piece of a streamed call gives: ``logits [B, n, 4]`` fp32 over A/C/G/T and, per MoE
    layer, the experts its tokens went to (``routing``, ``[B, n, k]`` uint8)."""

    logits: torch.Tensor
    routing: list[torch.Tensor]


@torch.no_grad()
def advance(model: HybridLM, inputs: torch.Tensor, state: list[dict], layer: int | None = None,
            ctx: Context | None = None):
    """Run ``inputs [B, n]`` from ``state`` (``model.init_state()`` at the start; extended in
    place) -> ``(logits [B, n, 4] fp32, hidden [B, n, d] after block ``layer`` or None)``.
    ``ctx``: how the call runs (:meth:`HybridLM.context`)."""
    logits, hidden, _ = _run(model, inputs, state, layer, ctx)
    return logits, hidden


def _run(model: HybridLM, inputs, state, layer, ctx):
    captured: list[torch.Tensor] = []
    handle = None
    if layer is not None:
        if not 1 <= layer <= len(model.blocks):
            raise ValueError(f"layer must be 1..{len(model.blocks)}, got {layer}")
        handle = model.blocks[layer - 1].register_forward_hook(
            lambda module, args, out: captured.append(out[0]))
    try:
        out = model(inputs, state=state, ctx=ctx)
    finally:
        if handle is not None:
            handle.remove()
    return out.logits, (captured[0] if captured else None), out.routing


@torch.no_grad()
def prefill(model: HybridLM, tokens: torch.Tensor, segment: int,
            state: list[dict] | None = None) -> tuple[list[dict], Piece]:
    """Read ``tokens [B, P]`` into ``state`` (extended; a new one when None) ``segment`` tokens at
    a time -> ``(state, the last piece's logits with every piece's routing)``."""
    state = model.init_state() if state is None else state
    logits, parts = None, []
    for s in range(0, tokens.shape[1], segment):
        logits, _, routing = _run(model, tokens[:, s : s + segment], state, None, None)
        parts.append(routing)
    return state, Piece(logits, [torch.cat(layer, 1) for layer in zip(*parts)])


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops (and the C kernels, which take torch's thread count) on one thread: a step
    of a few tokens is hundreds of tiny ops, which threads only slow down (20x on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def decode_step(model: HybridLM, tokens: torch.Tensor, state: list[dict]) -> Piece:
    """One decoding step: ``tokens [B, 1]`` (each sequence's newest base) from ``state``
    (extended) -> its logits ``[B, 1, 4]`` and routing, untiled on one thread (fp32 round-off
    from a full pass, :class:`~megabase.model.context.Context`'s ``untiled``)."""
    with one_thread():
        logits, _, routing = _run(model, tokens, state, None, model.context(untiled=True))
    return Piece(logits, routing)


def fork(state: list[dict]) -> list[dict]:
    """A copy of a streaming state to continue two ways (entries are replaced, never mutated)."""
    return [dict(layer) for layer in state]


def repeat_state(state: list[dict], times: int) -> list[dict]:
    """A state of ``B`` sequences as one of ``B * times``: row ``b`` continues as rows
    ``b * times .. (b + 1) * times - 1`` (a prompt read once, then sampled ``times`` ways). Each
    row owns its copy: the KDA states and DSA caches of a prompt of ``P`` tokens take ``times``
    as much memory as the prompt's own (:func:`state_bytes`)."""
    return [{key: value.repeat_interleave(times, 0) for key, value in layer.items()
             if isinstance(value, torch.Tensor)} for layer in state]


def state_bytes(state: list[dict]) -> int:
    """Bytes a streaming state's tensors hold (views of a cache's buffer count their own rows)."""
    return sum(v.numel() * v.element_size() for layer in state for v in layer.values()
               if isinstance(v, torch.Tensor))


@torch.no_grad()
def stream(model: HybridLM, inputs: torch.Tensor, segment: int | Sequence[int],
           layer: int | None = None, ctx: Context | None = None,
           between: Callable[[list[dict]], None] | None = None,
           ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yields ``(start, logits [B, n, 4] fp32, hidden [B, n, d] or None)`` for consecutive pieces of
    ``inputs [B, T]`` (``segment``: a length, or lengths summing to ``T``): the next-base logits
    over A/C/G/T at positions ``start .. start + n``, and with ``layer`` (1..n_layers) the residual
    stream after that block, as one full pass would give them. ``between``: called with the state
    after each piece that ends on a row tile (its whole state committed), before the next one: an
    ablation cuts it there (:mod:`megabase.eval.ablate`)."""
    state, committed, start = model.init_state(), 0, 0
    for n in segments(inputs.shape[1], segment):
        end = start + n
        boundary = committed + (end - committed) // ROW_TILE * ROW_TILE
        parts = []
        if boundary > committed:
            parts.append(advance(model, inputs[:, committed:boundary], state, layer, ctx))
        if end > boundary:
            parts.append(advance(model, inputs[:, boundary:end], fork(state), layer, ctx))
        logits = torch.cat([p[0] for p in parts], dim=1)[:, start - committed :]
        hidden = None if layer is None else torch.cat([p[1] for p in parts], dim=1)[:, start - committed :]
        yield start, logits, hidden
        committed, start = boundary, end
        if between is not None and boundary == end:
            between(state)


@torch.no_grad()
def log_probs(model: HybridLM, tokens: torch.Tensor, segment: int | Sequence[int] | None = None,
              ctx: Context | None = None, between: Callable[[list[dict]], None] | None = None):
    """``log p(tokens[:, t+1] | tokens[:, :t+1])`` for every t: ``[B, T-1]`` fp32.

    With ``segment`` (a length, or a list of lengths summing to ``T-1``) the sequence is scored
    piece by piece (:func:`stream`), with the full pass's numbers. ``ctx``: how the calls run;
    ``between``: :func:`stream`'s.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if segment is None:
        return -model(inputs, targets, ctx=ctx).nll
    parts = []
    for start, logits, _ in stream(model, inputs, segment, ctx=ctx, between=between):
        target = targets[:, start : start + logits.shape[1]].long().clamp(max=logits.shape[-1] - 1)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                              reduction="none")
        parts.append(-nll.reshape(target.shape))
    return torch.cat(parts, dim=1)


def segments(total: int, segment: int | Sequence[int]) -> list[int]:
    """Piece lengths: ``segment`` at a time, or the given lengths (checked to sum to ``total``)."""
    if isinstance(segment, int):
        if segment < 1:
            raise ValueError(f"segment must be positive, got {segment}")
        return [min(segment, total - s) for s in range(0, total, segment)]
    lengths = [int(n) for n in segment]
    if sum(lengths) != total or min(lengths, default=1) < 1:
        raise ValueError(f"segment lengths must be positive and sum to {total}, got {lengths}")
    return lengths
