"""Memory knobs applied to a built model from outside it (as torchtitan keeps them apart from the model).

Apply in this order: :func:`apply_recompute`, :func:`apply_offload`, :func:`apply_heap_trim`. They
change memory, never
results: the loss and gradients stay equal to fp32 round-off (tests check this). Parameter names
are unchanged, so checkpoints load with or without the knobs.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config import RECOMPUTE as RECOMPUTE_MODES  # the choice list lives with the config


def _keep_selections(ctx, op, *args, **kwargs):
    """Recompute everything but the DSA indexer's selection: an O(T^2) pass whose output (O(T * topk)
    integers) is cheap to keep and identical when recomputed."""
    if op is torch.ops.megabase.dsa_indexer.default:  # with or without the candidate stage
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context():
    return create_selective_checkpoint_contexts(_keep_selections)


def wrap(module: torch.nn.Module, behaviour: type) -> torch.nn.Module:
    """Give ``module`` a ``behaviour`` (a class whose ``forward`` calls ``super().forward``) by
    making it an instance of a subclass of both, as torch's ``fully_shard`` does. Unlike a wrapper
    module, parameter names, attributes and ``isinstance`` checks stay as they were, so checkpoints
    load with or without the knob; unlike a rebound ``forward``, the class says what was applied.
    Applying a behaviour twice changes nothing."""
    cls = type(module)
    if issubclass(cls, behaviour):
        return module
    key = (behaviour, cls)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{behaviour.__name__}{cls.__name__}", (behaviour, cls), {})
    module.__class__ = _SUBCLASSES[key]
    return module


_SUBCLASSES: dict[tuple[type, type], type] = {}


class Recomputed:
    """Activation recompute of a block or mixer: its backward reruns its forward. Calls without
    autograd or with a streaming state (in the call's context, the second argument) run plainly."""

    def forward(self, *args, **kwargs):
        ctx = kwargs.get("ctx", args[1] if len(args) > 1 else None)
        streaming = ctx is not None and ctx.state is not None
        if torch.is_grad_enabled() and not streaming:
            return checkpoint(super().forward, *args, use_reentrant=False, context_fn=_context,
                              **kwargs)
        return super().forward(*args, **kwargs)


class Offloaded:
    """Tensors saved for backward go to host memory (pinned on CUDA) while the forward runs."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.parameters())
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return super().forward(*args, **kwargs)


def apply_recompute(model: torch.nn.Module, mode: str = "layer") -> torch.nn.Module:
    """Activation recompute for every block of a :class:`~megabase.model.HybridLM`.

    ``layer``: each block keeps only its input and its DSA selections (integers); everything else
    inside is recomputed in backward.
    ``selective``: only the mixers (KDA/DSA, the larger activations) are recomputed; FFN
    activations are kept. ``none``: nothing. Streaming calls (with a state) are never wrapped.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose from {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return model
    for block in model.blocks:
        wrap(block if mode == "layer" else block.mixer, Recomputed)
    return model


def apply_offload(model: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Keep tensors saved for backward in host memory (pinned on CUDA) instead of device memory.

    On a CPU-only run activations already live in host memory, so this changes nothing there.
    """
    return wrap(model, Offloaded) if enabled else model


@functools.cache
def heap_trimmer():
    """glibc's ``malloc_trim(0)`` as a function of no arguments, or None where there is none (not
    Linux): it hands the heap's freed pages back to the OS. Looked up once (``find_library`` runs
    ``ldconfig``), not per step."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    return None if trim is None else lambda: trim(0)


def apply_heap_trim(model: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Hand freed heap memory back to the OS after every block's forward and backward
    (:func:`heap_trimmer`; CPU runs on Linux only, a no-op elsewhere).

    On a CPU a layer's large transient tensors leave freed pages inside glibc's heap, and peak RSS
    counts them: trimming between blocks lowered a cpu-small step's peak from 4.19 to 3.17 GiB at
    65,536 tokens for ~5% more time (docs/benchmarks.md). Results are unchanged.
    """
    trim = heap_trimmer()
    if not enabled or trim is None or getattr(model, "__megabase_heap_trim__", False):
        return model

    def hook(module, *args):
        if not next(module.parameters()).is_cuda:  # read per call: the trainer moves the model later
            trim()

    for block in model.blocks:
        block.register_forward_hook(hook)
        block.register_full_backward_hook(hook)
    model.__megabase_heap_trim__ = True
    return model


def proc_status(field: str) -> int | None:
    """A byte figure of ``/proc/self/status`` (``VmRSS``, ``VmHWM``); None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 if found else None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux's ``clear_refs`` 5); False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def step_peak_gib(device: torch.device) -> float:
    """The peak memory since the last call, GiB: on a GPU torch's peak allocation (reset), on a
    CPU the process's peak RSS (``VmHWM``, then reset), so that each training step's row holds
    its own peak and not the run's: a 1,048,576-token step after a 32,768-token whole one read the
    whole one's. Where the peak cannot be reset, the process's peak so far."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    hwm = proc_status("VmHWM")
    if hwm is None or not reset_peak_rss():
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return hwm / 2**30
