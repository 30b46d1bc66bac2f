"""Helpers shared by the benchmark scripts: timing and where the real genomes are."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENOMES = Path(os.environ.get("MEGABASE_GENOMES", ROOT.parent / "shared" / "genomes"))


def timeit(fn, repeat: int, setup=None) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (``setup()`` runs untimed before each)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def peak_live_bytes(fn):
    """``(fn(), peak)``: the most bytes of CPU tensor storage alive at once while ``fn`` ran.

    Every op's outputs pass through a dispatch mode that counts each new storage until it is freed,
    so autograd's saved tensors and recomputed activations count, the C allocator's retained heap
    does not: what ``torch.cuda.max_memory_allocated`` would report on a GPU, less temporaries that
    live only inside one op. Costs a few microseconds per op, no memory per op.
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen = set()

        def free(self, key, size):
            self.seen.discard(key)
            self.live -= size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in self.seen:
                        self.seen.add(key)
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self.free, key, storage.nbytes())
            return out

    with Live() as mode:
        out = fn()
    return out, mode.peak
