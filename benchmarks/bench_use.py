"""Using a trained model at length, each figure a ratio against a baseline measured in the same run.

    python benchmarks/bench_use.py [--only embed,generate,batch,variants,samples] [--preset cpu-small]
        [--checkpoint RUN --data STORE --region REGION]

(Scoring at a megabase, its time per base and memory: ``benchmarks/bench_stage.py --only score``.)

On real bases of the bundled genome's chr22 (tiled where a length exceeds it), with a freshly
initialised model of ``--preset`` (speed and memory do not depend on the weights):

- embed: peak RSS of a mean-pooled embedding of 262,144 bases, streamed (65,536-base pieces) vs one
  full pass, each in a fresh process.
- generate: seconds per new base after a 65,536-base prompt, incremental (one step through the
  carried state) vs re-running the whole prefix for every base (target >= 100x).
- batch: milliseconds per decoding step of 16 sequences after 256-base prompts (as ``megabase rl``
  and ``generate --num-samples`` decode), the batch's new tokens through each MoE layer as one chunk
  vs one chunk per sequence (the path every other forward takes).
- variants: ``--variants`` SNVs (default 100) in one ``--window``-base window (default 16,384),
  shared reference pass vs two full passes per variant (one full pass timed, times 2 x variants;
  target >= 3x, floor ~4x), in a fresh process, with its peak RSS.
- samples (only with ``--checkpoint`` and ``--data``, a trained model and its token store): after a
  65,536-base prompt from ``--region`` (held out from training), ``--sample-length`` generated
  bases; their GC content and 6-mer spectrum total variation against the region's other bases,
  beside the same distance for the real continuation of the prompt (a real sample of that length:
  the floor) and for an i.i.d. sequence of the held-out base composition (no model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from megabase.core.vocab import SEP, gc_fraction  # noqa: E402
from megabase.model import advance, decode_step  # noqa: E402


def bases(n: int, offset: int = 0) -> np.ndarray:
    """``n`` real bases of the bundled genome's chr22 from ``offset`` (tiled past its end)."""
    import tempfile

    from megabase.data import TokenStore, default_genome, prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(str(default_genome())), Path(tmp) / "s", progress=False)
        seq = np.array(TokenStore(Path(tmp) / "s").tokens("chr22"))
    seq = np.tile(seq, (offset + n) // len(seq) + 1)
    return seq[offset : offset + n]


def model_of(preset: str):
    from megabase.model import build_model

    torch.manual_seed(0)
    model = build_model(preset).eval()
    with torch.no_grad():  # the zero-started head and k-mer tables: give the outputs some spread
        model.head.weight.normal_(0, 0.5)
        if model.kmers is not None:
            model.kmers.table.normal_(0, 0.3)
    return model


def child(kind: str, n: int, preset: str, variants: int = 0) -> None:
    """One measurement in this fresh process; prints a JSON line."""
    import resource

    from megabase.infer import embed_tokens

    if kind == "variants":
        r = bench_variants(preset, variants, n)
        r["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(r))
        return
    model, tokens = model_of(preset), bases(n)
    start = time.perf_counter()
    if kind == "embed-stream":
        embed_tokens(model, tokens, segment=65_536)
    elif kind == "embed-full":
        embed_tokens(model, tokens, segment=n + 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"kind": kind, "n": n, "peak": peak, "seconds": time.perf_counter() - start}))


def run_child(kind: str, n: int, preset: str, variants: int = 0) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--n", str(n), "--preset",
                           preset, "--variants", str(variants)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} at {n} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kmer_spectrum(tokens: np.ndarray, k: int = 6) -> np.ndarray:
    ok = tokens < 4
    codes = np.zeros(len(tokens) - k + 1, dtype=np.int64)
    valid = np.ones(len(codes), dtype=bool)
    for j in range(k):
        codes = codes * 4 + np.minimum(tokens[j : j + len(codes)], 3)
        valid &= ok[j : j + len(codes)]
    counts = np.bincount(codes[valid], minlength=4**k).astype(np.float64)
    return counts / max(counts.sum(), 1)


def bench_generate(preset: str, prompt_length: int = 65_536, steps: int = 100) -> dict:
    model, prompt = model_of(preset), bases(prompt_length)
    seq = torch.from_numpy(np.concatenate([[SEP], prompt]).astype(np.int64))[None]
    with torch.no_grad():
        state = model.init_state()
        advance(model, seq, state)
        next_base = torch.tensor([[2]])
        start = time.perf_counter()
        for _ in range(steps):  # as the sampler takes each step
            decode_step(model, next_base, state)
        per_base = (time.perf_counter() - start) / steps
        start = time.perf_counter()
        model(seq)  # what re-running the prefix costs for every new base
        rerun = time.perf_counter() - start
    return {"incremental_s": per_base, "rerun_s": rerun}


