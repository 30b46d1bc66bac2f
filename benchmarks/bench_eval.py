"""What the context controls cost: one megabase window scored alone vs with the 16k control and
the copy model, as `megabase evaluate` runs them.

    python benchmarks/bench_eval.py --checkpoint RUN_OR_CHECKPOINT --data HUMAN_STORE \\
        [--region chr22:40,000,001-41,048,576] [--controls 16384] [--ablations ""]

Scores the region as one window (``--length`` its size) three ways in one process, in the order
alone / with / alone (the two "alone" times bracket drift on a shared machine; their mean is the
baseline): the model alone, then the model with the controls and the copy model (no Markov
baselines, no probe, as in the issue that set the target). Prints each time and the ratio
``with / alone`` (target <= 3.2 for one 16k control and the copy model); ``--ablations`` adds
ablations to the second case, to price them too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from megabase.eval.config import EvalConfig  # noqa: E402
from megabase.eval.evaluate import evaluate  # noqa: E402


def run(checkpoint: str, data: str, options: EvalConfig) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        report = evaluate(checkpoint, data, options, out=Path(out) / "eval", progress=False)
        return time.perf_counter() - started, report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--region", default="chr22:40,000,001-41,048,576")
    p.add_argument("--controls", default="16384")
    p.add_argument("--ablations", default="")
    a = p.parse_args()
    lo, hi = (int(x.replace(",", "")) for x in a.region.split(":")[1].split("-"))
    length = hi - lo + 1
    controls = [int(c) for c in a.controls.split(",") if c]
    ablations = [x for x in a.ablations.split(",") if x]
    common = dict(regions=[a.region], length=length, baselines=[], probe=False)
    alone = EvalConfig(**common, controls=[], copy=False)
    full = EvalConfig(**common, controls=controls, copy=True, ablations=ablations)
    print(f"machine: {machine()}; one window of {length:,} bases ({a.region})")
    t0, r0 = run(a.checkpoint, a.data, alone)
    print(f"  model alone: {t0:.1f} s ({r0['overall']['bits_per_base']:.4f} bits/base)", flush=True)
    t1, r1 = run(a.checkpoint, a.data, full)
    what = ", ".join([*(f"control {c:,}" for c in controls), "copy model", *ablations])
    print(f"  model + {what}: {t1:.1f} s", flush=True)
    t2, _ = run(a.checkpoint, a.data, alone)
    print(f"  model alone again: {t2:.1f} s", flush=True)
    base = (t0 + t2) / 2
    print(f"with / alone: {t1 / base:.2f}x (target <= 3.2 for one 16k control and the copy model; "
          f"the two baselines differ by {abs(t2 - t0) / base:.0%})")
    assert r1["overall"]["bits_per_base"] == r0["overall"]["bits_per_base"]


if __name__ == "__main__":
    main()
