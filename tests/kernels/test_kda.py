import functools
import shutil

import pytest
import torch

from megabase.kernels import native
from megabase.kernels.kda import cpu, kda_chunk, kda_chunk_torch, kda_recurrent
from tests.fla_oracle import fla_naive
from tests.kernels.tolerances import assert_close

# (B, T, H, HV, K, V): odd lengths, T < chunk, T not a multiple of 64, non-power-of-2 dims, GQA.
SHAPES = [
    (1, 1, 1, 1, 8, 8),
    (2, 63, 2, 4, 16, 8),
    (1, 65, 1, 1, 12, 20),
    (1, 200, 3, 3, 24, 16),
    (2, 131, 1, 2, 32, 32),
]


def make(B, T, H, HV, K, V, seed=0, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    # The model's gate lies in (-5, 0); strong_decay also covers gates far below that.
    g = -5 * torch.rand(B, T, HV, K, generator=gen) * (4 if strong_decay else 1)
    beta = torch.rand(B, T, HV, generator=gen)
    s0 = torch.randn(B, HV, K, V, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, s0)]


def run(fn, xs, **kw):
    o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
    loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + s.square().sum() * 0.1
    grads = torch.autograd.grad(loss, xs)
    return o, s, grads


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_chunk_matches_recurrent(shape, strong_decay, backend):
    """The PyTorch chunk form and the C recurrence against the PyTorch recurrence."""
    xs = make(*shape, strong_decay=strong_decay)
    o1, s1, g1 = run(kda_recurrent, xs)
    o2, s2, g2 = run(functools.partial(kda_chunk, backend=backend), xs)
    assert_close(o2, o1, "o")
    assert_close(s2, s1, "final state")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], g2, g1):
        assert_close(a, b, name)


def test_checkpointed_segments_match_one_segment():
    xs = make(1, 300, 2, 2, 16, 16, seed=3)
    o1, s1, g1 = run(kda_chunk_torch, xs, segment=10**6)
    o2, s2, g2 = run(kda_chunk_torch, xs, segment=128)
    assert_close(o2, o1, "o")
    assert_close(s2, s1, "state")
    for a, b in zip(g2, g1):
        assert_close(a, b, "grad")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_split_sequence_with_carried_state_equals_whole(backend):
    q, k, v, g, beta, s0 = make(2, 157, 2, 2, 16, 8, seed=1)
    kda = functools.partial(kda_chunk, output_final_state=True, backend=backend)
    whole, s_whole = kda(q, k, v, g, beta, initial_state=s0)
    cut = 70
    a, s_mid = kda(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=s0)
    b, s_end = kda(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=s_mid)
    assert_close(torch.cat([a, b], 1), whole, "o")
    assert_close(s_end, s_whole, "state")
    if backend == "cpu":  # the same operations in the same order, the state carried in fp64
        assert torch.equal(torch.cat([a, b], 1), whole) and torch.equal(s_end, s_whole)


def test_c_kernel_is_built_and_can_be_turned_off(monkeypatch):
    if shutil.which("cc") or shutil.which("gcc"):
        assert cpu.available()
    xs = make(1, 40, 1, 1, 8, 8, seed=4)
    monkeypatch.setenv("MEGABASE_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert not cpu.available()
        o, s = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)  # PyTorch form
        assert s.dtype == torch.float32
        with pytest.raises(ValueError, match="cpu KDA backend"):
            kda_chunk(*xs[:5], backend="cpu")
    finally:
        monkeypatch.delenv("MEGABASE_NATIVE")
        native.load.cache_clear()
    o_c, s_c = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert s_c.dtype == torch.float64
    assert_close(o_c, o, "o")


@pytest.mark.parametrize("shape", [(1, 64, 1, 2, 16, 16), (2, 128, 2, 2, 8, 12)])
def test_against_fla_naive(shape):
    naive = fla_naive("kda")
    xs = make(*shape, seed=5)
    o_ref, s_ref = naive.naive_recurrent_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    o_chunk, s_chunk = naive.naive_chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    o, s = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    o_rec, _ = kda_recurrent(*xs[:5], initial_state=xs[5])
    for got in (o, o_rec):
        assert_close(got, o_ref, "o vs fla naive_recurrent_kda")
    assert_close(o, o_chunk, "o vs fla naive_chunk_kda")
    assert_close(s, s_ref, "state vs fla")


def test_empty_and_unknown_backend():
    xs = make(1, 0, 1, 1, 8, 8)
    o, s = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert o.shape == (1, 0, 1, 8) and torch.equal(s, xs[5].detach())
    with pytest.raises(ValueError, match="backend"):
        kda_chunk(*xs[:5], backend="cuda-magic")


def test_torch_is_the_old_name_of_the_reference_backend():
    """Configs saved before the rename hold ``kda_backend: torch``."""
    from megabase.model import ModelConfig

    xs = make(1, 40, 1, 1, 8, 8, seed=7)
    o_ref, s_ref = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True,
                             backend="reference")
    o, s = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True, backend="torch")
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref) and s.dtype == torch.float32
    assert ModelConfig(kda_backend="torch").kda_backend == "reference"


@pytest.mark.parametrize("T,segment", [(157, 32768), (4200, 64 * 64)])
def test_final_state_alone_equals_the_full_pass(T, segment, monkeypatch):
    """kda_final_state skips the outputs: same state and gradients as kda_chunk's final state
    (one segment, and several checkpointed segments)."""
    from megabase.kernels.kda import kda_final_state, reference

    monkeypatch.setattr(reference, "SEGMENT", segment)
    monkeypatch.setattr(reference, "WHOLE", min(reference.WHOLE, segment))
    xs = make(1, T, 2, 2, 16, 8, seed=3)
    _, s_full = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True)
    g_full = torch.autograd.grad(s_full.square().sum(), xs[1:])  # q reads the state, never writes it
    s_alone = kda_final_state(*xs[:5], initial_state=xs[5], backend="reference")
    g_alone = torch.autograd.grad(s_alone.square().sum(), xs[1:])
    assert_close(s_alone, s_full, "state")
    for a, b in zip(g_alone, g_full):
        assert_close(a, b, "grad")


def test_c_kernel_rejects_mismatched_layouts():
    if not cpu.available():
        pytest.skip("no C compiler")
    q, k, v, g, beta, s0 = make(1, 30, 2, 2, 8, 8, seed=6)
    with pytest.raises(ValueError, match="do not match"):
        kda_chunk(q, k, v, g[:, :, :1], beta, backend="cpu")
    with pytest.raises(ValueError, match="do not match"):
        kda_chunk(q, k, v, g, beta, initial_state=s0[:, :, :4], backend="cpu")
