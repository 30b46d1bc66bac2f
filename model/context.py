"""The per-call context: everything that decides how one forward pass runs, handed to every layer.

A layer's behaviour depends on its weights, its input and this object, nothing else: no flag is set
on a layer from outside, and no thread-local switches a code path. :class:`HybridLM` takes a
:class:`Context` per call (``HybridLM.context(...)`` fills in the model's sequence) and hands each
layer the context narrowed to it (:meth:`Context.layer`): its own streaming state, the experts to
replay in it, its selection sink. What a layer has to report goes back in its return value (the MoE
layer's expert choices, the DSA layer's indexer KL), never into an attribute.

Fields the caller sets, per call:

* ``sequence``: where the sequence lives, whole (:data:`~megabase.model.sequence.ONE_PROCESS`) or a
  shard of a context group (:mod:`megabase.pipeline.context_parallel`);
* ``untiled``: products on the rows given, not canonical tiles (a decoding step, see layers.py);
* ``dense_warmup``: DSA layers attend densely and train their indexer toward it (the trainer's
  warm-up steps), whatever ``indexer_mode`` says;
* ``train_indexer``: DSA layers compute their indexer KL even without autograd (a walked training
  window's forward, :mod:`megabase.model.walk`, reports it before its backward);
* ``replay``: per MoE layer, the experts ``[B, T, k]`` to use instead of the router's choice (RL
  routing replay), with ``follow_replay`` False to route freely and only compare;
* ``capture``: per DSA layer, a :class:`~megabase.model.dsa.SelectionCapture` that records the
  top-k selections of a range of queries (diagnostics: the recall probe).

Fields :meth:`layer` fills in for one layer: ``sequence`` narrowed to it (``sequence.layer(i)``),
``state`` (its streaming state dict, or None for a full pass), ``tokens [B, T]`` and ``seeds [B, T, S]`` (the DSA layers' k-mer hash and candidate
stage read them), ``experts`` (its row of ``replay``) and ``selections`` (its row of ``capture``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .sequence import ONE_PROCESS, OneProcess


@dataclass(frozen=True)
class Context:
    """How one forward call runs (see the module docs). Immutable: narrowing makes a copy."""

    sequence: OneProcess = ONE_PROCESS
    untiled: bool = False
    dense_warmup: bool = False
    train_indexer: bool = False
    replay: Sequence[torch.Tensor] | None = None
    follow_replay: bool = True
    capture: Sequence[Any] | None = None
    state: dict | None = None
    tokens: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    experts: torch.Tensor | None = None
    selections: Any = None

    def layer(self, index: int, state: dict | None, tokens: torch.Tensor | None = None,
              seeds: torch.Tensor | None = None, moe_index: int | None = None,
              dsa_index: int | None = None) -> "Context":
        """This context narrowed to layer ``index``: its sequence view and ``state``, the pass's
        ``tokens`` and ``seeds``, and, for the ``moe_index``-th MoE layer / ``dsa_index``-th DSA
        layer, its entry of ``replay`` / ``capture``."""
        experts = None
        if self.replay is not None and moe_index is not None:
            if moe_index >= len(self.replay):
                raise ValueError(f"routing replay holds {len(self.replay)} MoE layers, the model "
                                 "has more")
            experts = self.replay[moe_index]
        selections = None
        if self.capture is not None and dsa_index is not None:
            selections = self.capture[dsa_index]
        return replace(self, sequence=self.sequence.layer(index), state=state, tokens=tokens,
                       seeds=seeds, experts=experts, selections=selections)


DEFAULT = Context()
