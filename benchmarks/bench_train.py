"""Training throughput of ``cpu-small`` and the cost of each memory knob, measured in one run.

    python benchmarks/bench_train.py [--lengths 16384,65536] [--knob-length 16384] [--steps 2]

Each configuration runs in a fresh process (so peak RSS is its own): one warm-up optimizer step,
then ``--steps`` timed steps (forward, backward, AdamW) on real bases of the bundled genome.
Prints tokens/s per length (recompute=layer at the longest, where the knob-off step would not fit
this machine's memory), then the step time and peak memory of recompute=layer, recompute=selective
and offload as ratios against the knob off at ``--knob-length``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import real_tokens  # noqa: E402
from common import machine  # noqa: E402


def child(T: int, recompute: str, offload: bool, steps: int) -> None:
    from megabase.model import build_model
    from megabase.pipeline.memory import apply_offload, apply_recompute

    torch.manual_seed(0)
    tokens = real_tokens(T)
    model = apply_recompute(build_model("cpu-small"), recompute)
    if offload:
        apply_offload(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()
    seconds = min(step() for _ in range(steps))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"T": T, "recompute": recompute, "offload": offload, "seconds": seconds,
                      "tokens_per_s": T / seconds, "peak_gib": peak}))


def measure(T: int, recompute: str = "none", offload: bool = False, steps: int = 2) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{T},{recompute},{int(offload)},{steps}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--lengths", default="16384,65536")
    parser.add_argument("--knob-length", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        T, recompute, offload, steps = args.child.split(",")
        child(int(T), recompute, offload == "1", int(steps))
        return
    print(f"machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    for T in lengths:
        knob = "layer" if T == max(lengths) and T > args.knob_length else "none"
        r = measure(T, knob, steps=args.steps)
        print(f"cpu-small T={T:,} (recompute={knob}): {r['tokens_per_s']:,.0f} tokens/s, "
              f"step {r['seconds']:.2f} s, peak RSS {r['peak_gib']:.2f} GiB", flush=True)
    off = measure(args.knob_length, steps=args.steps)
    print(f"knobs at T={args.knob_length:,}, vs off (step {off['seconds']:.2f} s, peak "
          f"{off['peak_gib']:.2f} GiB):", flush=True)
    for label, recompute, offload in (("recompute=layer", "layer", False),
                                      ("recompute=selective", "selective", False),
                                      ("offload", "none", True)):
        r = measure(args.knob_length, recompute, offload, steps=args.steps)
        print(f"  {label:20s} step time {r['seconds'] / off['seconds']:.2f}x, "
              f"peak memory {r['peak_gib'] / off['peak_gib']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
