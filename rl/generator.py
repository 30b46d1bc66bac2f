"""The generator: decodes groups of samples from prompts through the cached state, takes new
weights between decoding steps, and tags every base with the policy version that sampled it.

Weights reach it through a :class:`WeightChannel`: the trainer publishes a flat copy of its
parameters and a version number; the generator polls between steps (one integer read) and, when
the version moved, copies the weights into its model. Samples in flight keep their cache (what
prime-rl does: the old keys and states, new weights from here on) or, with ``recompute_state``,
re-read their prefix under the new weights.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from megabase.data.vocab import SEP

from .config import RLConfig
from .replay import restart, taped
from .rollout import Rollout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flat_parameters(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.detach().float() for p in model.parameters()])


class WeightChannel:
    """A flat fp32 parameter vector and its version, in shared memory when ``shared`` (for a
    generator in another process; torch.multiprocessing passes both without copying)."""

    def __init__(self, model, shared: bool = True):
        import torch.multiprocessing as mp

        self.flat = flat_parameters(model)
        self.version = mp.get_context("spawn").Value("q", 0, lock=True) if shared else _Plain()
        if shared:
            self.flat.share_memory_()

    def publish(self, model, version: int) -> None:
        with self.version.get_lock():
            self.flat.copy_(flat_parameters(model))
            self.version.value = version

    def take(self, model, have: int) -> int | None:
        """Copy newer weights than version ``have`` into ``model`` (any dtype); their version."""
        if self.version.value == have:
            return None
        with self.version.get_lock():
            version = int(self.version.value)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(
                    self.flat.to(next(model.parameters()).dtype), model.parameters())
        return version


class _Plain:
    """The version of an in-process channel (same interface as a shared ``Value``)."""

    def __init__(self):
        self.value = 0

    def get_lock(self):
        return contextlib.nullcontext()


def generator_model(model, cfg: RLConfig):
    """The generator's copy: ``generator_dtype`` weights, eval mode, no gradients."""
    model = model.to(DTYPES[cfg.generator_dtype]).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def sample_batch(model, prompts: list[np.ndarray], cfg: RLConfig, batch: int,
                 channel: WeightChannel, version: int, gen: torch.Generator,
                 segment: int = 16_384) -> tuple[list[Rollout], int]:
    """``cfg.group_size`` samples of ``cfg.sample_length`` bases after each prompt (all decoded as
    one batch). Returns the groups (rewards not yet filled) and the version the model ends at."""
    from megabase.infer.common import one_thread
    from megabase.model import advance
    from megabase.model.layers import untiled

    started = time.perf_counter()
    G, L = cfg.group_size, cfg.sample_length
    first = np.stack([np.concatenate([[SEP], p]) for p in prompts]).astype(np.int64)
    P = first.shape[1]
    tokens = torch.from_numpy(np.repeat(first, G, axis=0))  # [n * G, P]
    N = tokens.shape[0]
    out = torch.empty(N, P + L, dtype=torch.int64)
    out[:, :P] = tokens
    behaviour = torch.empty(N, L)
    versions = torch.empty(N, L, dtype=torch.int32)
    updates = 0
    record = any(True for _ in model.moe_layers())

    def prefill(upto: int):
        state = model.init_state()
        logits = None
        for s in range(0, upto, segment):
            logits, _ = advance(model, out[:, s : min(upto, s + segment)], state)
        return state, logits

    with taped(model) if record else contextlib.nullcontext() as tape:
        state, logits = prefill(P)
        for i in range(L):
            newer = channel.take(model, version)
            if newer is not None:
                version, updates = newer, updates + 1
                if cfg.recompute_state:
                    if tape is not None:
                        restart(tape)
                    state, logits = prefill(P + i)
            last = logits[:, -1].float() / cfg.temperature
            logp = torch.log_softmax(last, -1)
            base = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            out[:, P + i] = base
            behaviour[:, i] = logp.gather(1, base[:, None])[:, 0]
            versions[:, i] = version
            if i + 1 < L:  # the last base is never an input
                with untiled(), one_thread():
                    logits, _ = advance(model, base[:, None], state)
        routing = tape.routing() if tape is not None else None
    seconds = time.perf_counter() - started
    groups = []
    for g in range(len(prompts)):
        rows = slice(g * G, (g + 1) * G)
        groups.append(Rollout(batch, batch * len(prompts) + g, out[rows], P, behaviour[rows],
                              versions[rows], None if routing is None else [r[rows] for r in routing],
                              torch.zeros(G), updates=updates, seconds=seconds))
    return groups, version

