"""The hybrid language model over the nucleotide vocabulary (streaming it: :mod:`.stream`).

Reads top to bottom: a block is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``; the LM embeds
tokens, runs the blocks, and scores next-base targets in chunks. It is single-device and plain:
recompute and offload are applied to it from :mod:`megabase.pipeline.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megabase.core.vocab import N_BASES
from megabase.kernels.dsa import seed_keys

from .attention import AttentionLayer
from .cache import extend
from .config import ModelConfig
from .context import Context
from .dsa import DSALayer
from .kda import KDALayer
from .kmer import KmerEmbedding
from .layers import Linear, RMSNorm, SwiGLU, tiled_matmul
from .moe import MoE
from .sequence import ONE_PROCESS


class Block(nn.Module):
    """``(x [B, T, d], ctx) -> (x, aux_loss, report)``: ``report`` holds what the layers return
    beside their output: ``load`` (the MoE's routing stats ``[E, 1 + N_MARGIN_BINS]``), ``routing``
    (its ``(used, own)`` experts ``[B, T, k]``) and ``indexer_kl`` (a DSA layer's, training only),
    each None where it does not apply."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.kind = cfg.mixer_kind(index)
        self.norm1, self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = {"dsa": DSALayer, "kda": KDALayer, "attention": AttentionLayer}[self.kind](cfg)
        self.ffn = MoE(cfg) if cfg.is_moe(index) else SwiGLU(cfg.d_model, cfg.dense_dim)
        self.n_experts = cfg.n_experts

    def forward(self, x: torch.Tensor, ctx: Context):
        h, aux, kl = self.mixer(self.norm1(x), ctx)
        x = x + h
        report = {"load": None, "routing": None, "indexer_kl": kl}
        if isinstance(self.ffn, MoE):
            y, moe_aux, report["load"], report["routing"] = self.ffn(self.norm2(x), ctx)
            return x + y, aux + moe_aux, report
        return x + self.ffn(self.norm2(x), ctx.untiled), aux, report


@dataclass
class LMOutput:
    """``loss``: mean NLL over scored targets + auxiliary losses (None without targets).
    ``nll [B, T]`` (fp32, detached) for every target, scored or not; ``mask [B, T]``: scored
    targets (A/C/G/T and the caller's loss mask); ``aux_loss``: indexer KL + MoE balance;
    ``expert_load [n_moe_layers, E]``: routed tokens per expert; ``expert_margins
    [n_moe_layers, E, N_MARGIN_BINS]``: histograms of routing margins (see ``MoE.margins``);
    ``n_tokens``: scored targets; ``logits [B, T, 4]`` (over A/C/G/T) only when called without
    targets; ``routing``, ``router_choice``: per MoE layer the experts each token went to and the
    router's own top k (``[B, T, k]`` uint8; they differ only under routing replay);
    ``indexer_kl [n_dsa_layers]``: each DSA layer's indexer KL (detached) from a training forward,
    else None."""

    loss: torch.Tensor | None
    lm_loss: torch.Tensor | None
    nll: torch.Tensor | None
    mask: torch.Tensor | None
    aux_loss: torch.Tensor
    expert_load: torch.Tensor
    n_tokens: int
    logits: torch.Tensor | None = None
    expert_margins: torch.Tensor | None = None
    routing: list[torch.Tensor] | None = None
    router_choice: list[torch.Tensor] | None = None
    indexer_kl: torch.Tensor | None = None


class HybridLM(nn.Module):
    """KDA / DSA / MoE stack over ``vocab_size`` tokens; ``input_ids [B, T]`` uint8 or int64."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.kmers = KmerEmbedding(cfg.kmer_embed, cfg.d_model) if cfg.kmer_embed >= 2 else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # the head scores the four bases only: targets that are not A/C/G/T never count in a loss,
        # and a softmax over the specials too wasted the first steps learning never to predict them
        self.head = None if cfg.tie_embeddings else Linear(cfg.d_model, N_BASES)
        # where the sequence lives unless a call says otherwise: apply_context_parallel sets a
        # context group here, as the recompute and offload knobs wrap blocks (torchtitan's order)
        self.sequence = ONE_PROCESS
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        if self.head is not None:
            nn.init.zeros_(self.head.weight)  # starts at the uniform distribution, 2 bits/base

    def init_state(self) -> list[dict]:
        """Empty streaming state: one dict per layer (KDA state + conv tail, DSA key caches), then
        one for the input (the last tokens, which the k-mer embedding reads)."""
        return [{} for _ in self.blocks] + [{}]

    def context(self, **fields) -> Context:
        """A :class:`~megabase.model.context.Context` for a call of this model (on the model's
        sequence unless ``fields`` name another)."""
        return Context(**({"sequence": self.sequence} | fields))

    def embed_tokens(self, input_ids: torch.Tensor, state: dict | None = None,
                     sequence=ONE_PROCESS) -> torch.Tensor:
        """``[B, T]`` tokens -> ``[B, T, d]``: the token embedding plus, with ``kmer_embed``, the
        embeddings of the exact k-mers ending at each position (their tokens before the piece are
        carried in ``state``)."""
        x = self.embed(input_ids.long())
        if self.kmers is None:
            return x
        if state is None:  # the tokens before this shard, if the sequence is sharded
            tail = sequence.before(input_ids, self.kmers.n - 1)
        else:
            sequence.check_streaming()
            tail = state.get("ids")
            state["ids"] = self.kmers.tail(input_ids, tail)
        return x + self.kmers(input_ids, tail).to(x.dtype)

    def seed_keys(self, input_ids: torch.Tensor, state: dict | None = None, sequence=ONE_PROCESS):
        """The DSA candidate stage's seeds of these queries ``[B, T, S]``, shared by every DSA
        layer (None where no query reaches the stage, or where the pass does not select). They
        read every token before a query: a streamed sequence keeps its tokens in ``state``, a
        sharded one gathers them."""
        stage = self.cfg.stage()
        if stage is None or not stage.seed or "D" not in self.cfg.layer_kinds \
                or not sequence.selects():
            return None
        T = input_ids.shape[1]
        if state is None:
            offset, tokens = sequence.offset(T), sequence.prefix_tokens(input_ids)
        else:
            offset = 0 if "tokens" not in state else state["tokens"].shape[1]
            tokens = extend(state, "tokens", input_ids.to(torch.uint8))
        if offset + T <= stage.first_staged():
            return None
        return seed_keys(tokens, offset, stage)

    def _logits(self, h: torch.Tensor, untiled: bool = False) -> torch.Tensor:
        """Final norm and (tied or untied) head: ``[B, T, d] -> [B, T, 4]`` fp32, over A/C/G/T."""
        weight = self.embed.weight[:N_BASES] if self.head is None else self.head.weight
        return tiled_matmul(self.norm(h), weight, untiled).float()

    def _nll(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-target NLL ``[B, T]``; a target that is not a base gets a meaningless finite value
        (the caller's mask drops it)."""
        logits = self._logits(h)
        targets = targets.long().clamp(max=N_BASES - 1)
        nll = F.cross_entropy(logits.reshape(-1, N_BASES), targets.reshape(-1), reduction="none")
        return nll.reshape(targets.shape)

    def forward(self, input_ids, targets=None, loss_mask=None, state: list[dict] | None = None,
                ctx: Context | None = None) -> LMOutput:
        """``input_ids [B, T]``; ``targets``, ``loss_mask [B, T]`` to score; ``state``: the
        streaming state (:meth:`init_state`) to continue from and extend; ``ctx``: how the call
        runs (:meth:`context`; the model's sequence, tiled, no replay by default)."""
        ctx = self.context() if ctx is None else ctx
        tail = None if state is None else state[-1]
        x = self.embed_tokens(input_ids, tail, ctx.sequence)
        seeds = self.seed_keys(input_ids, tail, ctx.sequence)
        aux = x.new_zeros((), dtype=torch.float)
        loads, used, own, kls = [], [], [], []
        for i, block in enumerate(self.blocks):
            layer_ctx = ctx.layer(i, None if state is None else state[i], input_ids, seeds,
                                  moe_index=len(loads) if isinstance(block.ffn, MoE) else None,
                                  dsa_index=len(kls) if block.kind == "dsa" else None)
            x, block_aux, report = block(x, layer_ctx)
            aux = aux + block_aux
            if report["load"] is not None:
                loads.append(report["load"])
                used.append(report["routing"][0])
                own.append(report["routing"][1])
            if block.kind == "dsa":
                kls.append(report["indexer_kl"])
        stats = torch.stack(loads) if loads else x.new_zeros(0, self.cfg.n_experts, 1)
        expert_load, margins = stats[..., 0], stats[..., 1:]
        kl = torch.stack(kls).float() if kls and all(k is not None for k in kls) else None
        reports = {"expert_margins": margins, "routing": used, "router_choice": own,
                   "indexer_kl": kl}
        if targets is None:
            return LMOutput(None, None, None, None, aux, expert_load, 0,
                            self._logits(x, ctx.untiled), **reports)
        nll = self._chunked_nll(x, targets)
        mask = targets.long() < N_BASES
        if loss_mask is not None:
            mask = mask & loss_mask.bool()
        n = int(mask.sum())
        lm_loss = (nll * mask).sum() / max(n, 1)
        return LMOutput(lm_loss + aux, lm_loss, nll.detach(), mask, aux, expert_load, n, **reports)

    def _chunked_nll(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token NLL ``[B, T]``; ``loss_chunk`` tokens at a time, checkpointed under autograd."""
        chunk = self.cfg.loss_chunk
        T = x.shape[1]
        if T <= chunk:
            return self._nll(x, targets)
        parts = []
        for s in range(0, T, chunk):
            args = (x[:, s : s + chunk], targets[:, s : s + chunk])
            parts.append(checkpoint(self._nll, *args, use_reentrant=False)
                         if torch.is_grad_enabled() else self._nll(*args))
        return torch.cat(parts, dim=1)

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoE)]

    def update_moe_bias(self, expert_load: torch.Tensor,
                        expert_margins: torch.Tensor | None = None) -> None:
        """Apply the aux-loss-free bias update with ``expert_load [n_moe_layers, E]`` (and the
        margin histograms ``[n_moe_layers, E, N_MARGIN_BINS]`` of the same tokens)."""
        for i, (moe, load) in enumerate(zip(self.moe_layers(), expert_load)):
            moe.update_bias(load, None if expert_margins is None else expert_margins[i])
