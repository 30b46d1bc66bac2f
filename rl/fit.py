"""Will an RL job fit in this machine's memory: its trainer step and its generator's state at the
job's prompt length, measured on the job's own model before anything starts.

The trainer's step holds, at its peak, the policy's forward and backward over each group's
prompt and samples (:func:`megabase.rl.trainer.group_pass`), on top of the weights, a frozen copy
and AdamW's moments; the generator holds its own copy of the weights and one batch's states (every
sample's copy of its prompt's KDA states and DSA caches). A prompt read whole costs memory in
proportion to its length: measured at :data:`PROBES` lengths and fitted as ``c + a P``, as
:mod:`megabase.pipeline.fit` does for a training step. A prompt walked in segments
(``walk_segment``) holds one segment's activations (in proportion to the segment) and the prompt's
keys and its group's copies of them (in proportion to the prompt): measured at :data:`WALKED`
(prompt, segment) pairs and fitted as ``c + a P + b S`` (the two terms peak at different moments,
so the sum is an upper estimate). :func:`check_rl_fits` refuses a job that cannot fit, with the
longest prompt that would.
"""

from __future__ import annotations

import copy

import torch

from megabase.core.errors import InputError
from megabase.core.vocab import SEP
from megabase.model import prefill, repeat_state, state_bytes
from megabase.infer.common import DEFAULT_SEGMENT
from megabase.pipeline.fit import HEADROOM, available_bytes, line_through, measured_peak
from megabase.pipeline.memory import heap_trimmer, proc_status, reset_peak_rss

from .config import RLConfig
from .trainer import sampled_log_probs

PROBES = (1024, 2048)  # prompt lengths measured, read whole
WALKED = ((2048, 512), (4096, 512), (4096, 1024))  # (prompt, segment) measured, walked


def _batch(cfg: RLConfig, prompt: int, gen: torch.Generator) -> torch.Tensor:
    """``[prompts_per_step * group_size, 1 + prompt + sample_length]`` random bases, one prompt
    per group."""
    n, G = cfg.prompts_per_step, cfg.group_size
    first = torch.randint(0, 4, (n, prompt), generator=gen)
    rows = torch.cat([torch.full((n, 1), SEP), first], 1).repeat_interleave(G, 0)
    return torch.cat([rows, torch.randint(0, 4, (n * G, cfg.sample_length), generator=gen)], 1)


def trainer_peak(model, cfg: RLConfig, prompt: int, trim=None, segment: int | None = None) -> int:
    """Peak bytes above the start of the policy's pass and backward over one batch of prompts of
    ``prompt`` bases, walked in segments of ``segment`` where longer (``trim``:
    :func:`~megabase.pipeline.fit.measured_peak`'s)."""
    tokens = _batch(cfg, prompt, torch.Generator().manual_seed(prompt))

    def step() -> None:
        logp, _, _ = sampled_log_probs(model, tokens, 1 + prompt, cfg.temperature,
                                       group=cfg.group_size, segment=segment)
        logp.sum().backward()

    peak = measured_peak(step, trim)
    model.zero_grad(set_to_none=True)
    return peak


def generator_state(model, cfg: RLConfig, prompt: int) -> int:
    """Bytes of one batch's states after its prompts of ``prompt`` bases are read."""
    tokens = _batch(cfg, prompt, torch.Generator().manual_seed(prompt))
    first = tokens[:: cfg.group_size, : 1 + prompt]
    with torch.no_grad():
        state, _ = prefill(model, first, DEFAULT_SEGMENT)
    return state_bytes(repeat_state(state, cfg.group_size))


def rl_need(model, cfg: RLConfig) -> dict[str, int]:
    """The job's estimated peak bytes at ``cfg.prompt.length``: ``trainer`` (this process:
    weights, frozen copy, AdamW moments and the measured step) and ``generator`` (its weights and
    one batch's states; in this process too when the job is synchronous)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    probe = copy.deepcopy(model).eval()
    if probe.head is not None and not probe.head.weight.any():  # zero head: an idle backward
        with torch.no_grad():
            probe.head.weight.normal_(0, 0.5)
    trim = heap_trimmer()
    trainer_peak(probe, cfg, PROBES[0] // 4, trim)  # first-call costs (kernels, pools) unfitted
    P, S = cfg.prompt.length, cfg.walk_segment
    if P > S:
        (p0, s0), (p1, _), (_, s1) = WALKED
        y = [trainer_peak(probe, cfg, p, trim, s) for p, s in WALKED]
        a = line_through((p0, p1), y[:2])[1]  # per prompt base, at segment s0
        b = line_through((s0, s1), y[1:])[1]  # per segment base, at prompt p1
        step = (y[0] - a * p0 - b * s0 + b * S, a)
    else:
        step = line_through(PROBES, [trainer_peak(probe, cfg, n, trim) for n in PROBES])
    states = line_through(PROBES, [generator_state(probe, cfg, n) for n in PROBES])
    del probe
    now = proc_status("VmRSS") or 0
    return {"trainer": now + 3 * params + int(step[0] + step[1] * P),
            "generator": params + int(states[0] + states[1] * P),
            "per_base": int(step[1] + states[1])}


def check_rl_fits(model, cfg: RLConfig) -> dict[str, int] | None:
    """Refuse (one line) a CPU job whose trainer and generator at ``prompt.length`` cannot fit
    in this machine's memory, naming the longest prompt that would; the estimate where it fits,
    None where it is not checked (a GPU, no ``/proc``)."""
    if torch.cuda.is_available() or not reset_peak_rss():
        return None
    room = available_bytes()
    if room is None:
        return None
    need = rl_need(model, cfg)
    total = need["trainer"] + need["generator"]  # two processes, or one holding both
    if total <= HEADROOM * room:
        return need
    longest = cfg.prompt.length - int((total - HEADROOM * room) / max(need["per_base"], 1))
    fits = f"prompt.length {max(longest, 0):,} or less would fit" if longest > 0 else \
        "no prompt length fits"
    how = "whole" if cfg.prompt.length <= cfg.walk_segment else \
        f"in segments of {cfg.walk_segment:,}"
    raise InputError(f"prompt.length {cfg.prompt.length:,}: the trainer's step (each group's "
                     f"prompt read {how}, with gradients) and the generator's states need "
                     f"~{total / 1e9:.1f} GB of the {room / 1e9:.1f} GB this machine has free; "
                     f"{fits}", options=("prompt.length", "walk_segment"))
