"""Context parallelism: ``P`` ranks share one sequence, each holding a contiguous shard of it.

Applied to a built :class:`~megabase.model.HybridLM` from outside (before recompute and offload),
as torchtitan applies its parallelisms; parameter names do not change, so checkpoints are the same
at any world size. The layers keep their one forward: :class:`ContextParallel` is the
:mod:`megabase.model.sequence` interface (``before``, ``prefix``, ``kda``, ``balance``) done with
collectives, handed to every layer in each call's :class:`~megabase.model.context.Context`. Per layer kind:

* KDA: the recurrence ``S_t = A_t S_{t-1} + beta_t k_t v_t^T`` (``A_t = (I - beta_t k_t k_t^T)
  Diag(exp g_t)``) is affine in the state, so a shard maps its incoming state ``S`` to
  ``M S + C``. One pass from the state ``[0 | I]`` with values ``[v | 0]`` yields ``[C | M]`` (the
  columns of the state evolve independently); the ranks all-gather their ``[C | M]``, each folds
  the maps of the ranks before it into its exact incoming state and runs its shard from there.
  Rank 0 starts from zero, so it computes ``C`` alone; no one uses the last rank's map. The
  short conv's last ``kda_conv - 1`` inputs cross each border the same way.
* DSA: index keys, keys and values are all-gathered; each rank runs the indexer (queries at its
  offset, keys over the whole prefix), sparse attention and the sparse indexer KL as the
  streaming scorer does. The KL is scaled by the shard's share of the queries. The k-mer hash
  (``dsa_kmer``) reads the previous rank's last tokens, as the KDA conv reads its last inputs;
  so does the input's k-mer embedding (``kmer_embed``).
* MoE: routing stays local; the sequence-wise balance loss uses the sequence's global counts.

Every exchange is an all-gather whose backward all-reduces the gradient and keeps the rank's own
slice, so gradients flow to the rank that owns each activation. With per-rank objectives that sum
to the global loss (see :mod:`megabase.pipeline.distributed`), summing parameter gradients over the
group gives exactly the single-process gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megabase.kernels.kda import kda_chunk, kda_final_state
from megabase.model.sequence import OneProcess


@dataclass(frozen=True)
class ContextParallel(OneProcess):
    """This rank's place in a context-parallel group of ``size`` ranks (``group``: its process
    group; ``None`` is the default group). Every rank must run the same layers together: each
    step below is a collective."""

    rank: int
    size: int
    group: object = None

    def shard(self, length: int) -> tuple[int, int]:
        """``(start, end)`` of this rank's contiguous shard of a ``length``-token sequence."""
        if length % self.size:
            raise ValueError(f"a {length}-token sequence does not split into {self.size} equal "
                             "context-parallel shards")
        n = length // self.size
        return self.rank * n, (self.rank + 1) * n

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank, stacked: ``[P, *x.shape]``; differentiable (see module docs)."""
        return _AllGather.apply(x.contiguous(), self)

    def before(self, x: torch.Tensor, n: int) -> torch.Tensor | None:
        """The previous rank's last ``n`` rows of ``x [B, T, ...]``; on rank 0 zeros (``None`` for
        tokens, which the layers pad). Differentiable for floating ``x``."""
        if n == 0:
            return None
        last = x[:, x.shape[1] - n :]
        if not x.is_floating_point():
            every = self.gather(last.long())
            return None if self.rank == 0 else every[self.rank - 1]
        every = self.gather(last)
        # through the gathered tensor on every rank, rank 0 included, so all ranks join its backward
        return torch.cat([torch.zeros_like(every[:1]), every[:-1]])[self.rank]

    def prefix(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``x [B, T, ...]`` preceded by the same tensor of every earlier rank: ``[B, (rank + 1)
        * T, ...]``. One exchange for all of them; each rank's own slice is used by it and by every
        later rank, so its gradient is the sum of those uses."""
        shapes = [x.shape[2:] for x in xs]
        every = self.gather(torch.cat([x.flatten(2) for x in xs], dim=-1))
        prefix = every[: self.rank + 1].transpose(0, 1).flatten(1, 2)
        parts = prefix.split([x[0, 0].numel() for x in xs], dim=-1)
        return tuple(p.unflatten(-1, shape) for p, shape in zip(parts, shapes))

    def prefix_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` preceded by the tokens of every earlier rank: ``[B, (rank + 1) * T]``."""
        return self.gather(ids)[: self.rank + 1].transpose(0, 1).flatten(1)

    def kda(self, q, k, v, g, beta, initial_state=None, output_final_state=False, backend="auto"):
        """The KDA op over the sharded sequence (see :func:`kda_context_parallel`):
        ``initial_state`` enters the group's sequence (rank 0's; a walked window's segment starts
        from the one before it), ``output_final_state`` gives each rank the state at its shard's
        end."""
        return kda_context_parallel(q, k, v, g, beta, self, backend, initial_state,
                                    output_final_state)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return summed(x, self.group)

    def balance(self, loss, load: torch.Tensor, share: torch.Tensor, length: int) -> torch.Tensor:
        """The balance loss with the sequence's counts (summed over the group, no gradient)."""
        return loss(summed(load, self.group), share, length * self.size)

    def fraction(self, length: int) -> float:
        return 1.0 / self.size


def summed(x: torch.Tensor, group=None) -> torch.Tensor:
    """A detached copy of ``x`` summed over ``group`` (the default group: every rank)."""
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the buffer
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad[ctx.cp.rank], None


def kda_context_parallel(q, k, v, g, beta, cp: ContextParallel, backend: str = "auto",
                         initial_state=None, output_final_state: bool = False):
    """KDA over a sequence sharded across ``cp``: this rank's ``(q, k [B,T,H,K], v [B,T,HV,V],
    g [B,T,HV,K], beta [B,T,HV])`` -> ``(o [B, T, HV, V], final state or None)``, equal to the
    matching rows of a single-process pass over the whole sequence from ``initial_state`` (read
    on rank 0; None: zeros). All ranks must call it together."""
    K, V = q.shape[-1], v.shape[-1]
    start = initial_state if cp.rank == 0 else None
    maps = _shard_map(q, k, v, g, beta, cp, backend, start)
    # folded in fp64: an fp32 fold rounds the incoming state differently from a sequential pass,
    # enough to flip a near-tied DSA top-k choice downstream (measured: one query in 16k at P=4)
    every = cp.gather(maps.double())  # [P, B, HV, K, V + K]: each rank's [C | M]
    states = [torch.zeros_like(every[0, ..., :V])]
    for i in range(cp.size - 1):
        C, M = every[i].split([V, K], dim=-1)
        states.append(M @ states[-1] + C)
    # through the stack on every rank (rank 0's row is zeros), so all ranks join its backward
    incoming = torch.stack(states)[cp.rank]  # fp64: the C kernel carries its state in fp64
    if start is not None:
        incoming = incoming + start
    return kda_chunk(q, k, v, g, beta, initial_state=incoming,
                     output_final_state=output_final_state, backend=backend)


def _shard_map(q, k, v, g, beta, cp: ContextParallel, backend: str,
               initial_state=None) -> torch.Tensor:
    """This shard's ``[C | M]`` (``[B, HV, K, V + K]``, the KDA op's state dtype), as far as later
    ranks use it: rank 0 starts from ``initial_state`` (None: zero), so its ``M`` is never used
    (only ``C``, a pass at the values' width from that state); the last rank's map is used by no
    one (zeros)."""
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cp.rank == cp.size - 1:
        zeros = q.new_zeros(B, HV, K, V + K, dtype=torch.float)
        if not (torch.is_grad_enabled() and q.requires_grad):
            return zeros
        # tied to q with weight zero, so that this rank's backward reaches the exchange's (a
        # collective) however it is asked: backward(), or autograd.grad over the parameters (a
        # walked window's, which would skip a fresh leaf)
        return zeros + 0.0 * q.float().sum()
    if cp.rank == 0:
        start, values = initial_state, v
    else:
        eye = torch.eye(K, device=q.device).expand(B, HV, K, K)
        start = torch.cat([eye.new_zeros(B, HV, K, V), eye], dim=-1)
        values = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
    args = (q, k, values, g, beta, None, start, backend)
    # checkpointed: its intermediates are rebuilt when its gradient is due, after the main pass's
    # backward has freed theirs, so the two passes never hold their activations at once
    state = checkpoint(kda_final_state, *args, use_reentrant=False) if torch.is_grad_enabled() \
        else kda_final_state(*args)
    if cp.rank == 0:
        state = torch.cat([state, state.new_zeros(B, HV, K, K)], dim=-1)
    return state


def apply_context_parallel(model: torch.nn.Module, cp: ContextParallel | None) -> torch.nn.Module:
    """Make every layer of ``model`` (a HybridLM) run its shard of a sequence split across ``cp``.

    Apply before :func:`~megabase.pipeline.memory.apply_recompute`. The model's forward then takes
    this rank's shard ``[B, T / P]`` (see :meth:`ContextParallel.shard`); the DSA layers must be in
    the sparse indexer mode (the dense warm-up attends over whole rows).
    """
    if cp is None or cp.size == 1:
        return model
    if model.cfg.mixer != "hybrid":
        raise ValueError("context parallelism runs the hybrid KDA / DSA model; "
                         f"model.mixer={model.cfg.mixer!r} is not supported")
    if model.cfg.indexer_mode != "sparse" and any(b.kind == "dsa" for b in model.blocks):
        raise ValueError("context parallelism needs model.indexer_mode=sparse (the dense indexer "
                         "warm-up is single-process)")
    model.sequence = cp  # the model's calls then hand it to every layer in their Context
    return model
