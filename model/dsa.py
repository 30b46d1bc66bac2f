"""The DeepSeek Sparse Attention mixer (DESIGN.md, Model): lightning indexer, top-k, sparse softmax."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megabase.kernels.dsa import (
    dsa_indexer_op,
    indexer_kl_dense,
    indexer_kl_sparse,
    sparse_attention,
)

from megabase.core.vocab import PAD

from .cache import extend
from .config import ModelConfig
from .context import DEFAULT, Context
from .layers import HeadProjections, Linear, RMSNorm


def _call(fn):
    return fn()


class DSALayer(HeadProjections):
    """``[B, T, d] -> [B, T, d]``: each token attends to ``topk`` earlier tokens chosen by an indexer.

    Main attention: ``dsa_heads`` query heads over ``dsa_kv_heads`` key/value heads (GQA) with
    QK-RMSNorm and no positional encoding. Indexer: ``index_heads`` queries of ``index_dim``, one
    shared index key per token, per-head weights; it reads a detached copy of the layer input, so it
    learns only from its KL loss (``indexer_mode``: ``dense`` warm-up against full causal attention,
    or ``sparse`` on the selected set), returned as the auxiliary loss while training.

    With ``dsa_kmer = n > 0`` queries, keys and the indexer also read the recent bases directly: a
    learned hash of the last ``n`` tokens (:class:`KmerHash`, a sum of per-offset token
    embeddings) is added to their projections, the query's over the ``n`` tokens up to its own,
    the key's over the ``n`` before its own. In a repeat, a query's hash then equals that of the
    key right after the aligned base of the earlier copy, whose value is the base to predict: a
    copying (induction) head needs only to compare hashes, and a mutation costs one offset's share
    of the match, not all of it. The residual stream alone did not give this: at the first DSA
    layer of a trained cpu-small, the aligned position ranks ~150th of 4,000 by cosine similarity.
    The layer starts as such a head (:meth:`init_copying`), and the index weights get a learnable
    per-head offset ``wi_bias`` (starting at 1) so that every index head starts by voting for its
    matches; training is free to make it anything else.

    With ``dsa_gate`` each query head's output is scaled by ``2 sigmoid(w_h . x)``, a gate read
    from the layer input ``x`` (the head-wise output gate of gated attention), ``w`` zero at the
    start so that the gate is open (1) and the layer computes what it did without one. A head
    whose selections hold nothing to copy still spends all of its softmax on them; the gate
    lets the layer close the head where that happens (docs/science.md §14: on unique sequence a
    megabase back, the selected far keys cost the 16k model).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d = cfg.d_model
        self.qi_proj = Linear(d, cfg.index_heads * cfg.index_dim)
        self.ki_proj = Linear(d, cfg.index_dim)
        self.ki_norm = RMSNorm(cfg.index_dim, cfg.norm_eps)
        self.wi_proj = Linear(d, cfg.index_heads)
        self.output_projection()
        self.kmer = None
        self.wi_bias = None
        if cfg.dsa_kmer:
            self.kmer = KmerHash(cfg.dsa_kmer, cfg.vocab_size,
                                 query=self.HQ * self.D + cfg.index_heads * cfg.index_dim,
                                 key=self.H * self.D + cfg.index_dim)
            self.wi_bias = nn.Parameter(torch.ones(cfg.index_heads))
            self.init_copying()
        self.stage = cfg.stage()  # the indexer's candidate stage, or None: the exact scan
        self.gate_proj = None
        if cfg.dsa_gate:
            with torch.random.fork_rng(devices=[]):  # every other weight drawn as without a gate
                self.gate_proj = Linear(d, self.HQ)
            nn.init.zeros_(self.gate_proj.weight)

    def forward(self, x: torch.Tensor, ctx: Context = DEFAULT):
        """Returns ``(y, aux_loss, indexer KL)``, the KL (detached, a scalar) only from a training
        forward; with ``ctx.state`` it attends over cached keys and extends the cache. From
        ``ctx``: ``tokens [B, T]`` (needed with ``dsa_kmer``), ``seeds [B, T, S]`` (the candidate
        stage's seed keys of these queries, :func:`megabase.kernels.dsa.seed_keys`, computed once
        per pass by the LM), ``dense_warmup`` and ``selections`` (a :class:`SelectionCapture`)."""
        B, T, _ = x.shape
        seq, state, ids, u = ctx.sequence, ctx.state, ctx.tokens, ctx.untiled
        if state is not None:
            seq.check_streaming()
            tail = state.get("ids")
        elif self.kmer is not None:  # the tokens before this shard: the k-mer hash's border
            tail = seq.before(ids, self.kmer.n)
        else:
            tail = None
        q, k, v, qi, ki, wi = self.project(x, ids, tail, u)
        if state is not None and self.kmer is not None:
            state["ids"] = self.kmer.tail(ids, state.get("ids"))
        offset = seq.offset(T)
        if state is not None:
            offset = state["k"].shape[1] if "k" in state else offset
            k, v, ki = (extend(state, n, t) for n, t in (("k", k), ("v", v), ("ki", ki)))
        if (self.cfg.indexer_mode == "dense" or ctx.dense_warmup) and state is None:
            o, kl = self.attend_dense(q, k, v, qi, ki, wi, self._train_indexer(ctx))
        else:
            k, v, ki = seq.prefix(k, v, ki)  # keys of the shards before this one too
            o, kl = self.attend(q, k, v, qi, ki, wi, offset, ctx.seeds, ctx.selections,
                                self._train_indexer(ctx), seq.key_grads(), seq.select)
        if self.gate_proj is not None:
            o = o * (2 * torch.sigmoid(self.gate_proj(x, u)))[..., None].to(o.dtype)
        y = self.o_proj(o.reshape(B, T, self.HQ * self.D), u)
        if kl is None:
            return y, x.new_zeros((), dtype=torch.float), None
        # the indexer KL is a mean over queries: a shard or segment holds a fraction of them
        return y, self.cfg.indexer_loss_weight * kl * seq.fraction(T), kl.detach()

    @torch.no_grad()
    def init_copying(self) -> None:
        """Start as a copying head: the first query head of each key group projects (residual
        stream and k-mer hash) as its key does, and so does the first index head; their hashes are
        then equal exactly where a key follows a copy of the query's recent bases."""
        D, ID, rep = self.D, self.cfg.index_dim, self.HQ // self.H
        hq, hk = self.kmer.query_table, self.kmer.key_table  # [n, vocab, channels]
        q_rows, k_rows = self.q_proj.weight, self.kv_proj.weight[: self.H * D]
        for h in range(self.H):
            g = h * rep
            q_rows[g * D : (g + 1) * D] = k_rows[h * D : (h + 1) * D]
            hq[..., g * D : (g + 1) * D] = hk[..., h * D : (h + 1) * D]
        iq = self.HQ * D  # the index channels follow the main ones in each table
        self.qi_proj.weight[:ID] = self.ki_proj.weight
        hq[..., iq : iq + ID] = hk[..., self.H * D :]

    def project(self, x: torch.Tensor, ids: torch.Tensor | None = None,
                tail: torch.Tensor | None = None, untiled: bool = False):
        """``x [B, T, d]`` (and its tokens ``ids [B, T]``, the ``dsa_kmer`` tokens before them in
        ``tail``) -> ``(q [B,T,HQ,D], k, v [B,T,H,D], q_idx [B,T,IH,ID], k_idx [B,T,ID],
        w_idx [B,T,IH])``; the indexer reads a detached ``x``."""
        cfg = self.cfg
        B, T, _ = x.shape
        u = untiled
        q, (k, v) = self.q_proj(x, u), self.kv_proj(x, u).reshape(B, T, 2, -1).unbind(2)
        xi = x.detach()
        qi, ki = self.qi_proj(xi, u), self.ki_proj(xi, u)
        if self.kmer is not None:
            if ids is None:
                raise ValueError("a DSA layer with dsa_kmer needs the token ids")
            hq, hk = self.kmer(ids, tail)
            main_q, main_k = self.HQ * self.D, self.H * self.D
            q, k = q + hq[..., :main_q], k + hk[..., :main_k]
            qi, ki = qi + hq[..., main_q:], ki + hk[..., main_k:]  # the indexer's own table
        q = self.q_norm(q.reshape(B, T, self.HQ, self.D))
        k, v = self.k_norm(k.reshape(B, T, self.H, self.D)), v.reshape(B, T, self.H, self.D)
        qi = qi.reshape(B, T, cfg.index_heads, cfg.index_dim)
        ki = self.ki_norm(ki)
        wi = self.wi_proj(xi, u)
        if self.wi_bias is not None:
            wi = wi + self.wi_bias
        return q, k, v, qi, ki, wi * cfg.index_heads**-0.5

    def _train_indexer(self, ctx: Context) -> bool:
        return ctx.train_indexer or (self.training and torch.is_grad_enabled())

    def attend(self, q, k, v, qi, ki, wi, offset: int = 0, seeds: torch.Tensor | None = None,
               selections: "SelectionCapture | None" = None, kl: bool = False,
               key_grads: tuple[torch.Tensor, ...] | None = None, select=_call):
        """Sparse attention of queries at positions ``offset..offset+Tq`` over keys ``0..Tk``:
        ``(o [B, Tq, HQ, D], the indexer's KL averaged over the queries, or None without
        ``kl``)``; ``selections`` records the top-k of the queries it covers. ``key_grads``: the
        buffers ``(dk, dv, dk_idx)`` the backward adds the keys' gradients into (a walk's), or
        None; ``select``: called with the indexer's call, returns the selections (the
        sequence's ``select``)."""
        cfg = self.cfg
        backend = cfg.dsa_backend
        stage = None if self.stage is None else self.stage.encode()
        idx = select(lambda: dsa_indexer_op(qi, ki, wi, cfg.topk, cfg.keep_recent, cfg.dsa_block,
                                             offset, backend, stage, seeds))
        if selections is not None:
            selections.add(idx, offset)
        sinks = (None, None) if key_grads is None else (key_grads[:2], key_grads[2:])
        if not kl:
            return sparse_attention(q, k, v, idx, block_q=cfg.dsa_block, backend=backend,
                                    key_grads=sinks[0]), None
        o, p = sparse_attention(q, k, v, idx, block_q=cfg.dsa_block, return_probs=True,
                                backend=backend, key_grads=sinks[0])
        return o, indexer_kl_sparse(qi, ki, wi, idx, p, backend=backend, key_grads=sinks[1])

    def attend_dense(self, q, k, v, qi, ki, wi, kl: bool = False):
        """The indexer warm-up: dense causal attention, the indexer trained toward its weights
        (its KL computed with ``kl``)."""
        rep = self.HQ // self.H
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
            v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
        if not kl:
            return o, None
        return o, indexer_kl_dense(q.detach(), k.detach(), qi, ki, wi, block_q=self.cfg.dsa_block)


