"""DeepSeek Sparse Attention: lightning indexer with running top-k, sparse attention, indexer losses.

Plain-PyTorch reference in :mod:`megabase.kernels.dsa.reference`; shapes follow
``fla.ops.dsa.naive_dsa``.
"""

import torch

from .reference import (
    dsa_attention,
    dsa_indexer,
    indexer_kl_dense,
    indexer_kl_sparse,
    sparse_attention,
)


@torch.library.custom_op("megabase::dsa_indexer", mutates_args=())
def dsa_indexer_op(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor | None,
                   topk: int, keep_recent: int, block_q: int, offset: int) -> torch.Tensor:
    """:func:`dsa_indexer` as one registered op, so activation recompute can keep its output
    (``megabase.pipeline.memory``): the O(T^2) selection then runs once per step, not twice."""
    return dsa_indexer(q_idx, k_idx, w_idx, topk, keep_recent=keep_recent, block_q=block_q,
                       offset=offset)


@dsa_indexer_op.register_fake
def _(q_idx, k_idx, w_idx, topk, keep_recent, block_q, offset):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.long)


__all__ = ["dsa_attention", "dsa_indexer", "dsa_indexer_op", "indexer_kl_dense", "indexer_kl_sparse",
           "sparse_attention"]
