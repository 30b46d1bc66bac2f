"""Growing key/value caches: what torch.cat would give, forks kept apart, appends in place."""

import torch

from megabase.model.cache import extend
from megabase.model.stream import fork


def pieces(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, 3, 4, generator=g) for n in lengths]


def test_extend_equals_concatenation():
    state, parts = {}, pieces(5, 1, 1, 700, 1, 2000, 3)
    for i, p in enumerate(parts):
        out = extend(state, "k", p)
        assert torch.equal(out, torch.cat(parts[: i + 1], dim=1))
        assert state["k"] is out


def test_single_steps_write_in_place():
    state = {}
    extend(state, "k", pieces(100)[0])
    buffer = state["k"].data_ptr()
    for step in pieces(*[1] * 50, seed=1):
        extend(state, "k", step)
    assert state["k"].data_ptr() == buffer  # no copy of the cached positions per step
    assert state["k"].shape[1] == 150


def test_forks_do_not_write_over_each_other():
    base, a, b, c = pieces(10, 4, 6, 2)
    state = {}
    extend(state, "k", base)
    left, right = fork([state])[0], fork([state])[0]
    extend(left, "k", a)  # owns the buffer's end: in place
    extend(right, "k", b)  # its view ends before what left wrote: a copy
    extend(state, "k", c)
    assert torch.equal(left["k"], torch.cat([base, a], 1))
    assert torch.equal(right["k"], torch.cat([base, b], 1))
    assert torch.equal(state["k"], torch.cat([base, c], 1))


def test_a_cache_that_needs_gradients_is_concatenated():
    base, new = pieces(3, 2)
    new.requires_grad_(True)
    state = {}
    extend(state, "k", base)
    out = extend(state, "k", new)
    out.sum().backward()
    assert torch.equal(new.grad, torch.ones_like(new))