def per_sequence_moe(forward):
    """``MoE.forward`` run one sequence of the batch at a time: the path a decoding step took
    before the batch's new tokens went through the experts as one chunk."""
    def run(self, x, ctx):
        parts = [forward(self, x[b : b + 1], ctx) for b in range(x.shape[0])]
        used = torch.cat([p[3][0] for p in parts]), torch.cat([p[3][1] for p in parts])
        return (torch.cat([p[0] for p in parts]), sum(p[1] for p in parts),
                sum(p[2] for p in parts), used)
    return run


def bench_batch(preset: str, batch: int = 16, prompt_length: int = 256, steps: int = 50) -> dict:
    """A decoding step of ``batch`` sequences: the MoE layers' new tokens as one chunk (what
    ``decode_step`` does) against one MoE call per sequence (:func:`per_sequence_moe`)."""
    from megabase.model.moe import MoE

    model = model_of(preset)
    prompts = torch.from_numpy(bases(batch * prompt_length).astype(np.int64)).reshape(batch, -1)
    seq = torch.cat([torch.full((batch, 1), SEP), prompts], dim=1)
    per_step, one_chunk = {}, MoE.forward
    try:
        with torch.no_grad():
            for name in ("per_sequence", "one_chunk", "per_sequence", "one_chunk"):
                MoE.forward = per_sequence_moe(one_chunk) if name == "per_sequence" else one_chunk
                state = model.init_state()
                advance(model, seq, state)
                nxt = torch.randint(0, 4, (steps, batch, 1),
                                    generator=torch.Generator().manual_seed(0))
                start = time.perf_counter()
                for i in range(steps):  # as the samplers take each step
                    decode_step(model, nxt[i], state)
                # the better of two rounds each: the first round of either warms the allocator
                per_step[name] = min(per_step.get(name, float("inf")),
                                     (time.perf_counter() - start) / steps)
    finally:
        MoE.forward = one_chunk
    return per_step


def bench_variants(preset: str, count: int, window: int) -> dict:
    from megabase.infer import score_tile

    model, tile = model_of(preset), bases(window, offset=100_000)
    rng = np.random.default_rng(0)
    positions = np.sort(rng.choice(len(tile), count, replace=False))
    edits = [(int(p), tile[p : p + 1], np.array([(tile[p] + 1 + rng.integers(3)) % 4], dtype=np.uint8))
             for p in positions]
    seq = torch.from_numpy(np.concatenate([[SEP], tile]).astype(np.int64))[None]
    with torch.no_grad():
        model(seq[:, :1025])  # the first call's one-off costs (allocator, kernel set-up) not timed
        start = time.perf_counter()
        model(seq[:, :-1])
        full = time.perf_counter() - start
    start = time.perf_counter()
    score_tile(model, tile, edits)
    shared = time.perf_counter() - start
    return {"variants": count, "window": window, "full_pass_s": full, "shared_s": shared,
            "naive_s": 2 * count * full, "ratio": 2 * count * full / shared}


