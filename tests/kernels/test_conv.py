import shutil

import pytest
import torch

from megabase.kernels import native
from megabase.kernels.conv import cpu, reference, short_conv
from tests.kernels.tolerances import assert_close

# (B, T, C, W): one token, T shorter than the tail, odd lengths and widths, a width of 1.
SHAPES = [(1, 1, 3, 4), (2, 2, 5, 4), (1, 37, 16, 3), (3, 65, 24, 4), (2, 129, 7, 2), (1, 50, 8, 1)]


def make(B, T, C, W, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(B, T, C, generator=gen), torch.randn(C, W, generator=gen)
    tail = torch.randn(B, W - 1, C, generator=gen)
    return [t.requires_grad_() for t in (x, w, tail)]


def run(fn, xs):
    y, new_tail = fn(*xs)
    gen = torch.Generator().manual_seed(1)
    loss = (y * torch.randn(y.shape, generator=gen)).sum() + (
        new_tail * torch.randn(new_tail.shape, generator=gen)).sum()
    return y, new_tail, torch.autograd.grad(loss, xs)


def needs_c():
    if not cpu.available():
        pytest.skip("no C compiler here")


def test_c_kernel_is_built_where_a_compiler_exists():
    if native.enabled() and (shutil.which("cc") or shutil.which("gcc")):
        assert cpu.available()


@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_matches_the_reference(shape):
    needs_c()
    xs = make(*shape)
    y1, t1, g1 = run(reference.short_conv, xs)
    y2, t2, g2 = run(cpu.short_conv, xs)
    assert_close(y2, y1, "y")
    assert torch.equal(t2, t1)
    for name, a, b in zip(["dx", "dweight", "dtail"], g2, g1):
        if b.numel():
            assert_close(a, b, name)


@pytest.mark.parametrize("impl,channels", [("reference", 16), ("cpu", 16), ("cpu", 13)])
def test_pieces_with_carried_tails_give_the_bits_of_one_pass(impl, channels):
    """Streaming and context parallelism cut a sequence anywhere; every output keeps its bits. (The
    reference only where each piece's size is a multiple of PyTorch's vector width, as the model's
    3 * H * K channels are: its SiLU rounds the leftover elements differently.)"""
    if impl == "cpu":
        needs_c()
    fn = cpu.short_conv if impl == "cpu" else reference.short_conv
    x, w, _ = make(2, 101, channels, 4, seed=5)
    whole, _ = fn(x, w)
    pieces, tail = [], None
    for a, b in ((0, 1), (1, 3), (3, 40), (40, 101)):
        y, tail = fn(x[:, a:b], w, tail)
        pieces.append(y)
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_dispatch_takes_the_reference_where_the_kernel_does_not_apply():
    needs_c()
    x, w, tail = make(1, 9, 4, 4)
    for args, kw in (((x.double(), w.double(), tail.double()), {}), ((x, w, tail), {"backend": "reference"})):
        y, _ = short_conv(*args, **kw)
        assert torch.equal(y, reference.short_conv(*args)[0])
    assert torch.equal(short_conv(x, w, tail)[0], cpu.short_conv(x, w, tail)[0])


def test_mismatched_shapes_are_refused():
    x, w, tail = make(1, 9, 4, 4)
    with pytest.raises(ValueError, match="short conv inputs do not match"):
        short_conv(x, w[:3], tail)
    with pytest.raises(ValueError, match="short conv inputs do not match"):
        short_conv(x, w, tail[:, :2])
