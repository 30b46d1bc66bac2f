import copy

import numpy as np
import pytest
import torch
import yaml


@pytest.fixture(scope="module")
def policy(checkpoint):
    from megabase.infer.common import load_model

    return load_model(checkpoint)


@pytest.fixture(scope="module")
def human_prompts(hsap_store):
    """Two real 96-base windows of human chr22 (no N)."""
    tokens = np.asarray(hsap_store.tokens(hsap_store.names[0]))
    starts = [s for s in range(0, len(tokens) - 96, 9973) if (tokens[s : s + 96] < 4).all()]
    return [tokens[s : s + 96].copy() for s in starts[:2]]


@pytest.fixture(scope="module")
def sample():
    """``sample(model, prompts, dtype, group, length, seed)`` -> groups decoded as one batch."""
    return _sample


def _sample(policy, prompts, dtype="fp32", group=3, length=48, seed=0):
    from megabase.rl.config import RLConfig
    from megabase.rl.generator import WeightChannel, generator_model, sample_batch

    cfg = RLConfig(checkpoint="-", group_size=group, sample_length=length, generator_dtype=dtype)
    gen_model = generator_model(copy.deepcopy(policy), cfg)
    channel = WeightChannel(policy)
    groups, _ = sample_batch(gen_model, prompts, cfg, 0, channel, 0,
                             torch.Generator().manual_seed(seed))
    return groups


@pytest.fixture(scope="module")
def config(tmp_path_factory, checkpoint, bundled_store):
    """``config(name, **overrides)`` -> the path of an RL config on the debug checkpoint with
    prompts of the bundled genome (dotted keys reach into sections)."""
    root = tmp_path_factory.mktemp("rl")

    def write(name="rl.yaml", **over):
        cfg = {"checkpoint": str(checkpoint), "out": str(root / "out"),
               "prompt": {"data": str(bundled_store.path), "regions": ["chr01:1-200,000"],
                          "length": 64},
               "steps": 3, "group_size": 3, "prompts_per_step": 2, "sample_length": 24,
               "reward": {"threshold": 0.7}, "tracking_uri": f"sqlite:///{root / 'mlflow.db'}"}
        if "out" in over:
            over["out"] = str(root / over["out"])
        for key, value in over.items():
            node = cfg
            *path, last = key.split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        path = root / name
        path.write_text(yaml.safe_dump(cfg))
        return path

    return write
