"""Mixture-of-Experts FFN (DESIGN.md, Model): sigmoid router, balancing bias, shared expert, chunks."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megabase.kernels.moe import expert_swiglu
from megabase.kernels.pointwise import sigmoid

from .config import ModelConfig
from .context import DEFAULT, Context
from .layers import ROW_TILE, Linear, SwiGLU

EXPERT_TILE = 64  # an expert sees ~ROW_TILE * k / E rows of a group: small tiles waste less padding

# Edges of the routing-margin histogram (see MoE.margins): cubic spacing, ~4e-6 wide at 0 (where a
# layer whose scores barely vary from token to token keeps its margins) and 0.05 at +-1.
MARGIN_EDGES = torch.linspace(-1.0, 1.0, 129, dtype=torch.float64).pow(3).float()
N_MARGIN_BINS = len(MARGIN_EDGES) + 1  # and one open bin below -1 and above +1


def _dispatch(sel: torch.Tensor, E: int):
    """Rows of the per-expert products for routing ``sel [n, k]``.

    Rows go expert by expert; inside an expert, per aligned group of ``ROW_TILE`` tokens, each
    (expert, group) run padded to whole ``EXPERT_TILE``-row tiles. A token's place in its tile then
    depends only on the tokens before it in its group (canonical shapes, see layers.py), and its
    contributions are added in expert order. Returns ``(token [m], slot [m], tiles [E])``: the
    token and routing slot of each row (``token = -1`` on padding) and the tiles of each expert.
    """
    n, k = sel.shape
    device = sel.device
    groups = (n + ROW_TILE - 1) // ROW_TILE
    token = torch.arange(n, device=device).repeat_interleave(k)
    slot = torch.arange(k, device=device).repeat(n)
    run = sel.reshape(-1) * groups + token // ROW_TILE  # (expert, group) in dispatch order
    order = torch.sort(run * (n * k) + token * k + slot).indices
    token, slot, run = token[order], slot[order], run[order]
    counts = torch.bincount(run, minlength=E * groups)
    padded = (counts + EXPERT_TILE - 1) // EXPERT_TILE * EXPERT_TILE
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    where = starts[run] + torch.arange(run.numel(), device=device) - first[run]
    total = int(padded.sum())
    tok = torch.full((total,), -1, dtype=torch.long, device=device)
    slots = torch.zeros(total, dtype=torch.long, device=device)
    tok[where], slots[where] = token, slot
    tiles = (padded // EXPERT_TILE).reshape(E, groups).sum(1)
    return tok, slots, tiles


class MoE(nn.Module):
    """``[B, T, d] -> ([B, T, d], aux_loss, stats [E, 1 + N_MARGIN_BINS], (used, own))``.

    Router: ``s = sigmoid(x W_r)`` (fp32); each token takes the ``experts_per_token`` experts with
    the highest ``s + bias``; gates are the selected ``s`` normalised to sum 1, times
    ``routed_scale``. ``bias`` only steers selection and is moved by :meth:`update_bias`
    (aux-loss-free balancing); ``seq_aux_weight`` adds DeepSeek-V3's sequence-wise balance loss.
    One shared SwiGLU expert sees every token. Tokens run through in chunks of ``moe_chunk``
    (checkpointed under autograd), so expert activations never exist for the whole sequence.
    ``stats`` (no gradient), over the whole input: column 0 counts the tokens routed to each
    expert, the rest is each expert's histogram of routing margins (:meth:`margins`), which the
    ``quantile`` bias update solves for the bias that balances the load.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, E, h = cfg.d_model, cfg.n_experts, cfg.expert_dim
        self.cfg = cfg
        self.router = Linear(d, E)
        self.register_buffer("bias", torch.zeros(E))
        self.w13 = nn.Parameter(torch.randn(E, d, 2 * h) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, h, d) * h**-0.5)
        self.shared = SwiGLU(d, cfg.shared_expert_dim) if cfg.shared_expert_dim else None

    def _route(self, x: torch.Tensor, forced: torch.Tensor | None = None, untiled: bool = False):
        """``x [n, d]`` -> (scores [n, E] fp32, selected experts [n, k], gates [n, k], own choice
        [n, k]). ``forced [n, k]``: experts to use instead of the router's own top k (routing
        replay); the gates are still the router's scores of them, so the router keeps its
        gradient."""
        scores = sigmoid(self.router(x, untiled).float())
        own = (scores.detach() + self.bias).topk(self.cfg.experts_per_token, dim=-1).indices
        sel = own if forced is None else forced.long()
        gates = scores.gather(-1, sel)
        gates = gates / gates.sum(-1, keepdim=True) * self.cfg.routed_scale
        return scores, sel, gates, own

    def _chunk(self, x: torch.Tensor, forced: torch.Tensor | None = None, untiled: bool = False):
        """One chunk ``[n, d]`` -> (out [n, d], stats [E, 1 + N_MARGIN_BINS], normalised score sum
        [E], experts used [n, k], the router's own choice [n, k])."""
        E = self.cfg.n_experts
        scores, sel, gates, own = self._route(x, forced, untiled)
        out = self.shared(x, untiled) if self.shared is not None else torch.zeros_like(x)
        tok, slot, tiles = _dispatch(sel, E)
        if tok.numel():
            rows = tok.clamp(min=0)
            xt = x.index_select(0, rows).masked_fill((tok < 0)[:, None], 0.0)
            y = expert_swiglu(xt, self.w13.to(x.dtype), self.w2.to(x.dtype), tiles * EXPERT_TILE)
            keep = tok >= 0
            g = gates[rows[keep], slot[keep], None]
            out = out.index_add(0, rows[keep], (y[keep] * g.to(y.dtype)).to(out.dtype))
        load = torch.bincount(sel.flatten(), minlength=E).float()
        share = (scores / scores.sum(-1, keepdim=True)).sum(0)
        stats = torch.cat([load[:, None], self.margins(scores.detach(), sel)], 1)
        return out, stats, share, sel, own

    def margins(self, scores: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Histogram ``[E, N_MARGIN_BINS]`` over tokens of each expert's routing margin: how far its
        ``score + bias`` is above (selected) or below (not) the value it must beat to be among a
        token's top k (the (k+1)-th best of the token if selected, else the k-th). Raising the
        expert's bias by ``delta`` adds exactly the tokens with margin in ``(-delta, 0]``."""
        n, E = scores.shape
        k = self.cfg.experts_per_token
        hist = torch.zeros(E, N_MARGIN_BINS, device=scores.device)
        if k >= E or n == 0:
            return hist
        v = scores + self.bias
        top = v.topk(k + 1, dim=-1).values
        chosen = torch.zeros_like(v, dtype=torch.bool).scatter_(1, sel, True)
        m = v - torch.where(chosen, top[:, k : k + 1], top[:, k - 1 : k])
        m = torch.where(chosen, m.clamp_min(1e-12), m.clamp_max(0.0))  # ties: selection decides
        b = torch.bucketize(m, MARGIN_EDGES.to(m.device), right=True)
        flat = torch.arange(E, device=m.device) * N_MARGIN_BINS + b
        return torch.bincount(flat.reshape(-1), minlength=E * N_MARGIN_BINS).reshape(E, -1).float()

    def forward(self, x: torch.Tensor, ctx: Context = DEFAULT):
        B, T, d = x.shape
        E, k, chunk = self.cfg.n_experts, self.cfg.experts_per_token, self.cfg.moe_chunk
        forced = ctx.experts if ctx.follow_replay else None
        if forced is not None and (forced.shape[0] != B or forced.shape[1] != T):
            raise ValueError(f"routing replay: recorded experts {tuple(forced.shape)} for a "
                             f"[{B}, {T}] call")
        outs, aux = [], x.new_zeros((), dtype=torch.float)
        stats = torch.zeros(E, 1 + N_MARGIN_BINS, device=x.device)
        used, owns = [], []
        if ctx.untiled and not torch.is_grad_enabled() and B * T <= chunk:
            # a decoding step: the batch's few new tokens as one chunk, not one per sequence
            # (untiled numbers move by round-off anyway; 16 sequences of cpu-small: 4x faster)
            y, stats, _, sel, own = self._chunk(
                x.reshape(B * T, d), None if forced is None else forced.reshape(B * T, -1), True)
            choice = (sel.reshape(B, T, k).to(torch.uint8), own.reshape(B, T, k).to(torch.uint8))
            return y.reshape(B, T, d), aux, stats.detach(), choice
        for b in range(B):
            seq_stats = torch.zeros_like(stats)
            seq_share = torch.zeros(E, device=x.device)
            for s in range(0, T, chunk):
                xc = x[b, s : s + chunk]
                fc = None if forced is None else forced[b, s : s + chunk]
                if torch.is_grad_enabled() and T > chunk:
                    y, cnt, share, sel, own = checkpoint(self._chunk, xc, fc, ctx.untiled,
                                                         use_reentrant=False)
                else:
                    y, cnt, share, sel, own = self._chunk(xc, fc, ctx.untiled)
                outs.append(y)
                used.append(sel.to(torch.uint8))
                owns.append(own.to(torch.uint8))
                seq_stats, seq_share = seq_stats + cnt, seq_share + share
            stats = stats + seq_stats
            if self.cfg.seq_aux_weight > 0 and T > 0:
                # a shard's sequence is the whole of it: its counts summed over the context group
                aux = aux + ctx.sequence.balance(self.balance_loss, seq_stats[:, 0], seq_share,
                                                 T) / B
        y = torch.cat(outs, dim=0).reshape(B, T, d) if outs else torch.zeros_like(x)
        if outs:
            choice = (torch.cat(used).reshape(B, T, k), torch.cat(owns).reshape(B, T, k))
        else:
            choice = (x.new_zeros(B, T, k, dtype=torch.uint8),) * 2
        return y, aux, stats.detach(), choice

    def balance_loss(self, load: torch.Tensor, share: torch.Tensor, T: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss of one sequence of ``T`` tokens from its routed
        counts ``load [E]`` and summed normalised scores ``share [E]``."""
        E, k = self.cfg.n_experts, self.cfg.experts_per_token
        f = load * E / (k * T)
        return self.cfg.seq_aux_weight * (f * share / T).sum()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, margins: torch.Tensor | None = None,
                    rate: float | None = None, rule: str | None = None) -> None:
        """Aux-loss-free balancing from a step's ``load [E]`` (and ``margins [E, N_MARGIN_BINS]``).

        ``bias_update``: ``sign``, DeepSeek-V3's ``bias_i += rate * sign(mean(load) - load_i)``;
        ``proportional``, ``rate * (mean(load) - load_i) / mean(load)``; ``quantile``, a step of
        ``rate`` (a fraction, e.g. 0.5) towards the bias that, each expert taken alone, would have
        given it the mean load on this step's tokens, read off its margin histogram. The first two
        move by fixed amounts whatever the scale of the scores; where scores barely vary from
        token to token one fixed step swings whole layers' worth of tokens. ``rule`` / ``rate``
        override the config's ``bias_update`` / ``bias_update_rate``.
        """
        rate = self.cfg.bias_update_rate if rate is None else rate
        rule = self.cfg.bias_update if rule is None else rule
        err = load.mean() - load
        if rule == "quantile" and margins is not None:
            delta = margin_quantile_shift(margins, float(load.mean()))
            self.bias += rate * (delta - delta.mean()).to(self.bias)
        elif rule == "proportional":
            self.bias += rate * (err / load.mean().clamp_min(1e-9)).to(self.bias)
        else:
            self.bias += rate * torch.sign(err).to(self.bias)


def margin_quantile_shift(margins: torch.Tensor, target: float) -> torch.Tensor:
    """Per expert, the bias shift that would route ``target`` tokens to it: ``-q`` with ``q`` the
    margin above which ``target`` of its tokens lie, interpolated linearly inside a bin of
    :data:`MARGIN_EDGES` (clipped to +-1). ``margins [E, N_MARGIN_BINS]`` -> ``[E]``."""
    edges = MARGIN_EDGES.to(margins.device, torch.float64)
    lo = torch.cat([edges[:1], edges])  # bin j spans [lo[j], hi[j]); open bins clipped to +-1
    hi = torch.cat([edges, edges[-1:]])
    h = margins.to(torch.float64)
    above = h.flip(-1).cumsum(-1).flip(-1)  # tokens in bin j or higher
    out = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)
    for e in range(h.shape[0]):
        # the last bin with at least ``target`` tokens at or above it
        j = int(torch.searchsorted(-above[e], torch.tensor(-target, dtype=torch.float64,
                                                          device=h.device), right=True)) - 1
        if j < 0:  # fewer tokens than the target: as far up as the grid goes
            out[e] = lo[0]
            continue
        inside = float(h[e, j])
        beyond = float(above[e, j] - h[e, j])  # tokens in bins above j
        frac = 0.0 if inside <= 0 else min(1.0, max(0.0, (target - beyond) / inside))
        out[e] = hi[j] - frac * (hi[j] - lo[j])
    return -out.float()

