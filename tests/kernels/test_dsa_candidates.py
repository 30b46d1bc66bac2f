"""The DSA indexer's candidate stage: the C kernel against the PyTorch reference, the stage against
the exact indexer where they must agree, the block bounds, and the seeds against their definition.
"""

import dataclasses

import pytest
import torch

from megabase.kernels.dsa import Stage, block_summaries, cpu, dsa_indexer, reference, seed_keys
from megabase.kernels.dsa.reference import seed_keys as reference_seed_keys
from megabase.kernels.dsa.reference import summary_scores
from megabase.model import ModelConfig
from tests.kernels.test_dsa import make
from tests.kernels.tolerances import assert_close

# (B, T, HI, DI, topk, block, blocks, local): odd lengths, one and several index heads, topk
# above and below the local window, a stage that starts early and late in the sequence
SHAPES = [
    (2, 701, 2, 8, 12, 16, 4, 32),
    (1, 333, 1, 5, 40, 16, 3, 48),
    (1, 1000, 3, 6, 7, 32, 5, 33),
]


def same_seeds(a, b) -> bool:
    """Seed lists are -1 padded to the longest in a call: equal up to that padding."""
    width = max(a.shape[-1], b.shape[-1])
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1)  # noqa: E731
    return torch.equal(pad(a), pad(b))


def make_stage(**fields) -> Stage:
    """The model's default stage with ``fields`` changed."""
    return dataclasses.replace(ModelConfig().dsa_stage, **fields)


def stage_of(block, blocks, local, **kw):
    return make_stage(**{"summary": "max", "start": 0, "block": block, "blocks": blocks,
                    "local": local, "seed": 6, "seed_cap": 3, "carry": 4, **kw})


