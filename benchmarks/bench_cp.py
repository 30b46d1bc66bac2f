"""Context parallelism on CPU: peak memory per rank and step time at P = 1 and P = 2.

One forward + backward of ``cpu-small`` (recompute=layer, the setting that lets a 256k sequence fit
this machine) over ``--length`` real bases of U. maydis chr01, in ``P`` gloo processes that each
hold ``length / P`` of the sequence. Each configuration runs in fresh processes, one after the
other, so a rank's peak RSS is its own; the P ranks share this machine's cores (threads per rank =
cores / P), so step time shows the cost of the exchanges and of the longer key prefixes of later
ranks, not a speed-up. Prints the ratio memory(P=2) / memory(P=1) per rank (target <= 0.6).

    python benchmarks/bench_cp.py                  # 262,144 bases (~40 min on 2 cores)
    python benchmarks/bench_cp.py --length 65536   # quicker
    python benchmarks/bench_cp.py --trim-heap      # with train.trim_heap in every rank
    python benchmarks/bench_cp.py --live           # peak live tensors instead (see below)

Peak RSS on CPU also counts what glibc's heap keeps after frees, which moves by up to ~1 GiB
between identical runs. ``--live`` measures the peak of live tensor bytes instead (what a GPU's
``max_memory_allocated`` reports), deterministic: each rank's work runs in this one process, one
rank after the other, with every exchange replaced by a local stand-in of the same shape (the
rank's own tensor in every slot), every op's output storages counted until freed
(``common.peak_live_bytes``). Its times are not step times (the counting slows the step).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GENOMES, machine, peak_live_bytes  # noqa: E402


def _prepared_step(tokens, layout, trim_heap: bool = False):
    """``step() -> loss``: one forward + backward of ``cpu-small`` (recompute=layer) on this rank's
    shard of ``tokens``."""
    import torch

    from megabase.model import build_model
    from megabase.pipeline.distributed import objective, parallelize

    torch.manual_seed(0)
    model = parallelize(build_model("cpu-small"), layout, recompute="layer", trim_heap=trim_heap)
    ids, targets = layout.shard(tokens[:, :-1], tokens[:, 1:])

    def step() -> float:
        out = objective(model(ids, targets), layout)
        out.objective.backward()
        return float(out.lm_loss)

    return step


def _rank(rank: int, world: int, tokens, init: str, results, trim_heap: bool) -> None:
    import torch
    import torch.distributed as dist

    from megabase.pipeline.distributed import make_layout

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    step = _prepared_step(tokens, make_layout(context_parallel=world), trim_heap)
    before = _rss_gib()
    start = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    results[rank] = {"seconds": seconds, "peak_gib": peak, "before_gib": before, "loss": loss}
    if world > 1:
        dist.destroy_process_group()


def live_rank(tokens, rank: int, world: int) -> dict:
    """Peak live tensor bytes of one rank's step, run in this process (see the module docs)."""
    import torch

    from megabase.pipeline.context_parallel import ContextParallel
    from megabase.pipeline.distributed import Layout

    class _Copies(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, size):
            return torch.stack([x] * size)

        @staticmethod
        def backward(ctx, grad):
            return grad.sum(0), None

    class Local(ContextParallel):
        def gather(self, x):
            return _Copies.apply(x, self.size)

        def all_reduce(self, x):
            return x.detach() * self.size

    # one process (world 1): the objective is this shard's own loss
    step = _prepared_step(tokens, Layout(0, 1, Local(rank, world) if world > 1 else None))
    start = time.perf_counter()
    loss, peak = peak_live_bytes(step)
    return {"seconds": time.perf_counter() - start, "peak_gib": peak / 2**30, "loss": loss}


def _rss_gib() -> float:
    """This process's resident memory now (Linux ``/proc``), GiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def measure(tokens, world: int, trim_heap: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(world, tokens, f"file://{tmp}/rendezvous", results, trim_heap),
                 nprocs=world)
        return [results[r] for r in range(world)]


def real_tokens(length: int):
    import numpy as np
    import torch

    from megabase.data import TokenStore, prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare(GENOMES / "umaydis.fa.gz", Path(tmp) / "store", chroms=["chr01"], progress=False)
        tokens, _ = TokenStore(Path(tmp) / "store").fetch("chr01", 100_000, 100_000 + length + 1)
    return torch.from_numpy(tokens.astype(np.int64))[None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=262_144)
    parser.add_argument("--ranks", default="1,2", help="context-parallel sizes to run")
    parser.add_argument("--trim-heap", action="store_true", help="train.trim_heap in every rank")
    parser.add_argument("--live", action="store_true", help="peak live tensors, not peak RSS")
    args = parser.parse_args()
    tokens = real_tokens(args.length)
    what = "peak live tensors" if args.live else f"peak RSS, trim_heap={args.trim_heap}"
    print(f"context parallelism, cpu-small, recompute=layer, {what}, {args.length:,} bases; "
          f"{machine()}", flush=True)
    rows = {}
    for world in (int(p) for p in args.ranks.split(",")):
        if args.live:
            ranks = [live_rank(tokens, r, world) for r in range(world)]
        else:
            ranks = measure(tokens, world, args.trim_heap)
        rows[world] = ranks
        for r, res in enumerate(ranks):
            memory = (f"peak live {res['peak_gib']:.2f} GiB" if args.live else
                      f"peak RSS {res['peak_gib']:.2f} GiB ({res['before_gib']:.2f} GiB before)")
            print(f"P={world} rank {r}: {'profiled' if args.live else 'step'} "
                  f"{res['seconds']:.1f} s, {memory}, loss {res['loss']:.6f}", flush=True)
    if 1 in rows and 2 in rows:
        one = rows[1][0]
        worst = max(r["peak_gib"] for r in rows[2])
        slow = max(r["seconds"] for r in rows[2])
        loss = "" if args.live else (f"; loss difference "
                                     f"{abs(rows[2][0]['loss'] - one['loss']):.2e}")
        print(f"memory per rank P=2 / P=1: {worst / one['peak_gib']:.2f}x (target <= 0.6); "
              f"{'profiled' if args.live else 'step'} time P=2 / P=1: "
              f"{slow / one['seconds']:.2f}x{loss}")


if __name__ == "__main__":
    main()
