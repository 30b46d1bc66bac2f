"""The CPU DSA kernels (the CPU default: C indexer and attention) against the reference.

Sparse attention and the sparse indexer KL: outputs, head-summed probabilities and every gradient
within the shared tolerance table, at odd lengths, GQA, ``topk`` above and below ``T``, batches, a
streaming offset (more keys than queries), queries without keys. The C indexer: the same selected keys, ties included; the fallback when the
C kernels cannot be built.
"""

import shutil

import pytest
import torch

from megabase.kernels import native
from megabase.kernels.dsa import cpu, dsa_indexer, reference, resolve_backend, sparse_attention
from tests.kernels.test_dsa import SHAPES, dense_topk, make
from tests.kernels.tolerances import assert_close


IMPLS = {  # the C attention (CPU default), the oracle
    "cpu": (cpu.sparse_attention, cpu.indexer_kl_sparse),
    "reference": (reference.sparse_attention, reference.indexer_kl_sparse),
}


def run(impl, q, k, v, qi, ki, wi, idx):
    """Forward values and the gradients of a loss that reaches every input."""
    attention, kl_loss = IMPLS[impl]
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, qi, ki)]
    w = None if wi is None else wi.detach().clone().requires_grad_()
    o, p = attention(*inputs[:3], idx, return_probs=True)
    kl = kl_loss(inputs[3], inputs[4], w, idx, p)
    (o.square().sum() + o.sum() + 10 * kl).backward()
    grads = [x.grad for x in inputs] + ([] if w is None else [w.grad])
    return [o.detach(), p, kl.detach(), *grads]


