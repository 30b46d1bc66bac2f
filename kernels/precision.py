"""Ops that compute in fp32 whatever precision the caller runs under."""

from __future__ import annotations

import contextlib
import functools

import torch


def full_precision(fn):
    """Run ``fn`` with autocast off on the devices of its tensor arguments.

    The reference ops cast their inputs to fp32 themselves; under ``bf16-mixed`` autocast would
    turn their products back to bf16 (and break the indexer's exact integer ordering of fp32
    scores), so states, decays and selections stay fp32 and only the layers around them are bf16.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)

    return wrapper
