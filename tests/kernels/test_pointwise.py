import shutil

import pytest
import torch

from megabase.kernels import native, pointwise
from megabase.kernels.pointwise import cpu, reference
from tests.kernels.tolerances import assert_close

# shapes of x (sigmoid) and of ab = [a | b] (swiglu): one value, odd lengths, rows of odd widths
SHAPES = [(1,), (7,), (3, 5), (2, 37, 6), (129, 18), (4, 33, 64)]
OPS = {"sigmoid": (cpu.sigmoid, reference.sigmoid), "swiglu": (cpu.swiglu, reference.swiglu)}


def needs_c():
    if not cpu.available():
        pytest.skip("no C compiler here")


def make(shape, seed=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).requires_grad_()


def test_c_kernel_is_built_where_a_compiler_exists():
    if native.enabled() and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu.available()


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_matches_the_reference(op, shape):
    needs_c()
    if op == "swiglu" and shape[-1] % 2:
        shape = (*shape[:-1], shape[-1] + 1)
    fast, ref = OPS[op]
    x = make(shape)
    y1, y2 = ref(x), fast(x)
    assert_close(y2, y1, f"{op} forward")
    dy = torch.randn(y1.shape, generator=torch.Generator().manual_seed(1))
    (g1,), (g2,) = torch.autograd.grad(y1, x, dy), torch.autograd.grad(y2, x, dy)
    assert_close(g2, g1, f"{op} gradient")


def test_extremes_stay_finite_and_saturate():
    needs_c()
    x = torch.tensor([-1e4, -200.0, -88.5, -30.0, 0.0, 30.0, 88.5, 200.0, 1e4])
    y = cpu.sigmoid(x)
    assert torch.isfinite(y).all() and y[0] < 1e-37 and y[4] == 0.5 and y[-1] == 1.0
    ab = torch.cat([x, torch.ones_like(x)])[None]
    out = cpu.swiglu(ab)[0]
    assert torch.isfinite(out).all() and out[-1] == 1e4 and abs(float(out[0])) < 1e-30


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_value_has_its_bits_whatever_the_length_and_the_threads(op):
    """The property the kernel exists for (see cpu.py). PyTorch's own sigmoid and SiLU fail it on
    this tensor (torch 2.13, AVX-512: 3-7 values of a prefix differ at 3 threads and more), as
    each thread's range ends where the vector body hands over to a scalar tail."""
    needs_c()
    fast = OPS[op][0]
    x = make((3000, 64), seed=3).detach()  # over 2 x 32,768 values: PyTorch splits it in threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = fast(x)
        for threads in (1, 3, 7, 16):
            torch.set_num_threads(threads)
            assert torch.equal(fast(x), whole), threads
            for a, b in ((0, 1), (1, 4), (5, 777), (0, 2099), (38, 2991), (2999, 3000)):
                assert torch.equal(fast(x[a:b]), whole[a:b]), (threads, a, b)
    finally:
        torch.set_num_threads(before)


def test_dispatch_takes_the_reference_where_the_kernel_does_not_apply():
    needs_c()
    x = make((5, 8)).detach()
    for fn in ("sigmoid", "swiglu"):
        for args, kw in (((x.double(),), {}), ((x,), {"backend": "reference"})):
            assert torch.equal(getattr(pointwise, fn)(*args, **kw), getattr(reference, fn)(*args))
        assert torch.equal(getattr(pointwise, fn)(x), getattr(cpu, fn)(x))


def test_an_odd_swiglu_width_is_refused():
    with pytest.raises(ValueError, match="even last dim"):
        pointwise.swiglu(torch.zeros(3, 5))