def assert_backends_agree(q, k, v, qi, ki, wi, idx, impls=("cpu",)):
    names = ["o", "probs", "kl", "dq", "dk", "dv", "dq_idx", "dk_idx", "dw_idx"]
    ref = run("reference", q, k, v, qi, ki, wi, idx)
    for impl in impls:
        for name, a, b in zip(names, run(impl, q, k, v, qi, ki, wi, idx), ref):
            assert_close(a, b, f"{impl} {name}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_forward_and_gradients_match_the_reference(shape, weighted):
    q, k, v, qi, ki, wi = make(*shape, seed=21)
    wi = wi if weighted else None
    idx = dsa_indexer(qi, ki, wi, shape[-1])
    assert_backends_agree(q, k, v, qi, ki, wi, idx)


def test_streaming_offset_more_keys_than_queries():
    q, k, v, qi, ki, wi = make(1, 70, 2, 1, 8, 2, 4, 9, seed=23)
    idx = dsa_indexer(qi[:, 40:], ki, wi[:, 40:], 9, offset=40)
    assert_backends_agree(q[:, 40:], k, v, qi[:, 40:], ki, wi[:, 40:], idx)


def test_real_selection_with_padding_rows_and_auto_choice():
    """Early queries see fewer than ``topk`` keys (-1 slots): they must carry no weight."""
    q, k, v, qi, ki, wi = make(1, 40, 2, 2, 8, 2, 4, 32, seed=24)
    idx = dsa_indexer(qi, ki, wi, 32)
    assert (idx < 0).any()
    assert_backends_agree(q, k, v, qi, ki, wi, idx)
    assert resolve_backend("auto", q) == ("triton" if q.is_cuda else "cpu")
    o, p = sparse_attention(q, k, v, idx, return_probs=True)
    assert torch.allclose(p.sum(-1), torch.ones(1, 40)) and (p[idx < 0] == 0).all()


def test_a_query_with_no_key_gets_zeros():
    q, k, v, *_ = make(2, 9, 2, 1, 8, 2, 4, 3, seed=26)
    idx = torch.full((2, 9, 3), -1, dtype=torch.long)
    idx[0, :, 0] = torch.arange(9)
    for impl in IMPLS:
        o, p = IMPLS[impl][0](q, k, v, idx, return_probs=True)
        assert (o[1] == 0).all() and (p[1] == 0).all() and torch.isfinite(o).all(), impl


def test_c_kernels_are_built_where_a_compiler_exists():
    if native.enabled() and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu.available()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("keep_recent", [0, 3])
def test_native_indexer_selects_the_reference_keys(shape, weighted, keep_recent):
    _, _, _, qi, ki, wi = make(*shape, seed=25)
    wi = wi if weighted else None
    ref = dsa_indexer(qi, ki, wi, shape[-1], keep_recent=keep_recent, backend="reference")
    assert torch.equal(dsa_indexer(qi, ki, wi, shape[-1], keep_recent=keep_recent, backend="cpu"), ref)


@pytest.mark.parametrize("seed", range(3))
def test_native_indexer_ties_long_prefixes_and_offsets(seed):
    """ReLU zeros and equal keys tie (the most recent wins); long rows refill the top-k buffer
    many times; a streaming offset selects what the full pass does."""
    _, _, _, qi, ki, wi = make(1, 45, 1, 1, 4, 2, 3, 6, seed=2 + seed)
    assert torch.equal(dsa_indexer(qi, ki, wi, 6, backend="cpu"), dense_topk(qi, ki, wi, 6))
    _, _, _, qi, ki, wi = make(2, 700, 1, 1, 4, 2, 5, 7, seed=seed, positive_index=True)
    ki[:, 300:310] = ki[:, 290:300]  # exact equal scores between distinct keys
    full = dsa_indexer(qi, ki, wi, 7, backend="cpu")
    assert torch.equal(full, dsa_indexer(qi, ki, wi, 7, backend="reference"))
    tail = dsa_indexer(qi[:, 333:], ki, wi[:, 333:], 7, offset=333, backend="cpu")
    assert torch.equal(tail, full[:, 333:])


def test_native_build_failure_falls_back_with_one_warning(tmp_path, monkeypatch):
    bad = tmp_path / "broken.c"
    bad.write_text("int f( {\n")
    monkeypatch.setenv("MEGABASE_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="broken.c is unavailable"):
        assert native.load(str(bad)) is None
    monkeypatch.setenv("MEGABASE_NATIVE", "0")
    native.load.cache_clear()
    assert native.load(str(bad)) is None
    assert not cpu.available()  # off: the reference runs instead
    _, _, _, qi, ki, wi = make(1, 40, 1, 1, 4, 2, 3, 5, seed=3)
    assert torch.equal(dsa_indexer(qi, ki, wi, 5, backend="cpu"), dense_topk(qi, ki, wi, 5))
    native.load.cache_clear()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_inputs_the_kernels_would_misread_are_clear_errors_at_the_dispatch(backend):
    from megabase.kernels.dsa import indexer_kl_sparse

    q, k, v, qi, ki, wi = make(1, 20, 2, 1, 8, 2, 4, 5, seed=27)
    idx = dsa_indexer(qi, ki, wi, 5)
    with pytest.raises(ValueError, match="only 20 keys"):
        sparse_attention(q, k, v, idx.clamp(max=0) + 20, backend=backend)
    with pytest.raises(ValueError, match="do not match"):
        sparse_attention(q, k, v, idx[:, :10], backend=backend)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_attention(q[:, :, :1].expand(1, 20, 3, 8), k.expand(1, 20, 2, 8),
                         v.expand(1, 20, 2, 8), idx, backend=backend)
    with pytest.raises(ValueError, match="do not match"):
        indexer_kl_sparse(qi, ki, wi, idx, torch.ones(1, 20, 4), backend=backend)
    with pytest.raises(ValueError, match="do not match"):
        dsa_indexer(qi, ki[:, :10], wi, 5, backend=backend)


def test_the_c_kernels_take_empty_and_int32_selections():
    q, k, v, qi, ki, wi = make(1, 20, 2, 1, 8, 2, 4, 5, seed=27)
    idx = dsa_indexer(qi, ki, wi, 5)
    o, p = cpu.sparse_attention(q[:, :0], k, v, idx[:, :0], return_probs=True)  # no queries
    assert o.shape == (1, 0, 2, 8) and p.shape == (1, 0, 5)
    o32 = cpu.sparse_attention(q, k, v, idx.int())  # int32 indices are taken as positions
    assert_close(o32, reference.sparse_attention(q, k, v, idx), "o, int32 indices")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("B", [1, 2])
def test_key_gradients_are_added_into_longer_buffers(backend, B):
    """``key_grads``: the gradients of k, v and the index keys land in the buffers' first Tk rows,
    added to what they held, the rows past Tk untouched; autograd gives the keys none."""
    from megabase.kernels.dsa import indexer_kl_sparse, sparse_attention

    q, k, v, qi, ki, wi = make(B, 37, 4, 2, 8, 2, 4, 7, seed=29)
    idx = dsa_indexer(qi[:, 20:], ki, wi[:, 20:], 7, offset=20)
    want = run("reference", q[:, 20:], k, v, qi[:, 20:], ki, wi[:, 20:], idx)
    held = [torch.randn(B, 45, *x.shape[2:], generator=torch.Generator().manual_seed(3))
            for x in (k, v, ki)]
    buffers = [h.clone() for h in held]
    inputs = [x.detach().clone().requires_grad_() for x in (q[:, 20:], k, v, qi[:, 20:], ki)]
    w = wi[:, 20:].detach().clone().requires_grad_()
    o, p = sparse_attention(*inputs[:3], idx, return_probs=True, backend=backend,
                            key_grads=buffers[:2])
    kl = indexer_kl_sparse(inputs[3], inputs[4], w, idx, p, backend=backend,
                           key_grads=buffers[2:])
    (o.square().sum() + o.sum() + 10 * kl).backward()
    assert inputs[1].grad is None and inputs[2].grad is None and inputs[4].grad is None
    assert_close(inputs[0].grad, want[3], f"{backend} dq")
    assert_close(w.grad, want[8], f"{backend} dw_idx")
    for name, buf, before, grad in zip(("dk", "dv", "dk_idx"), buffers, held,
                                       (want[4], want[5], want[7])):
        assert_close(buf[:, :37] - before[:, :37], grad, f"{backend} {name} added")
        assert torch.equal(buf[:, 37:], before[:, 37:]), f"{name}: rows past the keys changed"


def test_the_index_keys_gradient_does_not_depend_on_the_thread_count():
    """The C indexer loss adds each key's gradient in one order (by key ownership), so one
    thread and two give the same bits."""
    q, k, v, qi, ki, wi = make(1, 300, 2, 1, 8, 2, 4, 16, seed=31)
    idx = dsa_indexer(qi, ki, wi, 16)
    _, p = cpu.sparse_attention(q, k, v, idx, return_probs=True)
    grads = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kk = ki.detach().clone().requires_grad_()
            cpu.indexer_kl_sparse(qi, kk, wi, idx, p).backward()
            grads.append(kk.grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


def test_the_indexer_loss_without_autograd_is_its_value():
    q, k, v, qi, ki, wi = make(1, 50, 2, 1, 8, 2, 4, 9, seed=33)
    idx = dsa_indexer(qi, ki, wi, 9)
    _, p = cpu.sparse_attention(q, k, v, idx, return_probs=True)
    with torch.no_grad():
        value = cpu.indexer_kl_sparse(qi, ki, wi, idx, p)
    assert_close(value, reference.indexer_kl_sparse(qi, ki, wi, idx, p), "kl value")
