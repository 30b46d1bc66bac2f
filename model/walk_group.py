"""One prompt read in segments, then continued as a group of rows, with exact gradients.

RL scores ``G`` samples of one prompt: each sample's bases given the whole prompt and the sample
before them. Reading the prompt once per group (not once per sample) and its state copied to the
``G`` rows is what the generator does; the trainer must also send the gradient of every sampled
base back through the prompt's keys, values and states. :func:`walked_group` does that with the
walk of :mod:`megabase.model.walk`: the prompt is a window of one row cut in segments, and a last
*fan-out* segment holds the ``G`` rows of samples, reading the prompt's borders (the KDA states,
the conv and k-mer tails, the DSA keys of every prompt position) as each row's own. Its backward
runs the fan-out segment with autograd, sums what its rows send back over the group, and walks the
prompt's segments in reverse as a training window's are walked. Memory: one segment's activations
and the prompt's DSA keys (one row, their gradients as much again), plus the fan-out segment's
``G`` copies of those keys; never the prompt's activations whole.

The numbers are the full pass's over ``prompt + rows`` to fp32 round-off: log-probs and every
parameter's gradient (tests/model/test_walk_group.py compares them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .context import Context
from .walk import Segment, Walk, segment_bounds


def walked_group(model, prompt: torch.Tensor, rows: torch.Tensor, segment: int,
                 replay: list[torch.Tensor] | None = None, follow: bool = True, between=None):
    """``prompt [1, P]`` then each of ``rows [G, n]`` -> ``(logits [G, n, 4], router_choice)``:
    the next-base logits at every row position given the prompt and the row before it, and per MoE
    layer the router's own experts ``[G, P + n, k]`` (the prompt's the same for every row).
    ``segment``: prompt tokens per segment; ``replay``: per MoE layer the experts ``[G, P + n, k]``
    to use (the prompt's read from the first row), ``follow`` False to route freely beside them.
    The logits are differentiable (the backward walks the prompt again) when autograd is on and the
    model has trainable weights. ``between``: called with no arguments after each pass."""
    if prompt.shape[0] != 1:
        raise ValueError(f"one prompt row is read per group, got {prompt.shape[0]}")
    P = prompt.shape[1]
    bounds = segment_bounds(P, segment) + [(P, P + rows.shape[1])]
    walk = Walk(prompt, bounds, between, fan=True)
    ctx = model.context(follow_replay=follow)
    params = [p for p in model.parameters() if p.requires_grad]
    needed = torch.is_grad_enabled() and bool(params)
    report: dict = {}
    logits = _GroupWalked.apply(walk, model, rows, ctx, replay, report, *params)
    if not needed:  # no backward will come for the selections kept for it
        walk.selected.close()
    return logits, report["router_choice"]


def _call(model, walk: Walk, index: int, grad: bool, rows: torch.Tensor, ctx: Context,
          replay: list[torch.Tensor] | None):
    a, b = walk.bounds[index]
    seq = Segment(walk, index, grad)
    ids = rows if seq.fan else walk.ids[:, a:b]
    if replay is not None:
        replay = [r[: ids.shape[0], a:b] for r in replay]
    return model(ids, ctx=replace(ctx, sequence=seq, replay=replay)), seq


class _GroupWalked(torch.autograd.Function):
    """The walked group as one autograd node: forward the fan-out segment's logits; backward the
    fan-out segment with autograd, then the prompt's segments in reverse, returning every
    parameter's gradient."""

    @staticmethod
    def forward(fn_ctx, walk, model, rows, ctx, replay, report, *params):
        own = []
        with torch.no_grad():
            for i in range(len(walk.bounds)):
                out, seq = _call(model, walk, i, False, rows, ctx, replay)
                seq.release()
                own.append(out.router_choice)
                logits = out.logits
                del out
                walk.between()
        G = rows.shape[0]
        report["router_choice"] = [torch.cat([r.expand(G, -1, -1) for r in layer[:-1]]
                                             + [layer[-1]], 1) for layer in zip(*own)]
        fn_ctx.walk, fn_ctx.model, fn_ctx.rows, fn_ctx.ctx = walk, model, rows, ctx
        fn_ctx.replay, fn_ctx.params = replay, params
        return logits

    @staticmethod
    def backward(fn_ctx, g_logits):
        walk, params = fn_ctx.walk, fn_ctx.params
        grads: list[torch.Tensor | None] = [None] * len(params)
        for i in reversed(range(len(walk.bounds))):
            with torch.enable_grad():
                out, seq = _call(fn_ctx.model, walk, i, True, fn_ctx.rows, fn_ctx.ctx,
                                 fn_ctx.replay)
                seq.seal()
                objective = (out.logits * g_logits).sum() if seq.fan and g_logits is not None \
                    else None
                walk.backward(params, grads, objective)
            seq.release()
            del out, objective
            walk.between()
        walk.selected.close()
        return (None,) * 6 + tuple(grads)
