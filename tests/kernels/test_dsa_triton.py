"""The Triton DSA kernels against the reference, under the Triton interpreter on CPU.

Same selected sets (exactly, ties included), outputs and gradients within the shared tolerance
table. ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without CUDA before anything
imports Triton.
"""

import pytest
import torch

from megabase.kernels.dsa import (
    dsa_attention, dsa_indexer, indexer_kl_sparse, reference, resolve_backend, seed_keys,
    sparse_attention,
)
from tests.kernels.test_dsa import dense_topk, make
from tests.kernels.test_dsa_candidates import stage_of, tokens_with_copies
from tests.kernels.tolerances import assert_close

pytest.importorskip("triton")
from megabase.kernels.dsa.triton_kernels import staged_indexer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (B, T, HQ, H, D, HI, DI, topk): odd T, GQA, non-power-of-2 dims, topk > T, one query
SHAPES = [
    (2, 23, 4, 2, 6, 2, 5, 8),
    (1, 19, 3, 1, 12, 3, 6, 32),
    (1, 30, 2, 2, 8, 1, 4, 5),
    (2, 1, 2, 1, 8, 2, 4, 4),
]


def on(device, *xs):
    return [x.detach().to(device).requires_grad_(x.requires_grad) for x in xs]


@pytest.mark.parametrize("shape", SHAPES)
def test_indexer_selects_the_same_keys(shape):
    _, _, _, qi, ki, wi = make(*shape, seed=11)
    topk = shape[-1]
    ref = dsa_indexer(qi, ki, wi, topk, backend="reference")
    got = dsa_indexer(*on(DEVICE, qi, ki, wi), topk, backend="triton").cpu()
    assert torch.equal(got, ref)
    got = dsa_indexer(*on(DEVICE, qi, ki), None, topk, backend="triton").cpu()
    assert torch.equal(got, dsa_indexer(qi, ki, None, topk, backend="reference"))


def test_indexer_ties_recent_keys_and_offset():
    _, _, _, qi, ki, wi = make(1, 45, 1, 1, 4, 2, 3, 6, seed=2)  # ReLU zeros: many ties
    assert torch.equal(dsa_indexer(qi, ki, wi, 6, backend="triton"), dense_topk(qi, ki, wi, 6))
    for kw in ({"keep_recent": 3}, {"offset": 20}):
        q_, w_ = (qi[:, 20:], wi[:, 20:]) if "offset" in kw else (qi, wi)
        assert torch.equal(dsa_indexer(q_, ki, w_, 6, backend="triton", **kw),
                           dsa_indexer(q_, ki, w_, 6, backend="reference", **kw))


@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_attention_forward_and_gradients(shape):
    q, k, v, qi, ki, wi = make(*shape, seed=12)
    idx = dsa_indexer(qi, ki, wi, shape[-1], backend="reference")
    o_ref, p_ref = sparse_attention(q, k, v, idx, return_probs=True, backend="reference")
    tq, tk, tv = on(DEVICE, q, k, v)
    o, p = sparse_attention(tq, tk, tv, idx.to(DEVICE), return_probs=True, backend="triton")
    assert_close(o.cpu(), o_ref, "o")
    assert_close(p.cpu(), p_ref, "probs")
    grads = torch.autograd.grad(o.square().sum(), (tq, tk, tv))
    for name, a, b in zip("qkv", grads, torch.autograd.grad(o_ref.square().sum(), (q, k, v))):
        assert_close(a.cpu(), b, f"d{name}")


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("weighted", [True, False])
def test_indexer_kl_and_its_gradient(shape, weighted):
    q, k, v, qi, ki, wi = make(*shape, seed=13)
    wi = wi if weighted else None
    idx = dsa_indexer(qi, ki, wi, shape[-1], backend="reference")
    _, target = sparse_attention(q, k, v, idx, return_probs=True, backend="reference")
    inputs = [x.clone().requires_grad_() for x in (qi, ki, *([wi] if weighted else []))]
    ref = indexer_kl_sparse(inputs[0], inputs[1], inputs[2] if weighted else None, idx, target,
                            backend="reference")
    dev = on(DEVICE, *inputs)
    got = indexer_kl_sparse(dev[0], dev[1], dev[2] if weighted else None, idx.to(DEVICE),
                            target.to(DEVICE), backend="triton")
    assert_close(got.cpu(), ref, "kl")
    for i, (a, b) in enumerate(zip(torch.autograd.grad(got, dev), torch.autograd.grad(ref, inputs))):
        assert_close(a.cpu(), b, f"grad {i}")


def test_dsa_attention_end_to_end_and_backend_choice():
    q, k, v, qi, ki, wi = make(1, 17, 2, 1, 8, 2, 4, 6, seed=14)
    o, idx = dsa_attention(q, k, v, qi, ki, wi, topk=6, return_indices=True, backend="triton")
    o_ref, idx_ref = dsa_attention(q, k, v, qi, ki, wi, topk=6, return_indices=True,
                                   backend="reference")
    assert torch.equal(idx, idx_ref)
    assert_close(o, o_ref, "o")
    assert resolve_backend("auto", q) == ("triton" if q.is_cuda else "cpu")
    with pytest.raises(ValueError, match="unknown DSA backend"):
        resolve_backend("cuda", q)


