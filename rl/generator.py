"""The generator: decodes groups of samples from prompts through the cached state, takes new
weights between decoding steps, and tags every base with the policy version that sampled it.

Weights reach it through a channel with ``take(model, have) -> version or None``: a
:class:`WeightChannel` in one process (the synchronous loop), or the link to the trainer's rank
(:class:`megabase.rl.remote.RemoteWeights`). Samples in flight keep their cache (what prime-rl
does: the old keys and states, new weights from here on) or, with ``recompute_state``, re-read
their prefix under the new weights.
"""

from __future__ import annotations

import copy as copying
import time

import numpy as np
import torch

from megabase.core.errors import TrainingError
from megabase.core.vocab import SEP
from megabase.infer.common import DEFAULT_SEGMENT
from megabase.infer.sampling import SamplingError, sample

from .config import RLConfig
from .reward import build_reward, heldout_check
from .rollout import Prompts, Rollout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flat_parameters(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.detach().float() for p in model.parameters()])


def load_flat(model, flat: torch.Tensor) -> None:
    """Copy a flat fp32 parameter vector into ``model`` (any dtype)."""
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat.to(next(model.parameters()).dtype),
                                            model.parameters())


class WeightChannel:
    """The trainer's latest weights and their version, in one process."""

    def __init__(self, model):
        self.flat, self.version = flat_parameters(model), 0

    def publish(self, model, version: int) -> None:
        self.flat, self.version = flat_parameters(model), version

    def take(self, model, have: int) -> int | None:
        """Copy newer weights than version ``have`` into ``model``; their version."""
        if self.version == have:
            return None
        load_flat(model, self.flat)
        return self.version


def generator_model(model, cfg: RLConfig):
    """The generator's copy: ``generator_dtype`` weights, eval mode, no gradients."""
    model = model.to(DTYPES[cfg.generator_dtype]).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def sample_batch(model, prompts: list[np.ndarray], cfg: RLConfig, batch: int,
                 channel, version: int, gen: torch.Generator,
                 segment: int = DEFAULT_SEGMENT) -> tuple[list[Rollout], int]:
    """``cfg.group_size`` samples of ``cfg.sample_length`` bases after each prompt (all decoded as
    one batch by :func:`megabase.infer.sampling.sample`, each prompt read once for its group, new
    weights taken between steps; with ``recompute_state`` an update reads each prompt again, once,
    and then each sample's bases so far, all under the new weights). Returns
    the groups (rewards not yet filled) and the version the model ends at."""
    started = time.perf_counter()
    G, L = cfg.group_size, cfg.sample_length
    first = torch.from_numpy(np.stack([np.concatenate([[SEP], p]) for p in prompts]).astype(np.int64))
    P = first.shape[1]
    tokens = first.repeat_interleave(G, 0)  # [n * G, P]
    versions = torch.empty(tokens.shape[0], L, dtype=torch.int32)
    updates = 0
    # the newest weights before the prompt is read: the prompt's cache then has the version of
    # the first base, which clean_bases relies on (taken after it, they would tag the first base
    # with a version its cache never saw)
    newer = channel.take(model, version)
    version = version if newer is None else newer

    def before_step(i: int) -> bool:
        nonlocal version, updates
        newer = channel.take(model, version)
        if newer is None:
            return False
        version, updates = newer, updates + 1
        return cfg.recompute_state

    def after_step(i: int) -> None:
        versions[:, i - 1] = version

    record = any(True for _ in model.moe_layers())
    try:
        done = sample(model, first, L, cfg.temperature, 0, gen, segment, before_step, after_step,
                      record_routing=record, group=G)  # each prompt read once for its group
    except SamplingError as exc:
        raise TrainingError(f"the generator's sampling probabilities became non-finite at base "
                            f"{exc.base} of batch {batch} (policy version {version}, temperature "
                            f"{cfg.temperature:g})") from None
    out = torch.cat([tokens, done.tokens], 1)
    seconds = time.perf_counter() - started
    groups = []
    for g in range(len(prompts)):
        rows = slice(g * G, (g + 1) * G)
        routing = None if done.routing is None else [r[rows] for r in done.routing]
        groups.append(Rollout(batch, batch * len(prompts) + g, out[rows], P,
                              done.sampled_log_probs[rows], versions[rows], routing,
                              torch.zeros(G), updates=updates, seconds=seconds,
                              state_bytes=done.state_bytes))
    return groups, version


class Scorer:
    """Fills a group's rewards, reward parts and held-out figures (generator side)."""

    def __init__(self, cfg: RLConfig):
        self.reward = build_reward(cfg.reward, cfg.base)
        self.check = heldout_check(cfg.reward)

    def __call__(self, groups: list[Rollout]) -> None:
        for g in groups:
            sample = g.tokens[:, g.prompt_len :].numpy().astype(np.int64)
            prompt = g.tokens[0, 1 : g.prompt_len].numpy()  # after <sep>; one prompt per group
            g.rewards = torch.as_tensor(self.reward(sample, prompt), dtype=torch.float32)
            if hasattr(self.reward, "parts"):
                g.reward_parts = self.reward.parts(sample, prompt)
            if self.check is not None:
                g.heldout = {"motif_hits": self.check.parts(sample)["motif_hits"]}


class SyncGenerator:
    """Batches decoded in this process: the synchronous baseline (trainer and generator taking
    turns), and the body of the generator's rank. ``copy``: decode with a copy of ``model`` (the
    trainer's, in one process); ``channel``: where new weights come from (a
    :class:`WeightChannel` of the trainer's policy when None); ``scorer`` / ``prompts``: ones
    already built."""

    def __init__(self, cfg: RLConfig, model, channel=None, copy: bool = True,
                 scorer: Scorer | None = None, prompts: Prompts | None = None):
        self.cfg = cfg
        self.channel = channel if channel is not None else WeightChannel(model)
        self.model = generator_model(copying.deepcopy(model) if copy else model, cfg)
        self.version = 0  # the starting checkpoint's weights are version 0 on both sides
        self.scorer, self.prompts = scorer or Scorer(cfg), prompts or Prompts(cfg)
        self.rng = np.random.default_rng(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.batch = 0

    def next(self) -> list[Rollout]:
        cfg = self.cfg
        picks = [self.prompts.draw(self.rng, self.batch * cfg.prompts_per_step + i)
                 for i in range(cfg.prompts_per_step)]
        groups, self.version = sample_batch(self.model, picks, cfg, self.batch, self.channel,
                                            self.version, self.gen)
        self.scorer(groups)
        self.batch += 1
        return groups

    def publish(self, model, version: int) -> None:
        self.channel.publish(model, version)

    def counts(self) -> dict[str, float]:
        return {"in_flight": 0.0, "in_queue": 0.0}

    def close(self) -> None:
        pass
