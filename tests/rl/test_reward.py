"""Rewards: JASPAR PWM hits on both strands, synthesis constraints, a user's callable; on real
human DNA the motif reward is sparse but not absent, and the held-out matrices agree with it."""

import numpy as np
import pytest

from megabase.data import InputError
from megabase.rl.config import RewardConfig
from megabase.rl.reward import (CallableReward, MotifReward, diversity, gc_violations, long_runs,
                                repeats, shared_words, site_count)


@pytest.fixture(scope="module")
def ctcf():
    return MotifReward(RewardConfig())


def test_best_word_scores_one_on_either_strand(ctcf):
    pwm = ctcf.pwms[0]
    best = pwm.log_odds.argmax(1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (3, 120))
    x[0, 20 : 20 + pwm.width] = best
    x[1, 70 : 70 + pwm.width] = 3 - best[::-1]  # its reverse complement
    rel = pwm.relative_scores(x)
    assert rel.max(1)[:2] == pytest.approx([1.0, 1.0])
    assert rel.argmax(1)[:2].tolist() == [20, 70]
    assert 0 <= rel.min() and rel.max() <= 1 + 1e-12
    assert (ctcf.parts(x)["motif_hits"][:2] >= 1).all()


def test_constraints():
    at = np.zeros((1, 100), dtype=np.int64)  # poly-A: GC 0 everywhere, one long run
    at[0, 50:] = 3
    assert gc_violations(at, 50, 0.3, 0.7).item() == pytest.approx(2.0)
    assert long_runs(at, 6).item() == 2
    bsai = np.array([[2, 2, 3, 1, 3, 1, 0, 0, 2, 0, 2, 0, 1, 1]])  # GGTCTC AA GAGACC
    assert site_count(bsai, ["GGTCTC"]).item() == 2
    assert site_count(bsai, ["CGTCTC"]).item() == 0


