import math

import numpy as np
import pytest

from megabase.eval.bins import BinAccumulator, check_edges, default_edges


def test_default_edges_cover_the_window():
    assert default_edges(65_536) == [0, 1_000, 4_000, 16_000, 64_000, 65_536]
    assert default_edges(500) == [0, 500]
    assert default_edges(1_048_576)[-2:] == [512_000, 1_048_576]
    with pytest.raises(ValueError):
        check_edges([0, 10, 10])


def test_bin_arithmetic_with_known_nll():
    acc = BinAccumulator([0, 2, 5, 10])
    nll = np.arange(10, dtype=float)          # NLL i at context i
    scored = np.ones(10, bool)
    scored[3] = False                          # an N target: never counted
    repeat = np.zeros(10, bool)
    repeat[[6, 7]] = True
    acc.add_window(nll, scored, repeat)
    acc.add_window(np.full(4, 2.0), np.ones(4, bool), np.zeros(4, bool))  # a shorter window
    out = acc.summary(n_boot=0)
    b0, b1, b2 = out["bins"]
    assert (b0["context_lo"], b0["context_hi"]) == (0, 2)
    assert b0["n_tokens"] == 4 and b0["nats_per_base"] == pytest.approx((0 + 1 + 2 + 2) / 4)
    assert b1["n_tokens"] == 2 + 2 and b1["nats_per_base"] == pytest.approx((2 + 4 + 2 + 2) / 4)
    assert b2["n_tokens"] == 5 and b2["nats_per_base"] == pytest.approx(35 / 5)
    assert b2["repeat"]["n_tokens"] == 2 and b2["repeat"]["nats_per_base"] == pytest.approx(6.5)
    assert b2["unique"]["nats_per_base"] == pytest.approx((5 + 8 + 9) / 3)
    total = sum(range(10)) - 3 + 8
    assert out["overall"]["n_tokens"] == 13
    assert out["overall"]["nats_per_base"] == pytest.approx(total / 13)
    assert out["overall"]["bits_per_base"] == pytest.approx(total / 13 / math.log(2))
    assert out["overall"]["perplexity"] == pytest.approx(math.exp(total / 13))


def test_bootstrap_ci_brackets_the_estimate():
    rng = np.random.default_rng(0)
    acc = BinAccumulator([0, 100])
    for _ in range(50):
        acc.add_window(rng.normal(1.4, 0.3, 100), np.ones(100, bool), np.zeros(100, bool))
    overall = acc.summary(n_boot=500)["overall"]
    lo, hi = overall["bits_per_base_ci"]
    assert lo < overall["bits_per_base"] < hi and hi - lo < 0.05


def test_empty_bins_report_zero_tokens():
    acc = BinAccumulator([0, 10, 20])
    acc.add_window(np.ones(5), np.ones(5, bool), np.zeros(5, bool))
    assert acc.summary(n_boot=10)["bins"][1] == {
        "context_lo": 10, "context_hi": 20, "n_tokens": 0, "nats_per_base": None,
        "bits_per_base": None, "perplexity": None,
        "unique": {"n_tokens": 0, "nats_per_base": None, "bits_per_base": None, "perplexity": None},
        "repeat": {"n_tokens": 0, "nats_per_base": None, "bits_per_base": None, "perplexity": None},
        "bits_per_base_ci": [None, None], "n_units": 0}


def test_paired_gain_cancels_what_both_curves_share():
    """Windows differ a lot in difficulty, the model beats the control by a constant 0.01 bits:
    the separate CIs overlap, the paired one excludes zero."""
    from megabase.eval.bins import BinAccumulator, paired_gain

    rng = np.random.default_rng(0)
    model, control = BinAccumulator([0, 100, 200]), BinAccumulator([0, 100, 200])
    repeat = np.zeros(200, bool)
    repeat[::2] = True
    for _ in range(30):
        level = rng.uniform(1.0, 1.6)
        nll = np.full(200, level) + rng.normal(0, 0.01, 200)
        gain = np.where(np.arange(200) >= 100, 0.01 * np.log(2), 0.0)
        model.add_window(nll, np.ones(200, bool), repeat)
        control.add_window(nll + gain, np.ones(200, bool), repeat)
    rows = paired_gain(model, control, n_boot=200)
    assert rows[0]["all"]["gain_bits_per_base"] == pytest.approx(0.0, abs=1e-12)
    far = rows[1]["all"]
    assert far["gain_bits_per_base"] == pytest.approx(0.01)
    assert 0 < far["ci"][0] <= 0.01 <= far["ci"][1]
    assert rows[1]["repeat"]["n_tokens"] == rows[1]["unique"]["n_tokens"] == 30 * 50
    a, b = model.summary(200)["bins"][1], control.summary(200)["bins"][1]
    assert a["bits_per_base_ci"][1] > b["bits_per_base_ci"][0]  # the unpaired CIs overlap


def test_blocks_are_the_units_and_change_no_value():
    """Blocks of a window split its sums, never its numbers: every bits/base equals the whole-
    window accumulator's, each bin's CI resamples only the blocks that scored a base in it, and a
    ragged last block is a unit of its own."""
    from megabase.eval.bins import paired_gain

    rng = np.random.default_rng(1)
    whole, blocks = BinAccumulator([0, 100, 1000, 2500]), BinAccumulator([0, 100, 1000, 2500], block=300)
    other = BinAccumulator([0, 100, 1000, 2500], block=300)
    for n in (2500, 2500, 1234):
        nll, repeat = rng.gamma(2.0, 0.7, n), rng.random(n) < 0.4
        scored = rng.random(n) < 0.95
        whole.add_window(nll, scored, repeat)
        blocks.add_window(nll, scored, repeat)
        other.add_window(nll + 0.1 * (np.arange(n) >= 1000), scored, repeat)
    a, b = whole.summary(n_boot=200), blocks.summary(n_boot=200)
    for x, y in zip(a["bins"] + [a["overall"]], b["bins"] + [b["overall"]]):
        assert x["n_tokens"] == y["n_tokens"] and x["bits_per_base"] == pytest.approx(y["bits_per_base"], rel=1e-12)
    assert a["ci_unit"] == {"kind": "window", "n_units": 3, "n_windows": 3}
    assert b["ci_unit"] == {"kind": "block", "bases": 300, "n_units": 9 + 9 + 5, "n_windows": 3}
    # bin [1000, 2500): blocks 3..8 of the long windows (block 3 starts at 900) and 3..4 of the short
    assert [row["n_units"] for row in b["bins"]] == [3, 3 * 4, 6 + 6 + 2]
    lo, hi = b["bins"][2]["bits_per_base_ci"]
    assert lo < b["bins"][2]["bits_per_base"] < hi
    gain = paired_gain(blocks, other, n_boot=200)
    assert gain[2]["all"]["gain_bits_per_base"] == pytest.approx(0.1 / np.log(2))
    assert gain[2]["all"]["n_units"] == 14 and gain[0]["all"]["ci"] == [0.0, 0.0]
    lo, hi = gain[2]["all"]["ci"]
    assert lo == pytest.approx(hi) == pytest.approx(0.1 / np.log(2))