def bench_samples(checkpoint: str, data: str, region: str, length: int, prompt_length: int = 65_536,
                  seed: int = 1) -> dict:
    from megabase.data import TokenStore
    from megabase.infer import generate_tokens
    from megabase.infer.common import load_model, resolve_regions

    store = TokenStore(data)
    iv = resolve_regions(store, [region])[0]
    held = np.asarray(store.tokens(iv.chrom)[iv.start : iv.end])
    real = np.flatnonzero(held < 4)
    if len(real) < prompt_length + 10 * length:
        raise SystemExit(f"{region}: {len(real):,} real bases, need {prompt_length + 10 * length:,}")
    start = real[len(real) // 2 - prompt_length]  # a prompt from the middle of the region
    prompt = held[start : start + prompt_length]
    after = held[start + prompt_length :]
    end = np.flatnonzero(after < 4)[length - 1] + 1  # the continuation's extent, N included
    continuation = after[:end][after[:end] < 4]
    pool = np.concatenate([held[:start], after[end:]])  # the rest of the region
    pool_spectrum = kmer_spectrum(pool)
    composition = np.bincount(pool[pool < 4], minlength=4) / (pool < 4).sum()
    iid = np.random.default_rng(seed).choice(4, length, p=composition).astype(np.uint8)
    model = load_model(checkpoint)
    started = time.perf_counter()
    sample = generate_tokens(model, prompt, length, seed=seed)
    seconds = time.perf_counter() - started

    def tv(tokens: np.ndarray) -> float:
        return float(0.5 * np.abs(kmer_spectrum(tokens) - pool_spectrum).sum())

    return {"length": length, "seconds": seconds, "gc": sample.gc,
            "bits_per_base": float(-sample.log_probs.mean() / np.log(2)),
            "held_out_gc": float(composition[1] + composition[2]),
            "continuation_gc": gc_fraction(continuation),
            "tv": tv(sample.tokens), "tv_continuation": tv(continuation), "tv_iid": tv(iid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", default="embed,generate,batch,variants,samples")
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--variants", type=int, default=100)
    parser.add_argument("--window", type=int, default=16_384,
                        help="variants benchmark window (the issue's 65,536 x 1,000 SNVs takes hours "
                        "on 2 cores)")
    parser.add_argument("--checkpoint", help="a trained checkpoint (or run folder), for samples")
    parser.add_argument("--data", help="its token store, for samples")
    parser.add_argument("--region", default="chr22", help="held-out region the prompt and the "
                        "comparison come from (default chr22)")
    parser.add_argument("--sample-length", type=int, default=4_000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.n, args.preset, args.variants)
        return
    only = set(args.only.split(","))
    if "samples" in only and not (args.checkpoint and args.data):
        if args.only == "samples":
            raise SystemExit("samples needs --checkpoint and --data (a trained model and its store)")
        only.discard("samples")
    print(f"machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"preset {args.preset}", flush=True)
    if "embed" in only:
        stream, full = (run_child(k, 262_144, args.preset) for k in ("embed-stream", "embed-full"))
        print(f"embed 262,144 bases, peak RSS: streamed {stream['peak'] / 2**30:.2f} GiB, one full "
              f"pass {full['peak'] / 2**30:.2f} GiB -> ratio full/streamed "
              f"{full['peak'] / stream['peak']:.2f}x", flush=True)
    if "generate" in only:
        r = bench_generate(args.preset)
        print(f"generate after 65,536 bases: {r['incremental_s'] * 1e3:.1f} ms per base incremental "
              "(one thread), "
              f"{r['rerun_s']:.2f} s re-running the prefix -> ratio {r['rerun_s'] / r['incremental_s']:.0f}x "
              "(target >= 100)", flush=True)
    if "batch" in only:
        r = bench_batch(args.preset)
        print(f"decoding 16 sequences after 256 bases: {r['one_chunk'] * 1e3:.1f} ms per step with the "
              f"batch as one MoE chunk, {r['per_sequence'] * 1e3:.1f} ms one chunk per sequence -> "
              f"ratio {r['per_sequence'] / r['one_chunk']:.2f}x", flush=True)
    if "variants" in only:
        r = run_child("variants", args.window, args.preset, args.variants)
        print(f"variants: {r['variants']} SNVs in one {r['window']:,}-base window: shared pass {r['shared_s']:.1f} s, "
              f"two full passes each {r['naive_s']:.1f} s ({r['full_pass_s']:.2f} s a pass) -> ratio "
              f"{r['ratio']:.2f}x (target >= 3; peak RSS {r['peak'] / 2**30:.2f} GiB)", flush=True)
    if "samples" in only:
        r = bench_samples(args.checkpoint, args.data, args.region, args.sample_length)
        print(f"samples, {r['length']:,} bases after 65,536 of {args.region} ({r['seconds']:.0f} s, "
              f"{r['bits_per_base']:.3f} bits/base by the model): GC {100 * r['gc']:.1f}% (held-out "
              f"{100 * r['held_out_gc']:.1f}%, real continuation {100 * r['continuation_gc']:.1f}%); "
              f"6-mer spectrum total variation vs the held-out region {r['tv']:.3f} (the real "
              f"continuation {r['tv_continuation']:.3f}, i.i.d. bases {r['tv_iid']:.3f}) -> "
              f"{(r['tv_iid'] - r['tv']) / max(r['tv_iid'] - r['tv_continuation'], 1e-9):.0%} of "
              "the way from i.i.d. to real", flush=True)


if __name__ == "__main__":
    main()
