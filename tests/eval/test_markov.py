import math

import numpy as np
import pytest

from megabase.data import tokenize
from megabase.eval.markov import MarkovModel


def direct_order0_bits(train: np.ndarray, evaluate: np.ndarray) -> float:
    counts = np.bincount(train[train < 4], minlength=4).astype(float)
    p = (counts + 0.5) / (counts.sum() + 2.0)
    target = np.bincount(evaluate[evaluate < 4], minlength=4)
    return float(-(target * np.log(p)).sum() / target.sum() / math.log(2))


def test_order0_matches_the_base_counts_of_umaydis(umaydis_store):
    train = np.concatenate([np.array(umaydis_store.tokens(c)) for c in ("chr01", "chr02")])
    evaluate = np.array(umaydis_store.tokens("chr22"))
    lp = MarkovModel(0).fit(train).log_probs(evaluate)
    bits = -np.nanmean(lp) / math.log(2)
    assert bits == pytest.approx(direct_order0_bits(train, evaluate), rel=1e-9)
    assert 1.9 < bits < 2.0


def test_order0_matches_on_a_region_split_of_human_chr22(hsap_store):
    tokens = hsap_store.tokens("chr22")
    train, evaluate = np.array(tokens[:35_000_000]), np.array(tokens[35_000_000:])
    lp = MarkovModel(0).fit(train).log_probs(evaluate)
    assert np.isnan(lp[evaluate >= 4]).all() and not np.isnan(lp[evaluate < 4]).any()
    bits = -np.nanmean(lp) / math.log(2)
    assert bits == pytest.approx(direct_order0_bits(train, evaluate), rel=1e-9)


def test_contexts_never_cross_n_or_the_window_start():
    model = MarkovModel(2).fit(tokenize("ACGACGACGACG"))
    # after "AC", G always follows; the first two bases have no order-2 context
    lp = model.log_probs(tokenize("ACGNCG"))
    assert lp[2] == pytest.approx(math.log((4 + 0.5) / (4 + 2.0)))
    assert np.isnan(lp[3])
    # "C" right after N has no context; "G" after "C" uses order 1 (C->G seen 4 times of 4)
    assert lp[4] == pytest.approx(math.log((4 + 0.5) / (12 + 2.0)))
    assert lp[5] == pytest.approx(math.log((4 + 0.5) / (4 + 2.0)))


@pytest.mark.parametrize("order", range(0, 13))
def test_every_order_up_to_12_runs_on_real_sequence(bundled_store, order):
    train = np.array(bundled_store.tokens("chr01")[:400_000])
    lp = MarkovModel(order).fit(train).log_probs(np.array(bundled_store.tokens("chr22")[:50_000]))
    assert np.isfinite(lp[~np.isnan(lp)]).all() and (lp[~np.isnan(lp)] < 0).all()
