"""Asynchronous vs synchronous ``megabase rl`` at the same settings: trainer steps per second.

    python benchmarks/bench_rl.py --config configs/rl-ctcf-human.yaml [--steps 12] [--set K=V ...]

Runs the config twice for ``--steps`` steps (no time cap, no target), first with ``asynchronous:
false`` (generator and trainer in one process, taking turns, all cores), then with ``asynchronous:
true`` (two processes, the cores split, the generator a batch ahead), each in its own temporary
folder and MLflow store, and prints both rates and the ratio ``async / sync`` (> 1: asynchrony
pays). The first step of each (process start, the first batch nobody overlaps) is left out of
the rate. The science runs (docs/science.md) time the whole way to a reward threshold instead.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from megabase.rl import load_rl_config, rl  # noqa: E402


def rate(config: str, sets: list[str], asynchronous: bool, steps: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_rl_config(config, [*sets, f"asynchronous={asynchronous}", f"steps={steps}",
                                      "max_minutes=null", "target_reward=null", f"out={tmp}/out",
                                      f"tracking_uri=sqlite:///{tmp}/mlflow.db"])
        result = rl(cfg, progress=False)
    h = result.history
    span = h[-1]["seconds"] - h[0]["seconds"]
    return (len(h) - 1) / span, h[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    sync, _ = rate(args.config, args.set, False, args.steps)
    print(f"synchronous:  {sync:.4f} steps/s")
    asyn, last = rate(args.config, args.set, True, args.steps)
    print(f"asynchronous: {asyn:.4f} steps/s (last step waited {last['trainer/wait_seconds']:.2f} s "
          f"for its batch)")
    print(f"ratio async / sync: {asyn / sync:.2f}x")


if __name__ == "__main__":
    main()
