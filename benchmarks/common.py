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
