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
    """``(fn(), peak)``: the most bytes of tensors alive at once while ``fn`` ran (CPU), replayed
    from the profiler's allocation events. Unlike peak RSS it ignores what the C allocator keeps
    after a free, so it is what ``torch.cuda.max_memory_allocated`` would report on a GPU."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    sizes, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.typed[1].alloc_size))  # negative: a free
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return out, peak
