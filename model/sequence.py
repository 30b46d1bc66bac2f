"""Where a layer's sequence lives: whole in this process, or sharded across a context group.

A layer's forward is the same either way. The steps that differ are the ones that cross a shard's
border, and each layer calls them on its call's ``Context.sequence``:

* ``before(x, n)``: the ``n`` rows just before this shard (the short conv's and the k-mer hashes'
  inputs); ``None`` at the start of the sequence, where the layer pads.
* ``prefix(*xs)``: keys of every shard up to and including this one (the DSA layer's keys and
  values), with ``offset``, the position of this shard's first row; ``prefix_tokens(ids)`` the
  same for tokens (the DSA candidate stage's seeds read them); ``key_grads()``: where the kernels
  add the gradients of the keys ``prefix`` returned (None: autograd carries them back);
  ``select(indexer)``: the DSA indexer's top-k of this part's queries (a walk runs the indexer
  once per segment, in its forward, and keeps what it chose for the backward), ``selects()``
  whether this pass runs it (the candidate stage's seeds are built only then).
* ``kda(...)``: the KDA op over the whole sequence.
* ``balance(loss, load, share, T)``: the MoE sequence-wise balance loss of the whole sequence from
  this part's counts and scores; ``fraction(T)``: this part's share of the sequence's queries (the
  indexer KL is a mean over them).
* ``layer(i)``: the interface as layer ``i`` sees it (its calls are told apart by layer);
* ``gather(x)``, ``reduce(x)``: ``x`` of every rank of the group, stacked, and summed (the walk
  shares each segment across a context group with them).

:data:`ONE_PROCESS` makes them identities; :class:`megabase.pipeline.context_parallel.ContextParallel`
implements them with collectives across ranks, :class:`megabase.model.walk.Segment` with what
earlier segments of a walked training window kept, and a model's context carries either to every
layer. So a change to a layer's forward runs sharded and walked as written, with nothing to
mirror.
"""

from __future__ import annotations

import torch

from megabase.kernels.kda import kda_chunk


class OneProcess:
    """The whole sequence in this process (the default of every layer)."""

    rank, size = 0, 1

    def before(self, x: torch.Tensor, n: int) -> torch.Tensor | None:
        """The ``n`` rows ``[B, n, ...]`` before this shard of ``x [B, T, ...]``: none here."""
        return None

    def prefix(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``x [B, T, ...]`` extended by the rows of the shards before it: ``[B, offset + T,
        ...]``. Here the shard is the sequence."""
        return xs

    def key_grads(self) -> tuple[torch.Tensor, ...] | None:
        """Buffers ``[B, >= offset + T, ...]``, one per tensor the last ``prefix`` call returned,
        into which the backward adds their gradients (the kernels' ``key_grads``), or None: the
        kernels return them through autograd, as here."""
        return None

    def selects(self) -> bool:
        """Whether this pass runs the indexer (a walk's backward pass takes its forward's
        selections: the candidate stage's seeds are then not built)."""
        return True

    def select(self, indexer) -> torch.Tensor:
        """The selections ``[B, T, topk]`` of this part's queries: ``indexer()``, the call that
        computes them."""
        return indexer()

    def prefix_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` of this shard preceded by those of every shard before it."""
        return ids

    def offset(self, length: int) -> int:
        """Position of this shard's first row, for shards of ``length`` rows."""
        return self.rank * length

    def kda(self, q, k, v, g, beta, initial_state=None, output_final_state=False, backend="auto"):
        """The KDA op (:func:`megabase.kernels.kda.kda_chunk`): ``(o [B, T, H, V], final state)``."""
        return kda_chunk(q, k, v, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, backend=backend)

    def balance(self, loss, load: torch.Tensor, share: torch.Tensor, length: int) -> torch.Tensor:
        """The sequence-wise balance loss ``loss(counts [E], share [E], T)`` of the whole sequence,
        from this part's routed counts ``load``, summed normalised scores ``share`` and length."""
        return loss(load, share, length)

    def fraction(self, length: int) -> float:
        """This part's share of the sequence's queries, for a part of ``length`` of them."""
        return 1.0

    def layer(self, index: int) -> "OneProcess":
        """The interface for layer ``index`` (the same object here)."""
        return self

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank of the group, stacked: ``[P, *x.shape]`` (here ``P = 1``)."""
        return x[None]

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A detached ``x`` summed over the group."""
        return x.detach()

    def check_streaming(self) -> None:
        """Streaming (a layer called with ``state``) carries the sequence in one process."""
        if self.size > 1:
            raise ValueError("streaming (state=...) is single-process; score with one rank")


ONE_PROCESS = OneProcess()
