"""The FLOPs of one training step (forward and backward) of a model, by layer kind, and this
machine's fp32 matmul rate, for the achieved-rate-as-a-share figures of bench_walk.

How they are counted:

* ``dense``: every matmul torch's ``FlopCounterMode`` counts (the projections, the MoE router,
  the head, forward and backward) and the MoE experts' grouped matmuls, which it has no formula
  for (``2 * a.numel() * out.shape[-1]``, in all three of their forward and backward forms),
  measured on a whole-window step of :data:`COUNTED` tokens and scaled by length (none of them
  depends on it);
* ``kda``: the KDA recurrence run by the C kernel, which the counter cannot see: per token and
  head ``7 K V`` forward (the gated decay of the state, ``k^T S``, the rank-1 update, ``q^T S``),
  the backward twice that;
* ``dsa attention``: per query and head ``topk (2 D + 2 D_v)`` forward, the backward twice that;
* ``indexer``: per query, ``2 I_h I_d`` for every key it scores: every earlier key before the
  candidate stage's first query; past it each block summary (``R`` rows) before the local window,
  ``blocks * block`` candidate keys, ``local`` keys and the seeds. No backward (it reads a
  detached input); its KL over the ``topk`` selected keys counts ``3 * 2 I_h I_d topk``.

These are the step's model FLOPs: a walked step's second forward of each segment (its backward's
recompute) is not counted, as MFU does not count activation recompute.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

COUNTED = 2048


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``[M, K] @ [E, K, N]``, ``[K, M] @ [M, N]`` grouped over M, ``[M, N] @ [E, N, K]``: each
    output element of a group is a dot over the rows that group holds."""
    return 2 * math.prod(a_shape) * out_shape[-1]


def dense_flops_per_token(model) -> float:
    """Aten-counted FLOPs per token of a forward and backward (see module docs)."""
    ids = torch.randint(0, 4, (1, COUNTED + 1), generator=torch.Generator().manual_seed(0))
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm} if hasattr(torch.ops.aten, "_grouped_mm") \
        else {}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        out = model(ids[:, :-1], ids[:, 1:])
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / COUNTED


def indexer_keys(cfg, n: int) -> float:
    """Keys (and summary rows) the indexer scores over the queries of an ``n``-token window."""
    t = np.arange(n, dtype=np.float64)
    stage = cfg.stage()
    if stage is None:
        return float((t + 1).sum())
    first = stage.first_staged()
    exact = (t[t < first] + 1).sum()
    late = t[t >= first]
    local0 = np.floor(np.maximum(late + 1 - stage.local, 0) / stage.block) * stage.block
    summaries = local0 / stage.block * stage.rows
    candidates = stage.blocks * stage.block + (late + 1 - local0) + stage.max_seeds
    return float(exact + (summaries + candidates).sum())


def step_flops(model, n: int) -> dict[str, float]:
    """FLOPs by layer kind of one training step of ``model`` over ``n`` tokens (module docs)."""
    cfg = model.cfg
    kinds = cfg.layer_kinds
    n_kda, n_dsa = kinds.count("K"), kinds.count("D")
    kda = 3 * 7 * cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim * n * n_kda
    attention = 3 * cfg.dsa_heads * cfg.topk * 4 * cfg.dsa_head_dim * n * n_dsa
    per_key = 2 * cfg.index_heads * cfg.index_dim
    indexer = (per_key * indexer_keys(cfg, n) + 3 * per_key * cfg.topk * n) * n_dsa
    return {"dense": dense_flops_per_token(model) * n, "kda": float(kda),
            "dsa attention": float(attention), "indexer": float(indexer)}


def matmul_rate(size: int = 2048, seconds: float = 3.0) -> float:
    """This machine's fp32 matmul rate (FLOP/s) at torch's thread count: the best of repeated
    ``[size, size] @ [size, size]`` products over about ``seconds``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best, until = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best
