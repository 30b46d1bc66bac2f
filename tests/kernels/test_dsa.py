import pytest
import torch

from megabase.kernels.dsa import (
    dsa_attention, dsa_indexer, indexer_kl_dense, indexer_kl_sparse, sparse_attention,
)
from megabase.kernels.dsa.reference import index_scores
from tests.fla_oracle import fla_naive
from tests.kernels.tolerances import assert_close

# (B, T, HQ, H, D, HI, DI, topk): odd T, GQA, non-power-of-2 dims, topk < T and topk > T.
SHAPES = [
    (2, 37, 4, 2, 8, 2, 4, 8),
    (1, 129, 3, 1, 12, 3, 6, 16),
    (1, 50, 2, 2, 8, 1, 4, 64),
    (2, 1, 2, 1, 8, 2, 4, 4),
]


def make(B, T, HQ, H, D, HI, DI, topk, seed=0, positive_index=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=gen).requires_grad_() for h in (HQ, H, H))
    draw = torch.rand if positive_index else torch.randn
    q_idx = draw(B, T, HI, DI, generator=gen)
    k_idx = draw(B, T, DI, generator=gen)
    w_idx = draw(B, T, HI, generator=gen)
    return q, k, v, q_idx, k_idx, w_idx


def dense_topk(q_idx, k_idx, w_idx, topk):
    """T x T scores, then the order (score desc, position desc): the definition, unblocked."""
    T = q_idx.shape[1]
    s = index_scores(q_idx, k_idx, w_idx, q_idx.shape[-1] ** -0.5)
    pos = torch.arange(T)
    out = []
    for t in range(T):
        keys = sorted(range(t + 1), key=lambda j: (-float(s[0, t, j]), -j))[:topk]
        out.append(sorted(keys) + [-1] * (topk - len(keys)))
    return torch.tensor([out])[..., :topk] if T else pos.new_zeros(1, 0, topk)


@pytest.mark.parametrize("shape", SHAPES)
def test_against_fla_naive(shape):
    naive = fla_naive("dsa")
    q, k, v, qi, ki, wi = make(*shape, positive_index=True)  # positive scores: no ties
    topk = shape[-1]
    o_ref, i_ref = naive.naive_dsa(q, k, v, qi, ki, wi, topk=topk, return_indices=True)
    o, idx = dsa_attention(q, k, v, qi, ki, wi, topk=topk, return_indices=True, block_q=16)
    assert torch.equal(idx.sort(-1).values, i_ref.sort(-1).values)
    assert_close(o, o_ref, "o")
    for name, a, b in zip("qkv", torch.autograd.grad(o.square().sum(), (q, k, v)),
                          torch.autograd.grad(o_ref.square().sum(), (q, k, v))):
        assert_close(a, b, f"d{name}")


@pytest.mark.parametrize("blocks", [(1, 1), (7, 11), (64, 5), (256, 4096)])
def test_running_topk_is_blocking_invariant_with_ties(blocks):
    _, _, _, qi, ki, wi = make(1, 45, 1, 1, 4, 2, 3, 6, seed=2)  # ReLU makes many zero ties
    idx = dsa_indexer(qi, ki, wi, 6, block_q=blocks[0], block_k=blocks[1], backend="reference")
    assert torch.equal(idx, dense_topk(qi, ki, wi, 6))


@pytest.mark.parametrize("block_k", [16, 40, 4096])
def test_threshold_merge_matches_the_definition(block_k):
    """Long prefixes: later key chunks only contribute scores above each row's k-th."""
    _, _, _, qi, ki, wi = make(1, 300, 1, 1, 4, 2, 5, 12, seed=3)
    idx = dsa_indexer(qi, ki, wi, 12, block_q=16, block_k=block_k, backend="reference")
    assert torch.equal(idx, dense_topk(qi, ki, wi, 12))
    tail = dsa_indexer(qi[:, 160:], ki, wi[:, 160:], 12, block_q=16, block_k=block_k, offset=160,
                       backend="reference")
    assert torch.equal(tail, idx[:, 160:])


def test_dense_when_t_le_topk():
    q, k, v, qi, ki, wi = make(1, 33, 4, 2, 8, 2, 4, 64, seed=4)
    o = dsa_attention(q, k, v, qi, ki, wi, topk=64)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    assert_close(o, dense, "o vs dense causal")


def test_keep_recent_always_selects_the_latest_keys():
    _, _, _, qi, ki, wi = make(1, 40, 1, 1, 4, 2, 3, 5, seed=6)
    idx = dsa_indexer(qi, ki, wi, 5, keep_recent=3)
    for t in range(40):
        assert set(range(max(0, t - 2), t + 1)) <= set(idx[0, t].tolist())


def test_streaming_offset_selects_the_same_keys():
    _, _, _, qi, ki, wi = make(1, 60, 1, 1, 4, 2, 3, 7, seed=7)
    full = dsa_indexer(qi, ki, wi, 7)
    tail = dsa_indexer(qi[:, 25:], ki, wi[:, 25:], 7, offset=25)
    assert torch.equal(tail, full[:, 25:])


def test_memory_is_blockwise():
    """A query block never sees more than block_q x (topk + block_k) scores."""
    seen = []
    real_topk = torch.Tensor.topk

    def spy(self, *a, **kw):
        seen.append(self.numel())
        return real_topk(self, *a, **kw)

    _, _, _, qi, ki, wi = make(1, 600, 1, 1, 4, 1, 4, 8, seed=8)
    torch.Tensor.topk = spy
    try:
        dsa_indexer(qi, ki, wi, 8, block_q=32, block_k=64, backend="reference")
    finally:
        torch.Tensor.topk = real_topk
    assert max(seen) <= 32 * (8 + 64) and 600 * 600 > 32 * (8 + 64)


def test_sparse_kl_gradients_reach_only_the_indexer_inputs():
    q, k, v, qi, ki, wi = make(1, 70, 2, 1, 8, 2, 4, 9, seed=9)
    qi.requires_grad_()
    ki.requires_grad_()
    idx = dsa_indexer(qi, ki, wi, 9)
    o, p = sparse_attention(q, k, v, idx, return_probs=True)
    assert torch.allclose(p.sum(-1), torch.ones(1, 70))
    loss = indexer_kl_sparse(qi, ki, wi, idx, p)
    assert loss >= 0
    gq, gk = torch.autograd.grad(loss, (qi, ki))
    assert gq.abs().sum() > 0 and gk.abs().sum() > 0
    assert not p.requires_grad


def test_dense_kl_is_zero_when_indexer_reproduces_attention():
    """With one main head equal to the indexer (same q/k, no ReLU effect), the KL vanishes."""
    gen = torch.Generator().manual_seed(10)
    T, D = 25, 6
    qi = torch.rand(1, T, 1, D, generator=gen)
    ki = torch.rand(1, T, D, generator=gen)
    q, k = qi.clone(), ki[:, :, None, :].clone()
    kl = indexer_kl_dense(q, k, qi, ki, block_q=7)
    assert abs(float(kl)) < 1e-5
    kl_other = indexer_kl_dense(q, torch.randn(1, T, 1, D, generator=gen), qi, ki)
    assert float(kl_other) > 1e-3