def test_sites_do_not_overlap(ctcf):
    """A site takes its bases: the best word written twice, overlapping by half, is one site;
    written twice apart, two."""
    pwm = ctcf.pwms[0]
    best = pwm.log_odds.argmax(1)
    w = pwm.width
    x = np.random.default_rng(1).integers(0, 4, (2, 3 * w))
    x[0, 0:w] = best
    x[0, w // 2 : w // 2 + w] = best  # overwrites the second half: only this copy stays whole
    x[1, 0:w] = best
    x[1, w + 3 : 2 * w + 3] = best
    assert pwm.hits(x, 0.99).tolist() == [1, 2]


def test_repeats_count_direct_and_inverted_copies():
    rng = np.random.default_rng(2)
    unit = rng.integers(0, 4, 16)
    x = rng.integers(0, 4, (3, 100))
    assert repeats(x, 12).tolist() == [0, 0, 0]  # 89 random 12-mers: none twice
    x[1, 10:26] = unit
    x[1, 60:76] = unit  # a direct repeat of 16: five 12-mers again
    x[2, 10:26] = unit
    x[2, 60:76] = 3 - unit[::-1]  # an inverted repeat
    assert repeats(x, 12).tolist() == [0, 5, 5]
    tandem = np.tile(unit, 7)[None, :100]
    assert repeats(tandem, 12).item() == 100 - 12 + 1 - 16  # all but the first period
    assert repeats(x, 0).tolist() == [0, 0, 0]


def test_reward_is_hits_minus_penalised_violations(ctcf):
    x = np.zeros((1, 100), dtype=np.int64)
    parts = ctcf.parts(x)
    expect = parts["motif_hits"] - (parts["gc_violations"] + parts["long_runs"] + parts["sites"]
                                    + parts["repeats"])
    assert ctcf(x) == pytest.approx(expect) and ctcf(x).item() < 0
    assert parts["repeats"].item() == 100 - 12  # poly-A: one 12-mer, 89 times


def test_on_human_dna(hsap_store, ctcf):
    tokens = np.asarray(hsap_store.tokens(hsap_store.names[0]))
    starts = [s for s in range(0, len(tokens) - 200, 2003) if (tokens[s : s + 200] < 4).all()][:400]
    x = np.stack([tokens[s : s + 200] for s in starts]).astype(np.int64)
    hits = ctcf.parts(x)["motif_hits"]
    assert 0.02 < hits.mean() < 2  # sparse, not absent: something for RL to raise
    held = MotifReward(RewardConfig(), ["MA0139.1"], 0.85).parts(x)["motif_hits"]
    assert held.sum() >= 5 and hits[held > 0].mean() > 2 * hits.mean()  # it sees the same sites
    d = diversity(x)
    assert 0.6 < d["hamming"] < 0.8 and d["distinct_kmers"] > 0.5


def test_a_callable_reward_from_a_file(tmp_path):
    (tmp_path / "gc.py").write_text("def reward(seqs):\n    return [s.count('G') for s in seqs]\n")
    r = CallableReward("gc.py:reward", tmp_path)
    assert r(np.array([[2, 2, 0], [0, 0, 0]])).tolist() == [2.0, 0.0]


@pytest.mark.parametrize("code, spec, message", [
    ("def reward(seqs):\n    return [1.0]\n", "r.py:reward", "one finite number per sequence"),
    ("def reward(seqs):\n    raise KeyError('x')\n", "r.py:reward", "raised KeyError"),
    ("def reward(seqs):\n    return 'abc'\n", "r.py:reward", "must return numbers|one finite"),
    ("import nonexistent_module_xyz\n", "r.py:reward", "could not be loaded"),
    ("x = 1\n", "r.py:reward", "has no function 'reward'"),
    ("", "missing.py:reward", "file not found"),
    ("", "no_colon", "expected module:function"),
    # issue 40: sys.exit(0) at import ended `megabase rl` with 0 and no output at all
    ("import sys\nsys.exit(0)\n", "r.py:reward", r"r\.py called sys\.exit\(0\) when imported"),
    ("raise SystemExit('bye')\n", "r.py:reward", r"r\.py called sys\.exit\('bye'\) when imported"),
    ("import sys\ndef reward(seqs):\n    sys.exit(3)\n", "r.py:reward",
     r"'r\.py:reward' called sys\.exit\(3\) when called"),
])
def test_bad_reward_code_is_one_line(tmp_path, code, spec, message):
    (tmp_path / "r.py").write_text(code)
    with pytest.raises(InputError, match=message) as info:
        CallableReward(spec, tmp_path)(np.zeros((2, 10), dtype=np.int64))
    assert "\n" not in str(info.value)


def test_unknown_motif_is_refused():
    with pytest.raises(InputError, match="MA9999.9"):
        MotifReward(RewardConfig(motifs=["MA9999.9"]))


@pytest.mark.parametrize("values, message", [
    # issue 40: a NaN reward's message quoted the count ("got 2"), not the value
    ("[0.0, float('nan'), 0.0]", "got nan for sequence 2 of 3"),
    # +-1e39 is finite in float64 and infinite in float32, where rewards travel and train
    ("[1e39, 0.0, -1e39]", r"got 1e\+39 for sequence 1 of 3 \(2 such values\)"),
    ("[0.0, 0.0, -3.5e38]", r"got -3\.5e\+38 for sequence 3 of 3"),
])
def test_a_reward_that_is_not_finite_in_float32_is_named(tmp_path, values, message):
    (tmp_path / "r.py").write_text(f"def reward(seqs):\n    return {values}\n")
    with pytest.raises(InputError, match=message) as info:
        CallableReward("r.py:reward", tmp_path)(np.zeros((3, 10), dtype=np.int64))
    assert "'r.py:reward'" in str(info.value) and "\n" not in str(info.value)


def test_the_largest_float32_reward_is_kept(tmp_path):
    (tmp_path / "r.py").write_text("def reward(seqs):\n    return [3.4e38, -3.4e38]\n")
    out = CallableReward("r.py:reward", tmp_path)(np.zeros((2, 10), dtype=np.int64))
    assert out.tolist() == [3.4e38, -3.4e38]


def test_words_shared_with_the_neighbourhood_on_either_strand(hsap_store):
    """Designs after 131,072 bases of human chr22: a 12-base word planted from the neighbourhood,
    or its reverse complement, is found where it is; a word the neighbourhood holds only across
    an N is not a shared word."""
    context = np.array(hsap_store.tokens("chr22")[20_000_000 : 20_000_000 + 131_072])
    assert 0.05 < (context >= 4).mean() < 0.95  # real bases and N
    k = 12
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, (4, 100))
    clean = shared_words(x, context, k)
    # 356 random 12-mers, each matching one of < 2 x 131k (word, strand) of 4^12 by chance: ~6
    assert clean.sum() < 20
    real = np.flatnonzero(np.convolve(context < 4, np.ones(k), "valid") == k)
    word = context[real[len(real) // 2] :][:k].astype(np.int64)
    x[1, 40 : 40 + k] = word
    x[2, 10 : 10 + k] = 3 - word[::-1]  # the other strand
    got = shared_words(x, context, k)
    assert got[1] >= clean[1] + 1 and got[2] >= clean[2] + 1
    assert got[0] == clean[0] and got[3] == clean[3]
    fresh = rng.integers(0, 4, (1, k))
    assert shared_words(fresh, context, k).item() == 0
    planted = context.copy()
    planted[500 : 500 + k] = fresh[0]
    assert shared_words(fresh, planted, k).item() == 1
    planted[505] = 4  # N
    assert shared_words(fresh, planted, k).item() == 0
    reward = MotifReward(RewardConfig(neighbourhood_k=k))
    parts = reward.parts(x, context)
    assert parts["neighbourhood_words"].tolist() == got.tolist()
    assert (reward(x, context) - reward(x) == -got).all()  # one penalty per shared position
    assert "neighbourhood_words" not in MotifReward(RewardConfig()).parts(x, context)
