"""One training step at length: the whole-window backward beside the segment-walked one.

    python benchmarks/bench_walk.py [--lengths 16384,65536,262144,1048576]
        [--old-lengths 16384,65536,262144] [--segment 4096] [--recompute none]
        [--preset cpu-small] [--data STORE]

Each step (forward, backward, AdamW update) runs in a fresh process on real bases of human chr22
from 40 Mb (the held-out region; ``--data`` a prepared human store, else the chr22 subset in
``../shared/genomes`` is prepared into a temporary folder, else the bundled genome tiled), with a
freshly initialised ``--preset`` whose zero-started head is drawn at random (so the backward
reaches every layer; speed and memory do not depend on the weights otherwise).

``new`` is what the trainer runs by default: a window longer than ``train.segment_from`` walked
in segments of ``--segment`` tokens (``megabase.model.walk``, the heap handed back between
segments), a shorter one whole; ``old`` is the whole window with ``recompute=layer`` (what a long
window needed before the walk). The shortest length is also walked in segments, so the per-token
growth of the walked step itself is printed (the target: <= 1.5 at 1,048,576). Per length:
seconds, ms per token and peak RSS of each form, the peak the fit check
(``megabase.pipeline.fit``) estimates, the step's model FLOPs by layer kind (``flops.py`` says how
they are counted) and their rate as a share of this machine's fp32 matmul rate, measured at the
start and the end of the run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_stage import human_bases, prepared_store  # noqa: E402
from flops import matmul_rate, step_flops  # noqa: E402

from megabase.pipeline.config import TrainConfig  # noqa: E402

FROM = TrainConfig.segment_from  # windows longer than this (and the segment) are walked


def child(form: str, n: int, preset: str, store: str | None, segment: int,
          recompute: str) -> None:
    """One optimizer step in this fresh process; prints a JSON line."""
    from megabase.model import build_model
    from megabase.model.walk import walked_forward
    from megabase.pipeline.memory import apply_recompute, heap_trimmer

    torch.manual_seed(0)
    tokens = torch.from_numpy(human_bases(n + 1, store).astype(np.int64))[None]
    model = build_model(preset)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    if form == "old":
        apply_recompute(model, "layer")
    elif recompute != "none":
        apply_recompute(model, recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    mask = targets < 4
    start = time.perf_counter()
    if form == "old" or (form == "new" and not TrainConfig(segment=segment).walks(n)):
        out = model(ids, targets, loss_mask=mask)
    else:  # as the trainer walks it: the heap handed back between segments
        out = walked_forward(model, ids, targets, mask, segment, between=heap_trimmer())
    out.loss.backward()
    opt.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"form": form, "n": n, "seconds": seconds, "peak": peak,
                      "loss": float(out.loss.detach())}))


def run_child(form: str, n: int, preset: str, store: str | None, segment: int,
              recompute: str = "none") -> dict:
    cmd = [sys.executable, __file__, "--child", form, "--n", str(n), "--preset", preset,
           "--segment", str(segment), "--recompute", recompute] + (["--data", store] if store else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{form} at {n} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimates(preset: str, lengths: list[int], segment: int, recompute: str):
    """``{n: (predicted peak bytes, FLOPs by kind)}`` of the new form's step at each length."""
    from megabase.model import build_model
    from megabase.pipeline import fit
    from megabase.pipeline.config import load_config

    cfg = load_config(None, [f"model.preset={preset}", f"train.segment={segment}",
                             f"train.recompute={recompute}"])
    probe = fit.Probe(cfg)
    model = build_model(preset)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    out = {}
    for n in lengths:
        need = fit.step_need(probe, replace(cfg, data=replace(cfg.data, window_length=n)))
        out[n] = (need.total, step_flops(model, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="16384,65536,262144,1048576")
    ap.add_argument("--old-lengths", default="16384,65536,262144",
                    help="lengths to run the whole-window step at too (1,048,576 took 1,532 s "
                         "and 23.8 GB of this machine's 24 on 2026-12-03)")
    ap.add_argument("--segment", type=int, default=TrainConfig.segment)
    ap.add_argument("--recompute", default=TrainConfig.recompute,
                    help="recompute inside the walked step")
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--data", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--n", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.n, args.preset, args.data, args.segment, args.recompute)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    old = {int(x) for x in args.old_lengths.split(",") if x}
    import platform

    rate = matmul_rate()
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, preset {args.preset}; walked past {FROM:,} tokens in segments of "
          f"{args.segment:,} (recompute {args.recompute}); fp32 matmul {rate / 1e9:.1f} GFLOP/s",
          flush=True)
    predicted = estimates(args.preset, lengths, args.segment, args.recompute)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.data or prepared_store(tmp)
        walked = run_child("walk", lengths[0], args.preset, store, args.segment, args.recompute)
        walked_per = walked["seconds"] / lengths[0] * 1e3
        print(f"{lengths[0]:>9,} tokens walked in segments all the same: {walked['seconds']:.1f} s, "
              f"{walked_per:.3f} ms/token, peak {walked['peak'] / 1e9:.2f} GB", flush=True)
        base = None
        for n in lengths:
            new = run_child("new", n, args.preset, store, args.segment, args.recompute)
            per = new["seconds"] / n * 1e3
            base = per if base is None else base
            need, flops = predicted[n]
            total = sum(flops.values())
            share = total / new["seconds"] / rate
            kinds = ", ".join(f"{k} {v / total:.0%}" for k, v in flops.items())
            line = (f"{n:>9,} tokens: new {new['seconds']:.1f} s, {per:.3f} ms/token "
                    f"({per / base:.2f}x the shortest, {per / walked_per:.2f}x its walked step), peak {new['peak'] / 1e9:.2f} GB "
                    f"(fit estimate {need / 1e9:.2f} GB); {total / n / 1e6:.2f} MFLOP/token "
                    f"({kinds}) at {total / new['seconds'] / 1e9:.2f} GFLOP/s = {share:.1%} "
                    "of the matmul rate")
            if n in old:
                was = run_child("old", n, args.preset, store, args.segment)
                line += (f"; whole window (recompute=layer) {was['seconds']:.1f} s, "
                         f"{was['seconds'] / n * 1e3:.3f} ms/token, peak {was['peak'] / 1e9:.2f} "
                         f"GB -> time {was['seconds'] / new['seconds']:.2f}x, loss "
                         f"{new['loss']:.6f} vs {was['loss']:.6f}")
            print(line, flush=True)
    print(f"fp32 matmul at the end: {matmul_rate() / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