class KmerHash(nn.Module):
    """A learned hash of recent tokens: ``sum_j E_j[ids[t - j]]`` over offsets ``j < n``.

    ``forward(ids [B, T], tail [B, n] or None)`` -> ``(query [B, T, query], key [B, T, key])``:
    the query side hashes the ``n`` tokens ending at ``t``, the key side the ``n`` ending at
    ``t - 1``. ``tail`` holds the ``n`` tokens before ``ids`` (``<pad>`` where there are none), so
    a streamed sequence hashes as its full pass does. Entries start ~N(0, 4 / n): a hash of std 2
    per channel, above the residual stream's projections (std ~0.6), so that matches dominate the
    first scores.
    """

    def __init__(self, n: int, vocab: int, query: int, key: int):
        super().__init__()
        self.n, self.split = n, query
        self.table = nn.Parameter(torch.randn(n, vocab, query + key) * (2.0 / n**0.5))

    @property
    def query_table(self) -> torch.Tensor:
        return self.table.data[..., : self.split]

    @property
    def key_table(self) -> torch.Tensor:
        return self.table.data[..., self.split :]

    def tail(self, ids: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        """The last ``n`` tokens of ``tail`` + ``ids``: the ``tail`` of the next piece."""
        return self._extended(ids, tail)[:, -self.n :]

    def _extended(self, ids: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        if tail is None:
            tail = torch.full((ids.shape[0], self.n), PAD, dtype=torch.long, device=ids.device)
        return torch.cat([tail.long(), ids.long()], dim=1)

    def forward(self, ids: torch.Tensor, tail: torch.Tensor | None = None):
        n, T = self.n, ids.shape[1]
        B, vocab = ids.shape[0], self.table.shape[1]
        ext = self._extended(ids, tail)  # ext[:, n + t] is ids[:, t]
        # row j * vocab + token of the flattened table; one bag of n rows per position (summed in
        # bag order, row by row: the same bits however the sequence is cut)
        offsets = torch.arange(n, device=ids.device) * vocab
        windows = ext.unfold(1, n, 1)  # [B, T + 1, n]: windows[:, i] = ext[:, i : i + n]
        rows = windows.flip(-1) + offsets  # offset j holds the token j positions back
        table = self.table.reshape(n * vocab, -1)
        query = F.embedding_bag(rows[:, 1:].reshape(-1, n), table[:, : self.split], mode="sum")
        key = F.embedding_bag(rows[:, :-1].reshape(-1, n), table[:, self.split :], mode="sum")
        return query.reshape(B, T, -1), key.reshape(B, T, -1)


class SelectionCapture:
    """The top-k selections of one DSA layer for the queries at positions ``[lo, hi)`` of the first
    sequence of a batch: ``rows [hi - lo, topk]`` (key positions, -1 padded), filled as the layer
    runs, also when a sequence is streamed piece by piece."""

    def __init__(self, lo: int, hi: int, topk: int):
        self.lo, self.hi = lo, hi
        self.rows = np.full((hi - lo, topk), -1, dtype=np.int64)
        self.seen = np.zeros(hi - lo, dtype=bool)

    def add(self, idx: torch.Tensor, offset: int) -> None:
        a, b = max(self.lo, offset), min(self.hi, offset + idx.shape[1])
        if a < b:
            self.rows[a - self.lo : b - self.lo] = idx[0, a - offset : b - offset].cpu().numpy()
            self.seen[a - self.lo : b - self.lo] = True


def capture_selections(model, lo: int, hi: int) -> list[SelectionCapture]:
    """One empty :class:`SelectionCapture` per DSA layer of ``model`` (in layer order) for query
    positions ``[lo, hi)``: pass them as ``Context.capture`` and they fill as the layers run."""
    return [SelectionCapture(lo, hi, block.mixer.cfg.topk) for block in model.blocks
            if isinstance(block.mixer, DSALayer)]
