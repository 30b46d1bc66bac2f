"""Context parallelism in real processes (gloo): P ranks give the single-process loss and gradients.

Two references: the whole sequence in one pass, and the same process running the sequence in P
pieces with carried state (streaming). The loss must equal the whole pass's, and the gradient (as one
vector, relative RMS error) the split pass's, within the shared fp32 tolerance. Against the whole
pass the gradient may differ by what splitting alone costs: the DSA-only stack has no positional
signal, so its tied keys make gradient sums cancel, and any split moves them by ~1e-5 (measured in
the test; the hybrid and KDA stacks stay below 1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabase.model import build_model
from megabase.pipeline.distributed import make_layout, objective, parallelize
from tests.kernels.tolerances import RTOL_RMS, rel_rms

LENGTH = 16_384
STACKS = {  # debug preset: 4 layers of d_model 32, MoE FFNs, DSA top-k 32
    "kda": {"dsa_period": 0},
    "dsa": {"dsa_period": 1},
    "hybrid": {},
    "hybrid+balance": {"seq_aux_weight": 0.01},  # the MoE sequence-wise loss needs global counts
    # the DSA candidate stage from the start: its seeds read every earlier rank's tokens
    "hybrid+stage": {"dsa_stage": {"summary": "max", "start": 0, "block": 32, "blocks": 8,
                                   "local": 256, "seed": 12}},
}


def _loss_and_grads(model, ids, targets, layout=None):
    """``(loss, gradients)``: of one process, or summed over the ranks of ``layout``."""
    if layout is None:
        out = model(ids, targets)
        out.loss.backward()
        return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}
    ids, targets = layout.shard(ids, targets)
    step = objective(model(ids, targets), layout)
    (step.objective / layout.world).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    return float(step.lm_loss + step.aux_loss), grads


def _worker(rank: int, world: int, tokens, init: str, results, stacks=STACKS):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        layout = make_layout(context_parallel=world)
        for name, overrides in stacks.items():
            torch.manual_seed(0)
            model = parallelize(build_model("debug", **overrides), layout)
            loss, grads = _loss_and_grads(model, tokens[:, :-1], tokens[:, 1:], layout)
            if rank == 0:
                results[name] = (loss, grads)
    finally:
        dist.destroy_process_group()


def _segmented(model, tokens, pieces: int):
    """One process, the sequence in ``pieces`` with carried state: the same split as P ranks."""
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    state, lm, n, aux = model.init_state(), 0.0, 0, 0.0
    for part in torch.arange(ids.shape[1]).chunk(pieces):
        out = model(ids[:, part], targets[:, part], state=state)
        lm, n, aux = lm + out.lm_loss * out.n_tokens, n + out.n_tokens, aux + out.aux_loss / pieces
    (lm / n + aux).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sequence(bundled_store):
    """16,385 real bases of U. maydis chr01."""
    tokens, _ = bundled_store.fetch("chr01", 2_000_000, 2_000_000 + LENGTH + 1)
    return torch.from_numpy(tokens.astype(np.int64))[None]


def _single(sequence, stacks: dict) -> dict:
    out = {}
    for name, overrides in stacks.items():
        torch.manual_seed(0)
        out[name] = _loss_and_grads(build_model("debug", **overrides), sequence[:, :-1],
                                    sequence[:, 1:])
    return out


@pytest.fixture(scope="module")
def single(sequence):
    return _single(sequence, STACKS)


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def _check(stacks: dict, world: int, sequence, single: dict, tmp_path) -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world, sequence, f"file://{tmp_path / 'rendezvous'}", results, stacks),
             nprocs=world)
    tol = RTOL_RMS[torch.float32]
    for name, overrides in stacks.items():
        loss, grads = results[name]
        loss0, grads0 = single[name]
        assert abs(loss - loss0) <= tol * abs(loss0), (name, world, loss, loss0)
        assert grads.keys() == grads0.keys()
        split = 0.0
        if "seq_aux_weight" not in overrides:  # a piece alone cannot see the sequence's counts
            torch.manual_seed(0)
            pieces = _segmented(build_model("debug", **overrides), sequence, world)
            err = rel_rms(_flat(grads), _flat(pieces))
            assert err <= tol, f"{name}, P={world}: gradient vs the same split, error {err:.2e}"
            split = rel_rms(_flat(pieces), _flat(grads0))
        err = rel_rms(_flat(grads), _flat(grads0))
        assert err <= tol + split, f"{name}, P={world}: gradient error {err:.2e} (split {split:.2e})"
        if "dsa_period" not in overrides or overrides["dsa_period"]:  # the indexer learns across ranks too
            assert any(g.abs().sum() > 0 for k, g in grads.items() if "qi_proj" in k)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world, sequence, single, tmp_path):
    _check(STACKS, world, sequence, single, tmp_path)


def _feature_variants() -> dict:
    """The debug model with each feature switched from its default: every bool field flipped,
    every field that defaults to 0 set (so a flag added to a layer later is covered unasked)."""
    from dataclasses import fields

    from megabase.model import ModelConfig

    variants = {}
    for f in fields(ModelConfig):
        if isinstance(f.default, bool):
            variants[f.name] = {f.name: not f.default}
        elif isinstance(f.default, int) and f.default == 0:
            variants[f.name] = {f.name: 2}
        elif isinstance(f.default, float) and f.default == 0.0:
            variants[f.name] = {f.name: 0.01}
    variants["kda_conv=1"] = {"kda_conv": 1}
    return variants


def test_every_layer_feature_runs_the_same_under_context_parallelism(sequence, tmp_path):
    """The layers have one forward; under context parallelism it calls the sequence's exchange
    steps. A feature whose code skips them (a new border, a new prefix) fails here."""
    variants = _feature_variants()
    assert {"tie_embeddings", "kmer_embed", "dsa_kmer", "keep_recent", "seq_aux_weight"} <= set(variants)
    short = sequence[:, : 4096 + 1]
    _check(variants, 2, short, _single(short, variants), tmp_path)


def test_shards_must_divide_the_sequence():
    from megabase.pipeline.context_parallel import ContextParallel

    assert ContextParallel(1, 4).shard(16) == (4, 8)
    with pytest.raises(ValueError, match="does not split into 3"):
        ContextParallel(0, 3).shard(16)


def test_context_parallel_needs_a_process_group():
    with pytest.raises(ValueError, match="needs torch.distributed"):
        make_layout(context_parallel=2)


WALKS = {  # a window walked by the group in segments of P * segment tokens: (length, segment, model)
    "ragged": (2500, 512, {}),  # the last segment 452 tokens, 226 per rank
    "stage": (3000, 640, {"dsa_stage": {"summary": "max", "start": 0, "block": 16, "blocks": 4,
                                        "local": 64, "seed": 8}}),
    "balance": (2400, 400, {"seq_aux_weight": 0.01}),
}


def _walk_worker(rank: int, world: int, tokens, init: str, results, walks=WALKS):
    from megabase.model.walk import walked_forward
    from tests.model.conftest import live_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        layout = make_layout(context_parallel=world)
        for name, (length, segment, overrides) in walks.items():
            model = parallelize(live_model("debug", **overrides), layout)
            x = tokens[:, : length + 1]
            out = walked_forward(model, x[:, :-1], x[:, 1:], x[:, 1:] < 4, segment,
                                 model.context())
            step = objective(out, layout)
            (step.objective / layout.world).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            for g in grads.values():
                dist.all_reduce(g)
            if rank == 0:
                results[name] = (float(step.lm_loss + step.aux_loss), grads)
    finally:
        dist.destroy_process_group()


def test_a_window_walked_by_a_context_group_has_the_full_backward(sequence, tmp_path):
    """CP=2 inside the walk: each segment shared by the group, every parameter's gradient (summed
    over the ranks) within 1e-5 of the single-process full backward's, on real DNA."""
    from tests.model.conftest import live_model

    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_walk_worker, args=(2, sequence, f"file://{tmp_path / 'rendezvous'}", results),
             nprocs=2)
    for name, (length, _, overrides) in WALKS.items():
        model = live_model("debug", **overrides)
        x = sequence[:, : length + 1]
        out = model(x[:, :-1], x[:, 1:], loss_mask=x[:, 1:] < 4)
        out.loss.backward()
        loss, grads = results[name]
        assert abs(loss - float(out.loss)) <= 1e-6 * abs(float(out.loss)), name
        want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == want.keys(), name
        for n in want:
            assert rel_rms(grads[n], want[n]) <= 1e-5, f"{name}: grad of {n}"
