"""One training step at length: the whole-window backward beside the segment-walked one.

    python benchmarks/bench_walk.py [--lengths 16384,65536,262144,1048576]
        [--old-lengths 16384,65536,262144] [--segment 32768] [--preset cpu-small] [--data STORE]

Each step (forward, backward, AdamW update) runs in a fresh process on real bases of human chr22
from 40 Mb (the held-out region; ``--data`` a prepared human store, else the chr22 subset in
``../shared/genomes`` is prepared into a temporary folder, else the bundled genome tiled), with a
freshly initialised ``--preset`` whose zero-started head is drawn at random (so the backward
reaches every layer; speed and memory do not depend on the weights otherwise). Printed per length:
seconds, milliseconds per token and peak RSS of each form, the walked form's per-token time as a
multiple of its own at the shortest length (the target: <= 1.5 at 1,048,576), and old / new.
``old`` is the whole window with ``recompute=layer`` (what a long window needed before the walk);
``new`` is ``megabase.model.walk`` in segments of ``--segment`` tokens, no recompute.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_stage import human_bases, prepared_store  # noqa: E402


def child(form: str, n: int, preset: str, store: str | None, segment: int) -> None:
    """One optimizer step in this fresh process; prints a JSON line."""
    from megabase.model import build_model
    from megabase.model.walk import walked_forward
    from megabase.pipeline.memory import apply_recompute

    torch.manual_seed(0)
    tokens = torch.from_numpy(human_bases(n + 1, store).astype(np.int64))[None]
    model = build_model(preset)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    if form == "old":
        apply_recompute(model, "layer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    mask = targets < 4
    start = time.perf_counter()
    if form == "old":
        out = model(ids, targets, loss_mask=mask)
    else:
        out = walked_forward(model, ids, targets, mask, segment)
    out.loss.backward()
    opt.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"form": form, "n": n, "seconds": seconds, "peak": peak,
                      "loss": float(out.loss.detach())}))


def run_child(form: str, n: int, preset: str, store: str | None, segment: int) -> dict:
    cmd = [sys.executable, __file__, "--child", form, "--n", str(n), "--preset", preset,
           "--segment", str(segment)] + (["--data", store] if store else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{form} at {n} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="16384,65536,262144,1048576")
    ap.add_argument("--old-lengths", default="16384,65536,262144",
                    help="lengths to run the whole-window step at too (1,048,576 took 1,532 s "
                         "and 23.8 GB of this machine's 24 on 2026-12-03)")
    ap.add_argument("--segment", type=int, default=32768)
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--data", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--n", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.n, args.preset, args.data, args.segment)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    old = {int(x) for x in args.old_lengths.split(",") if x}
    import platform

    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, preset {args.preset}, segment {args.segment:,}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.data or prepared_store(tmp)
        base = None
        for n in lengths:
            new = run_child("new", n, args.preset, store, args.segment)
            per = new["seconds"] / n * 1e3
            base = per if base is None else base
            line = (f"{n:>9,} tokens: walked {new['seconds']:.1f} s, {per:.3f} ms/token "
                    f"({per / base:.2f}x the shortest), peak {new['peak'] / 1e9:.2f} GB")
            if n in old:
                was = run_child("old", n, args.preset, store, args.segment)
                line += (f"; whole window (recompute=layer) {was['seconds']:.1f} s, "
                         f"{was['seconds'] / n * 1e3:.3f} ms/token, peak {was['peak'] / 1e9:.2f} "
                         f"GB -> time {was['seconds'] / new['seconds']:.2f}x, loss "
                         f"{new['loss']:.6f} vs {was['loss']:.6f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
