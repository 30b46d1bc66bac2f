"""Asynchronous vs synchronous ``megabase rl`` at the same settings, per prompt length: trainer
steps, rollouts and trainer tokens per second, and the generator's state.

    python benchmarks/bench_rl.py --config configs/rl-ctcf-human.yaml [--steps 12]
        [--prompt-lengths 256,16384,131072] [--set K=V ...]

For each prompt length (default: the config's ``prompt.length``) runs the config twice for
``--steps`` steps (no time cap, no target), first with ``asynchronous: false`` (generator and
trainer in one process, taking turns, all cores), then with ``asynchronous: true`` (two
processes, the cores split, the generator a batch ahead), each in its own temporary folder and
MLflow store, and prints both rates and the ratio ``async / sync`` (> 1: asynchrony pays). The
first step of each (process start, the first batch nobody overlaps) is left out of the rates.
A rollout is one sample of ``sample_length`` bases; the trainer's tokens per step are what its
policy pass reads: each group's prompt once and every sample's bases. The generator's state is
``generator/state_mib`` (every row's copy of its prompt's KDA states and DSA caches, the most
one batch holds: the generator decodes one batch at a time). The synchronous run also gives the
trainer-vs-generator mismatch with routing replay and, scored the other way in the same steps,
without; the peak resident memory of this process (trainer and generator in one) is printed
after each synchronous run, a running maximum, so give the lengths in rising order. The science
runs (docs/science.md) time the whole way to a reward threshold instead.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from megabase.rl import load_rl_config, rl  # noqa: E402


def rate(config: str, sets: list[str], asynchronous: bool, steps: int) -> tuple[float, list, object]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_rl_config(config, [*sets, f"asynchronous={asynchronous}", f"steps={steps}",
                                      "max_minutes=null", "target_reward=null", f"out={tmp}/out",
                                      f"tracking_uri=sqlite:///{tmp}/mlflow.db"])
        result = rl(cfg, progress=False)
    h = result.history
    span = h[-1]["seconds"] - h[0]["seconds"]
    return (len(h) - 1) / span, h, cfg


def mismatch(history: list[dict], tag: str) -> str:
    """The synchronous run's trainer-vs-generator mismatch over all its steps (every base there
    is computed under one version of the weights): mean k3 and the worst base's |delta log p|."""
    k3 = [h[f"{tag}/k3"] for h in history if f"{tag}/k3" in h]
    worst = [h[f"{tag}/max_abs"] for h in history if f"{tag}/max_abs" in h]
    if not k3:
        return "n/a"
    return f"k3 {sum(k3) / len(k3):.2e}, worst base {max(worst):.3f} nats"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt-lengths", default="", help="comma-separated; default the config's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x] or [None]
    for length in lengths:
        sets = args.set + ([f"prompt.length={length}"] if length else [])
        sync, history, cfg = rate(args.config, sets, False, args.steps)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        asyn, h, _ = rate(args.config, sets, True, args.steps)
        last = h[-1]
        rollouts = cfg.prompts_per_step * cfg.group_size
        tokens = cfg.prompts_per_step * (cfg.prompt.length + cfg.group_size * cfg.sample_length)
        print(f"prompt {cfg.prompt.length:,} bases ({cfg.prompts_per_step} x {cfg.group_size} "
              f"samples of {cfg.sample_length}; generator state "
              f"{last['generator/state_mib']:,.1f} MiB per batch; peak RSS of the synchronous "
              f"process so far {peak:.2f} GiB):")
        for name, r in (("synchronous", sync), ("asynchronous", asyn)):
            print(f"  {name + ':':14s}{r:.4f} steps/s, {r * rollouts:.3f} rollouts/s, "
                  f"{r * tokens:,.0f} trainer tokens/s")
        print(f"  ratio async / sync: {asyn / sync:.2f}x (the last async step waited "
              f"{last['trainer/wait_seconds']:.2f} s for its batch)")
        replay, other = ("with", "without") if cfg.routing_replay else ("without", "with")
        print(f"  mismatch ({cfg.generator_dtype} generator, synchronous): {replay} routing replay "
              f"{mismatch(history, 'mismatch')}; {other} it "
              f"{mismatch(history, f'mismatch_{other}_replay')}", flush=True)


if __name__ == "__main__":
    main()
