"""The segment-walked training step against the full-sequence backward, on real DNA."""

import pytest
import torch

from megabase.model.walk import segment_bounds, walked_forward
from megabase.pipeline.memory import apply_recompute
from tests.kernels.tolerances import assert_close, rel_rms
from tests.model.conftest import live_model

STAGE = {"dsa_stage": {"summary": "max", "start": 0, "block": 16, "blocks": 4, "local": 64,
                       "seed": 8}}


def _model(overrides, knobs=()):
    model = live_model("debug", **overrides)
    for knob in knobs:
        knob(model)
    return model


def _step(model, x, segment=None, batch_rows=1):
    """Loss output and every parameter's gradient of one step over ``x [B, T + 1]``."""
    model.zero_grad(set_to_none=True)
    ids, targets = x[:, :-1], x[:, 1:]
    mask = targets < 4
    if segment is None:
        out = model(ids, targets, loss_mask=mask)
    else:
        out = walked_forward(model, ids, targets, loss_mask=mask, segment=segment)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(full, walked, what):
    (out0, grads0), (out, grads) = full, walked
    assert abs(float(out.loss.detach()) - float(out0.loss.detach())) <= 1e-6 * abs(float(out0.loss.detach())), what
    assert abs(float(out.aux_loss) - float(out0.aux_loss)) <= 1e-6 * max(abs(float(out0.aux_loss)), 1e-6)
    assert out.n_tokens == out0.n_tokens
    assert torch.equal(out.expert_load, out0.expert_load), what
    assert torch.equal(out.mask, out0.mask)
    assert_close(out.nll, out0.nll, f"{what}: nll")
    if out0.indexer_kl is not None:
        assert_close(out.indexer_kl, out0.indexer_kl, f"{what}: indexer KL")
    for a, b in zip(out.routing, out0.routing):
        assert torch.equal(a, b), f"{what}: routing"
    assert grads.keys() == grads0.keys(), what
    for name in grads0:
        assert rel_rms(grads[name], grads0[name]) <= 1e-5, f"{what}: grad of {name}"


def test_segment_bounds_cover_the_window_with_a_ragged_last_segment():
    assert segment_bounds(2500, 1024) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert segment_bounds(1024, 1024) == [(0, 1024)]
    with pytest.raises(ValueError, match="at least one token"):
        segment_bounds(10, 0)


@pytest.mark.parametrize("length,segment,overrides", [
    (2500, 1024, {}),  # ragged last segment
    (2001, 700, {}),  # odd lengths, segments off any tile
    (1500, 1500, {}),  # one segment: the walk is the plain step
    (3000, 1024, STAGE),  # the DSA candidate stage from position 0, its seeds across borders
    (2500, 800, {"seq_aux_weight": 0.01}),  # the balance loss reads the window's counts
])
def test_walked_gradients_equal_the_full_backward(real_tokens, length, segment, overrides):
    x = real_tokens[:, : length + 1]
    full = _step(_model(overrides), x)
    walked = _step(_model(overrides), x, segment)
    _assert_same_step(full, walked, f"T={length}, segment={segment}, {overrides}")


def test_a_batch_of_windows_is_walked_row_for_row(real_tokens):
    x = torch.cat([real_tokens[:, :1801], real_tokens[:, 5000:6801]])
    overrides = {"seq_aux_weight": 0.01}
    _assert_same_step(_step(_model(overrides), x), _step(_model(overrides), x, 640), "B=2")


@pytest.mark.parametrize("mode", ["layer", "selective"])
def test_recompute_inside_the_walk_keeps_the_gradients(real_tokens, mode):
    x = real_tokens[:, :2501]
    full = _step(_model(STAGE), x)
    walked = _step(_model(STAGE, [lambda m: apply_recompute(m, mode)]), x, 1024)
    _assert_same_step(full, walked, f"recompute={mode}")


def test_between_runs_after_every_pass_and_the_heap_trim_keeps_the_gradients(real_tokens):
    """The trainer's ``between`` (progress, and on a CPU the heap handed back) runs once after
    each segment's forward and each one's backward, and changes nothing computed."""
    from megabase.pipeline.memory import heap_trimmer

    x = real_tokens[:, :2501]
    trim, calls = heap_trimmer(), []

    def between():
        calls.append(len(calls))
        if trim is not None:
            trim()

    model = _model(STAGE)
    model.zero_grad(set_to_none=True)
    out = walked_forward(model, x[:, :-1], x[:, 1:], x[:, 1:] < 4, 1024, between=between)
    assert len(calls) == 3  # the forward's three segments so far
    out.loss.backward()
    assert len(calls) == 6
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_same_step(_step(_model(STAGE), x), (out, grads), "between")


def test_the_dense_warmup_is_not_walked(real_tokens):
    model = _model({})
    x = real_tokens[:, :1001]
    with pytest.raises(ValueError, match="dense indexer warm-up"):
        walked_forward(model, x[:, :-1], x[:, 1:], segment=256,
                       ctx=model.context(dense_warmup=True))


def test_along_a_20_step_training_run_every_walked_step_equals_the_reference(real_tokens):
    """20 AdamW steps of the reference (the whole-window backward) over 2,048-base windows of real
    DNA; at every step, from the same weights, the walked step (segments of 640: ragged) gives
    the same loss to 1e-6 and the same gradients. (Two separate runs cannot be compared this way:
    fp32 round-off of any reordering, the loss_chunk knob's included, grows to ~1e-3 of the loss
    within 12 steps at this learning rate, for the whole-window backward too.)"""
    model = live_model("debug", seq_aux_weight=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(20):
        x = real_tokens[:, step * 900 : step * 900 + 2049]
        walked = _step(model, x, 640)
        full = _step(model, x)
        _assert_same_step(full, walked, f"step {step}")
        opt.step()
        model.update_moe_bias(full[0].expert_load, full[0].expert_margins)


def test_kept_selections_come_back_from_their_file_as_they_went():
    from megabase.model.walk import Kept

    kept = Kept()
    gen = torch.Generator().manual_seed(5)
    parts = {(1, "select", i): torch.randint(-1, 3_000_000, (2, 37 + i, 9), generator=gen)
             for i in range(4)}
    for key, idx in parts.items():
        kept.put(key, idx)
    assert kept.size == sum(t.numel() * 4 for t in parts.values())
    for key in reversed(list(parts)):  # the backward takes them in reverse
        got = kept.take(key)
        assert got.dtype == torch.int64 and torch.equal(got, parts[key])
    assert not kept.places
    kept.close()


def test_a_walked_step_lets_go_of_each_pass_when_it_ends(real_tokens, monkeypatch):
    """A pass's segment views hold what their calls returned (for a recompute's replay): the kept
    selections, borders, prefix views. When the pass ends they hold nothing, whatever still
    references the views: a cycle through the autograd graph (the prefix node once kept its
    segment) held every backward pass's selections until the garbage collector ran, 8.6 GB at
    1,048,576 tokens."""
    import gc
    import weakref

    from megabase.model import walk

    made = []
    init = walk.Segment.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(walk.Segment, "__init__", counted)
    model = _model(STAGE)
    gc.disable()  # what a cycle keeps stays kept: the views must hold nothing by then
    try:
        out, _ = _step(model, real_tokens[:, :3001], 1024)
        del out
        holding = [ref() for ref in made if ref() is not None and (ref().calls or ref().sinks)]
    finally:
        gc.enable()
    assert len(made) == 2 * 3 * 5, "3 segments, twice, each with its 4 layers' views"
    assert not holding, f"{len(holding)} segment views still hold their calls after the step"