def test_debug_model_trains_the_same_on_either_backend(bundled_store):
    import numpy as np

    from megabase.model import build_model

    tokens = torch.from_numpy(np.array(bundled_store.tokens("chr22")[:70]).astype(np.int64))[None]
    losses, grads = [], []
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        model = build_model("debug", dsa_backend=backend)
        out = model(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert_close(losses[1], losses[0], "loss")
    assert_close(grads[1], grads[0], "gradients")


# The candidate stage: (B, T, HI, DI, topk, block, blocks, local), odd lengths and topk, one to
# three index heads, first staged queries 63, 127 and 96
STAGED = [
    (1, 150, 2, 5, 7, 16, 2, 16),
    (2, 211, 3, 6, 12, 16, 4, 48),
    (1, 277, 1, 4, 5, 16, 3, 33),
]


def staged_inputs(shape, summary, seed=41):
    B, T, HI, DI, topk, block, blocks, local = shape
    _, _, _, qi, ki, wi = make(B, T, 1, 1, 4, HI, DI, topk, seed=seed)
    stage = stage_of(block, blocks, local, summary=summary)
    return qi, ki, wi, topk, stage, seed_keys(tokens_with_copies(B, T, seed=seed), 0, stage)


@pytest.mark.parametrize("shape", STAGED[1:])
@pytest.mark.parametrize("summary", ["mean", "max"])
def test_stage_selects_the_reference_keys(shape, summary):
    """The staged queries only (from the first staged one on, as a stream would give them):
    weighted or not, keep_recent or not, seeds, no seeds and an empty seed list."""
    qi, ki, wi, topk, stage, seeds = staged_inputs(shape, summary)
    first = stage.first_staged()
    empty = seeds[..., :0]
    for w, keep_recent, s in ((wi, 0, seeds), (None, 4, seeds), (wi, 4, None), (None, 0, empty)):
        ref = reference.staged_indexer(qi, ki, w, topk, stage, keep_recent=keep_recent, seeds=s)
        assert (ref[:, first:] != dsa_indexer(qi, ki, w, topk, keep_recent=keep_recent,
                                               backend="reference")[:, first:]).any()
        dev = on(DEVICE, qi[:, first:], ki, *([] if w is None else [w[:, first:]]))
        got = staged_indexer(dev[0], dev[1], dev[2] if w is not None else None, topk, stage,
                             keep_recent=keep_recent, offset=first,
                             seeds=None if s is None else s[:, first:].to(DEVICE))
        assert torch.equal(got.cpu(), ref[:, first:])


def test_stage_before_its_first_query_and_streamed():
    """Through dsa_indexer: the exact Triton indexer before the first staged query, the stage
    after it; a stream (queries from an offset on, keys up to its last query) selects what the
    full pass selects."""
    qi, ki, wi, topk, stage, seeds = staged_inputs(STAGED[0], "max")
    kw = dict(topk=topk, keep_recent=2, stage=stage)
    ref = dsa_indexer(qi, ki, wi, seeds=seeds, backend="reference", **kw)
    full = dsa_indexer(*on(DEVICE, qi, ki, wi), seeds=seeds.to(DEVICE), backend="triton", **kw)
    assert torch.equal(full.cpu(), ref)
    for start, end in ((40, 150), (100, 131)):
        part = [x[:, start:end] for x in (qi, wi, seeds)]
        tail = dsa_indexer(*on(DEVICE, part[0], ki[:, :end], part[1]), seeds=part[2].to(DEVICE),
                           offset=start, backend="triton", **kw)
        assert torch.equal(tail.cpu(), ref[:, start:end])


@pytest.mark.parametrize("summary", ["mean", "max"])
def test_stage_one_query_per_program_and_arbitrary_seeds(summary):
    """The GPU layout (one query per program) and seeds anywhere: inside kept blocks or the
    local window (both skipped: there already), in the future, -1."""
    qi, ki, wi, topk, stage, _ = staged_inputs(STAGED[2], summary, seed=42)
    B, T = qi.shape[:2]
    gen = torch.Generator().manual_seed(43)
    seeds = torch.randint(-1, T, (B, T, 24), generator=gen, dtype=torch.int32)
    ref = reference.staged_indexer(qi, ki, wi, topk, stage, keep_recent=3, seeds=seeds)
    start = 262
    for block_q in (1, None):
        got = staged_indexer(*on(DEVICE, qi[:, start:], ki, wi[:, start:]), topk, stage,
                             keep_recent=3, offset=start, seeds=seeds[:, start:].to(DEVICE),
                             block_q=block_q)
        assert torch.equal(got.cpu(), ref[:, start:])
