"""Staleness bookkeeping: a group's lag is the trainer's version minus its oldest base's version;
past max_off_policy_steps it is dropped; every group's lag and policy count is counted."""

import pytest
import torch

from megabase.rl.rollout import Rollout, Staleness
from megabase.rl.trainer import clean_bases


def group(versions):
    v = torch.tensor(versions, dtype=torch.int32)
    G, L = v.shape
    return Rollout(0, 0, torch.zeros(G, 2 + L, dtype=torch.long), 2, torch.zeros(G, L), v, None,
                   torch.zeros(G))


def test_lag_drops_and_counts():
    s = Staleness(max_off_policy_steps=2)
    assert s.admit(group([[3, 3, 4], [3, 4, 4]]), trainer_version=4)  # lag 1, two policies
    assert s.admit(group([[2, 2, 2], [2, 2, 2]]), trainer_version=4)  # lag 2: still in
    assert not s.admit(group([[1, 2, 3], [1, 1, 1]]), trainer_version=4)  # lag 3: dropped
    assert s.summary() == {"lag_histogram": {1: 1, 2: 1, 3: 1},
                           "policies_histogram": {1: 1, 2: 1, 3: 1}, "dropped": 1, "kept": 2}


def test_a_group_from_the_future_is_a_bug():
    with pytest.raises(ValueError, match="version 5"):
        Staleness(8).admit(group([[5, 5]]), trainer_version=4)


def test_clean_bases_need_the_whole_prefix_at_the_trainers_version():
    v = torch.tensor([[4, 4, 4], [3, 4, 4], [4, 4, 5]])
    kept_cache = clean_bases(v, 4, recompute_state=False)
    assert kept_cache.tolist() == [[True] * 3, [False] * 3, [True, True, False]]
    recomputed = clean_bases(v, 4, recompute_state=True)
    assert recomputed.tolist() == [[True] * 3, [False, True, True], [True, True, False]]