def tokens_with_copies(B, T, seed=0):
    """Random bases with a forward copy, a reverse-complement copy and an N."""
    gen = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 4, (B, T), generator=gen)
    n = T // 8
    tok[:, T // 2 : T // 2 + n] = tok[:, T // 8 : T // 8 + n]
    tok[:, 3 * T // 4 : 3 * T // 4 + n] = 3 - tok[:, T // 4 : T // 4 + n].flip(1)
    tok[:, T // 3] = 4
    return tok


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("summary", ["mean", "max"])
@pytest.mark.parametrize("weighted", [True, False])
def test_c_stage_selects_the_reference_keys(shape, summary, weighted):
    B, T, HI, DI, topk, block, blocks, local = shape
    _, _, _, qi, ki, wi = make(B, T, 1, 1, 4, HI, DI, topk, seed=31)
    wi = wi if weighted else None
    stage = stage_of(block, blocks, local, summary=summary)
    seeds = seed_keys(tokens_with_copies(B, T), 0, stage)
    for keep_recent in (0, 5):
        ref = reference.staged_indexer(qi, ki, wi, topk, stage, keep_recent=keep_recent,
                                       seeds=seeds)
        got = cpu.staged_indexer(qi, ki, wi, topk, stage, keep_recent=keep_recent, seeds=seeds)
        assert torch.equal(got, ref)
        assert (ref[:, stage.first_staged():] != dsa_indexer(qi, ki, wi, topk)[
            :, stage.first_staged():]).any()  # the stage is not the exact scan here


def test_the_stage_is_the_exact_indexer_before_its_first_position_and_with_an_offset():
    _, _, _, qi, ki, wi = make(1, 900, 1, 1, 4, 2, 8, 10, seed=32)
    stage = stage_of(16, 6, 64, start=500)
    assert stage.first_staged() == 500
    exact = dsa_indexer(qi, ki, wi, 10)
    full = dsa_indexer(qi, ki, wi, 10, stage=stage)
    assert torch.equal(full[:, :500], exact[:, :500]) and not torch.equal(full, exact)
    for offset in (333, 500, 777):  # streaming: queries from offset on, every earlier key
        tail = dsa_indexer(qi[:, offset:], ki, wi[:, offset:], 10, offset=offset, stage=stage)
        assert torch.equal(tail, full[:, offset:])


@pytest.mark.parametrize("impl", [reference.staged_indexer, cpu.staged_indexer])
def test_a_stage_whose_summary_is_exact_is_the_exact_indexer(impl):
    _, _, _, qi, ki, wi = make(1, 400, 2, 1, 4, 2, 6, 9, seed=41)
    stage = stage_of(16, 2, 32, summary="exact")  # from position 0: staged but for its summary
    exact = dsa_indexer(qi, ki, wi, 9)
    assert torch.equal(impl(qi, ki, wi, 9, stage), exact)
    assert torch.equal(dsa_indexer(qi, ki, wi, 9, stage=stage), exact)
    assert not torch.equal(impl(qi, ki, wi, 9, dataclasses.replace(stage, summary="max")), exact)


@pytest.mark.parametrize("impl", [reference.staged_indexer, cpu.staged_indexer])
def test_where_the_candidates_hold_the_exact_top_k_the_stage_selects_it(impl):
    """Every key scores 0 (ties go to the most recent keys: local ones) but one far spike. A
    seed reaches it; so does its block's max bound, while the mean of its block dilutes it."""
    T, topk = 600, 8
    gen = torch.Generator().manual_seed(33)
    qi = torch.rand(1, T, 1, 4, generator=gen) + 0.1  # positive queries
    ki = -torch.rand(1, T, 4, generator=gen)  # negative products: ReLU 0
    ki[:, 123] = 5.0  # one far key that every query would take
    exact = dsa_indexer(qi, ki, None, topk)
    seeds = torch.full((1, T, 2), -1, dtype=torch.int32)
    seeds[0, :, 1] = 123
    for summary in ("mean", "max"):
        stage = stage_of(16, 2, 64, seed=0, summary=summary)
        staged = slice(max(stage.first_staged(), 124), T)  # queries that see key 123
        assert torch.equal(impl(qi, ki, None, topk, stage, seeds=seeds)[:, staged],
                           exact[:, staged])
        without = impl(qi, ki, None, topk, stage, seeds=None)
        assert (exact[:, staged] == 123).any(-1).all()
        if summary == "max":
            assert torch.equal(without[:, staged], exact[:, staged])
        else:  # lost once its block is neither local nor among the 2 newest (all blocks tie at 0)
            assert not (without[:, 260:] == 123).any()


def test_quest_bound_holds_for_every_key_of_a_block_and_mean_is_the_mean_key_score():
    _, _, _, qi, ki, wi = make(1, 256, 1, 1, 4, 3, 6, 4, seed=34)  # weights of both signs
    qs = qi[:, :20] * 6**-0.5
    for summary in ("max", "mean"):
        stage = make_stage(summary=summary, block=32)
        summaries = block_summaries(ki, stage)
        assert_close(summaries, reference.block_summaries(ki, stage), f"{summary} summaries")
        scores = summary_scores(qs, wi[:, :20], summaries, summary)  # [1, 20, 8]
        keys = torch.relu(torch.einsum("bqhd,bkd->bqhk", qs, ki)) * wi[:, :20, :, None]
        true = keys.sum(2).reshape(1, 20, 8, 32)
        if summary == "max":
            assert (scores >= true.amax(-1) - 1e-5).all()
        else:
            mean = ki.reshape(1, 8, 32, 6).mean(2)
            expect = (torch.relu(torch.einsum("bqhd,bnd->bqhn", qs, mean)) * wi[:, :20, :, None]).sum(2)
            assert_close(scores, expect, "mean block scores")


def test_bad_stages_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        make_stage(block=24)
    with pytest.raises(ValueError, match="summary"):
        make_stage(summary="median")
    with pytest.raises(ValueError, match="seed length"):
        make_stage(seed=2)
    _, _, _, qi, ki, wi = make(1, 50, 1, 1, 4, 1, 4, 4, seed=35)
    with pytest.raises(ValueError, match="local window"):
        dsa_indexer(qi, ki, wi, 4, keep_recent=40, stage=make_stage(local=32))
    assert Stage.decode(make_stage(summary="mean", carry=7).encode()) == make_stage(summary="mean", carry=7)


@pytest.mark.parametrize("T,offset", [(700, 0), (701, 333), (90, 89)])
def test_c_seeds_equal_their_definition(T, offset):
    stage = stage_of(16, 4, 32)
    tok = tokens_with_copies(2, T, seed=T)
    assert torch.equal(seed_keys(tok, offset, stage), reference_seed_keys(tok, offset, stage))
    assert same_seeds(seed_keys(tok, offset, stage), seed_keys(tok, 0, stage)[:, offset:])


def test_seeds_point_at_the_base_after_a_forward_copy_and_before_a_reverse_one():
    k = 6
    stage = make_stage(start=0, block=16, blocks=1, local=16, seed=k, seed_cap=2, carry=3)
    gen = torch.Generator().manual_seed(36)
    tok = torch.randint(0, 4, (1, 400), generator=gen)
    tok[0, 300:330] = tok[0, 100:130]  # forward: 300 + i copies 100 + i
    tok[0, 200:230] = 3 - tok[0, 20:50].flip(0)  # reverse: 200 + i pairs with 49 - i
    seeds = seed_keys(tok, 0, stage)[0]
    t = 320  # predicts tok[321] = tok[121]: key 121 holds it
    assert 121 in seeds[t].tolist()
    t = 215  # predicts tok[216], the complement of tok[49 - 16] = tok[33]: key 33
    assert 33 in seeds[t].tolist()
    tok[0, 318] = (tok[0, 318] + 1) % 4  # a mismatch: k-mers ending 318..323 have no hit
    seeds = seed_keys(tok, 0, stage)[0]
    assert 121 in seeds[320].tolist()  # carried along the diagonal (hit at 317, 3 back)
    assert 124 not in seeds[323].tolist()  # 6 positions past the last hit: beyond the carry
    near = seed_keys(tok, 0, make_stage(start=0, block=16, blocks=1, local=512, seed=k))[0]
    assert (near < 0).all()  # inside the local window every hit is left out


def test_seed_cap_keeps_the_most_recent_occurrences():
    stage = make_stage(start=0, block=16, blocks=1, local=16, seed=4, seed_cap=2, carry=0)
    tok = torch.tensor([[0, 1, 2, 3] * 50])  # the same 4-mer every 4 positions
    seeds = seed_keys(tok, 0, stage)[0]
    assert torch.equal(seed_keys(tok, 0, stage), reference_seed_keys(tok, 0, stage))
    assert (seeds[199] < 0).all()  # its two newest occurrences (195, 191) are local
    # 0123 (its own reverse complement) at 3, 7 and 311; none in between (only A and G there)
    middle = 2 * torch.randint(0, 2, (1, 300), generator=torch.Generator().manual_seed(1))
    tok = torch.cat([tok[:, :8], middle, tok[:, :8]], dim=1)
    row = seed_keys(tok, 0, stage)[0, -1]
    # newest two: 311 (keys 312 and 307, local) and 7 (key 8 forward, 7 - 4 = 3 reverse); not 3
    assert set(row.tolist()) - {-1} == {3, 8}


# A model config whose DSA layers stage from the start at test lengths (first staged query: 143)
STAGED_MODEL = dict(dsa_stage=dict(summary="max", start=0, block=16, blocks=4, local=64, seed=8))
