"""What megabase costs a shared machine: CPU-seconds and wall time of training steps, alone and
beside a second job on the same cores, with OpenMP's idle threads spinning or sleeping.

    python benchmarks/bench_threads.py [--length 8192] [--steps 6] [--policies passive,spin]

Each figure is a fresh process running ``--steps`` training steps (forward, backward, AdamW) of
``--preset`` at ``--length`` tokens after one untimed step, with torch's OpenMP threads as
``megabase`` starts them (``OMP_WAIT_POLICY=passive``: a thread with no work sleeps) and as
OpenMP's default leaves them (a thread spins for a while before it sleeps), or with a shorter
spin (``--policies spincount=N``: GOMP_SPINCOUNT). "shared" runs two such processes at once, as
two jobs of one user or a job beside the user's notebook. Prints CPU-seconds and wall seconds per
step, and each policy's ratios to spinning (below 1: less CPU burnt, less time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

WORKER = r"""
import json, resource, sys, time
import torch
from megabase.model import build_model
preset, length, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = build_model(preset)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 4, (1, length + 1))
def step():
    model(x[:, :-1], x[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step()
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
for _ in range(steps):
    step()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu": usage.ru_utime + usage.ru_stime - cpu0,
                  "wall": time.perf_counter() - wall0}))
"""


def measure(policy: str, jobs: int, args) -> dict[str, float]:
    """Mean CPU-seconds and wall seconds per step over ``jobs`` processes run at once, with
    ``policy`` ``spin`` (OpenMP's default), ``passive`` or ``spincount=N`` (GOMP_SPINCOUNT)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "passive"
    elif policy.startswith("spincount="):
        env["GOMP_SPINCOUNT"] = policy.split("=", 1)[1]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, args.preset, str(args.length),
                               str(args.steps)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(jobs)]
    runs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            sys.exit(f"a worker failed (exit {p.returncode})")
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: sum(r[k] for r in runs) / len(runs) / args.steps for k in ("cpu", "wall")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repeats; the best is kept")
    ap.add_argument("--policies", default="passive,spin",
                    help="passive, spin (the default's spinning) and spincount=N, compared to spin")
    args = ap.parse_args()
    policies = args.policies.split(",")
    print(f"machine: {machine()}; {args.preset} at {args.length:,} tokens, {args.steps} steps")
    best: dict[tuple[str, int], dict[str, float]] = {}
    for _ in range(args.rounds):
        for jobs in (1, 2):
            for policy in policies:
                got = measure(policy, jobs, args)
                key = (policy, jobs)
                best[key] = {k: min(best.get(key, got)[k], got[k]) for k in got}
    for jobs, name in ((1, "alone"), (2, "shared")):
        s = best[("spin", jobs)]
        for policy in policies:
            p = best[(policy, jobs)]
            print(f"{name:6s} {policy:16s}: {p['cpu']:.2f} CPU-s, {p['wall']:.2f} s a step; "
                  f"vs spin: CPU {p['cpu'] / s['cpu']:.2f}, wall {p['wall'] / s['wall']:.2f}")


if __name__ == "__main__":
    main()
