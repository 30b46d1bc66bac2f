"""DeepSeek Sparse Attention: lightning indexer with running top-k, sparse attention, indexer losses.

Plain-PyTorch reference in :mod:`megabase.kernels.dsa.reference`; shapes follow
``fla.ops.dsa.naive_dsa``.
"""

from .reference import (
    dsa_attention,
    dsa_indexer,
    indexer_kl_dense,
    indexer_kl_sparse,
    sparse_attention,
)

__all__ = ["dsa_attention", "dsa_indexer", "indexer_kl_dense", "indexer_kl_sparse", "sparse_attention"]
