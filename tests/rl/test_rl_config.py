"""RL configs: the shipped ones load; every key is checked as a run config's are."""

from pathlib import Path

import pytest

from megabase.data import InputError
from megabase.rl.config import load_rl_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("rl-*.yaml")))
def test_shipped_rl_configs_load(name):
    cfg = load_rl_config(CONFIGS / name)
    assert cfg.checkpoint and cfg.prompt.regions and cfg.reward.motifs and cfg.asynchronous


@pytest.mark.parametrize("sets, message", [
    (["checkpoint=c", "prompt.fasta=f", "prompt.data=s", "prompt.regions=[chr1]"], "one source"),
    (["checkpoint=c", "prompt.data=s"], "prompt.regions must name at least one region"),
    (["checkpoint=c", "prompt.fasta=f", "reward.sites=[GGNNCC]"], "not a word of A/C/G/T"),
    (["checkpoint=c", "prompt.fasta=f", "reward.gc_min=0.8"], "reward.gc_min must be <="),
    (["checkpoint=c", "prompt.fasta=f", "lr=0"], r"lr must be within \(0, 1\)"),
    (["checkpoint=c", "prompt.fasta=f", "base=/"], "unknown key 'base'"),
    (["prompt.fasta=f"], "checkpoint is required"),
    # issue 40: lr=1e30 passed as "positive" and saved a policy 99% NaN; temperature=1e-300
    # made the sampling probabilities NaN (a RuntimeError traceback from the generator)
    (["checkpoint=c", "prompt.fasta=f", "lr=1e30"], r"lr must be within \(0, 1\), got 1e\+30"),
    (["checkpoint=c", "prompt.fasta=f", "lr=1"], r"lr must be within \(0, 1\)"),
    (["checkpoint=c", "prompt.fasta=f", "temperature=1e-300"], r"temperature must be within"),
    (["checkpoint=c", "prompt.fasta=f", "temperature=1e6"], r"temperature must be within"),
    (["checkpoint=c", "prompt.fasta=f", "reward.penalty=-1"], "reward.penalty must be 0 or more"),
    (["checkpoint=c", "prompt.fasta=f", "walk_segment=8"], "walk_segment must be at least 64"),
])
def test_bad_values_are_refused(sets, message):
    with pytest.raises(InputError, match=message):
        load_rl_config(None, sets)


def test_synchronous_means_no_batch_ahead():
    cfg = load_rl_config(None, ["checkpoint=c", "prompt.fasta=f", "asynchronous=false"])
    assert cfg.async_level == 0
