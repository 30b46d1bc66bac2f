"""The copy-model reference: its C kernel against the plain-Python definition, and what it must
do on real DNA (a planted second copy nearly free on either strand, nothing from i.i.d. bases)."""

import json
import math

import numpy as np
import pytest

from megabase.eval.copymodel import (
    CopyModel, CopySpec, initial_state, reference_nll, score_window,
)
from megabase.eval.markov import MarkovModel
from megabase.eval.score import truncated
from megabase.pipeline.cli import main

LN2 = math.log(2)


def _planted(rng, n):
    """Random bases holding a forward copy, a reverse-complement copy and a few Ns."""
    a = rng.integers(0, 4, n).astype(np.uint8)
    if n > 400:
        a[n // 2 : n // 2 + 120] = a[20:140]
        a[n // 3 : n // 3 + 90] = (3 - a[250:160:-1])
        a[rng.integers(0, n, 6)] = 4
    return a


@pytest.mark.parametrize("n", [1, 7, 301, 2_049])
@pytest.mark.parametrize("seeds", [(4,), (5, 8, 11)])
def test_kernel_equals_the_reference(n, seeds):
    rng = np.random.default_rng(n)
    spec = CopySpec(orders=(1, 3), seeds=seeds).check()
    tokens = _planted(rng, n)
    chains = MarkovModel(3).fit(rng.integers(0, 4, 3_000).astype(np.uint8))
    (w1, c1), (w2, c2) = initial_state(spec), initial_state(spec)
    s1, s2 = np.zeros(3, np.int64), np.zeros(3, np.int64)
    fast = score_window(tokens, chains, spec, w1, c1, s1)
    slow = reference_nll(tokens, chains, spec, w2, c2, s2)
    assert np.array_equal(np.isnan(fast), tokens >= 4) and np.array_equal(np.isnan(slow), tokens >= 4)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(w1, w2, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(s1, s2)
    if n > 400:
        assert s1[0] > 0 and s1[2] > 0  # copies were found and followed


def test_one_chain_unmixed_is_the_markov_baseline(umaydis_store):
    """With one chain, a mixer that does not learn and seeds that never match, the mixture is the
    chain's own estimate, whose normaliser the kernel never computes."""
    train = np.array(umaydis_store.tokens("chr01")[:200_000])
    window = np.array(umaydis_store.tokens("chr22")[:5_000])
    window[100:103] = 4
    spec = CopySpec(orders=(6,), seeds=(32,), lr=0.0).check()
    model = CopyModel(spec)
    model.markov = MarkovModel(6).fit(train)
    model.weights, model.conf = initial_state(spec)
    np.testing.assert_allclose(model.nll(window), -model.markov.log_probs(window), rtol=1e-12,
                               equal_nan=True)


@pytest.fixture(scope="module")
def human(hsap_store):
    """The copy model fitted on 1 Mb of human chr22, and 6 kb of real bases held out from it."""
    seq = np.array(hsap_store.tokens("chr22")[30_000_000:31_200_000])
    seq = seq[seq < 4]
    model = CopyModel(CopySpec(orders=(2, 4, 8))).fit([seq[:-10_000]])
    return model, seq[-6_000:]


@pytest.mark.parametrize("strand", ["forward", "reverse complement"])
def test_a_planted_second_copy_is_nearly_free(human, strand):
    model, held = human
    first = held[:2_000]
    second = first if strand == "forward" else (3 - first)[::-1]
    nll = model.nll(np.concatenate([held[2_000:6_000], first, second]))
    first_bits = nll[4_000:6_000].mean() / LN2
    second_bits = nll[6_000:].mean() / LN2
    assert first_bits > 1.5 and second_bits < 0.1, (first_bits, second_bits)
    mutated = second.copy()
    at = np.random.default_rng(0).choice(2_000, 100, replace=False)
    mutated[at] = (mutated[at] + 1) % 4  # 5% substitutions: the match is followed through them
    nll = model.nll(np.concatenate([held[2_000:6_000], first, mutated]))
    assert nll[6_000:].mean() / LN2 < 0.8


def test_iid_bases_gain_nothing_from_context():
    rng = np.random.default_rng(3)
    model = CopyModel(CopySpec(orders=(2, 4, 8))).fit([rng.integers(0, 4, 300_000).astype(np.uint8)])
    window = rng.integers(0, 4, 16_384).astype(np.uint8)
    full, cut = model.nll(window), truncated(model.nll, 1_000)(window)
    bits = full[1_000:].mean() / LN2
    assert 1.99 < bits < 2.02
    assert abs(cut[1_000:].mean() / LN2 - bits) < 0.002


def test_every_window_starts_from_the_fitted_state(human):
    model, held = human
    before = model.weights.copy(), model.conf.copy()
    one = model.nll(held)
    model.nll(held[::-1].copy())
    np.testing.assert_array_equal(model.nll(held), one)
    assert np.array_equal(model.weights, before[0]) and np.array_equal(model.conf, before[1])


def test_baseline_copy_reports_its_gain_over_its_controls(bundled_store, tmp_path, capsys):
    out = tmp_path / "copy"
    assert main(["baseline", "copy", "--data", str(bundled_store.path), "--train", "chr01:1-300,000",
                 "--eval", "chr22:1-12,000", "--length", "6000", "--orders", "2,4",
                 "--controls", "1000", "--bootstrap", "20", "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["orders"] == [2, 4] and report["seeds"] == [12, 16, 20]
    assert report["n_windows"] == 2 and set(report["controls"]) == {"1000"}
    assert 1.8 < report["overall"]["bits_per_base"] < 2.05
    assert "copy model" in capsys.readouterr().out


@pytest.mark.parametrize("flags, text", [
    (["--copy-seeds", "40"], "--copy-seeds"),
    (["--copy-orders", "15"], "--copy-orders"),
    (["--copy-orders", "x"], "copy-orders"),
])
def test_bad_copy_options_are_refused_in_one_line(tracked, bundled_store, tmp_path, capsys,
                                                    flags, text):
    code = main(["evaluate", "--checkpoint", str(tracked["ckpt"]), "--data", str(bundled_store.path),
                 "--regions", "chr22:1-2,048", "--train", "chr01:1-10,000", "--quiet",
                 "--out", str(tmp_path / "e"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and text in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "e").exists()
