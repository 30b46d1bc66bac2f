"""The DSA indexer's candidate stage at length, each figure beside a baseline of the same run.

    python benchmarks/bench_stage.py [--only score,kernel,train,quality] [--preset cpu-small]
        [--checkpoint CKPT --data STORE --region chr22:40,000,001-51,304,566]

- score: ``megabase score``'s streamed scoring (``megabase.infer.score_tokens``) of 65,536 and of
  ``--score-length`` (default 1,048,576) real bases of human chr22 (the held-out region; the
  bundled genome tiled if ``../shared/genomes`` is absent), each in a fresh process, with a
  freshly initialised ``--preset`` (speed and memory do not depend on the weights): seconds per
  base of each and their ratio (target <= 1.5), the long one's seconds (target <= 15 minutes) and
  peak RSS (target <= 3 GB).
- kernel: the C indexer for 2,048 queries over 65,536 / 262,144 / 1,048,576 keys (cpu-small's
  index shape), the stage (from position 0) vs the exact scan: microseconds per query, ratio.
- train: one ``--preset`` optimizer step with recompute=layer at 262,144 and 1,048,576 tokens,
  the stage (the preset's) vs the exact scan (``--exact-train`` lengths, default 262,144; the
  exact 1,048,576 step takes ~35 minutes here), each in a fresh process: seconds, peak RSS.
- quality (``--checkpoint`` and ``--data``: a trained model and its store): on windows of
  ``--region`` at 65,536 (``--windows`` of them, default 4) and 262,144 (one; both
  ``--quality-lengths``), with the stage from
  position 0 (``start=0``: at its default start of 65,536 it would not apply at 65,536): per DSA
  layer, on sampled queries, the share of the exact top-k's attention mass (head-summed,
  normalised: the sparse indexer loss's target) that the stage's selection keeps, the share of
  the exact top-k's keys, and the relative error of the attention output; and the held-out
  bits/base of the bases past the stage's first position, exact vs stage, paired per window.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GENOMES, machine  # noqa: E402

from megabase.core.vocab import SEP  # noqa: E402

HELD_OUT = ("chr22", 40_000_000)  # human chr22 from 40 Mb: held out by the human protocol


def human_bases(n: int, store: str | None) -> np.ndarray:
    """``n`` bases of human chr22 from 40 Mb (N included, as a scored region has them), from
    ``store`` or the bundled genome's chr22 tiled when there is none."""
    from megabase.data import TokenStore

    if store:
        chrom, start = HELD_OUT
        return np.array(TokenStore(store).tokens(chrom)[start : start + n])
    from bench_use import bases

    return bases(n)


def prepared_store(tmp: str) -> str | None:
    from megabase.data import prepare

    fasta = GENOMES / "hsap_chr22_subset.fa.gz"
    if not fasta.is_file():
        return None
    prepare(fasta, Path(tmp) / "hsap", progress=False)
    return str(Path(tmp) / "hsap")


def model_of(preset: str, **overrides):
    from bench_use import model_of as untrained

    model = untrained(preset)
    if overrides:
        from megabase.model import HybridLM

        fresh = HybridLM(model.cfg.replace(**overrides)).eval()
        fresh.load_state_dict(model.state_dict())
        model = fresh
    return model


def child(kind: str, n: int, preset: str, store: str | None, exact: bool) -> None:
    """One measurement in this fresh process; prints a JSON line."""
    overrides = {"dsa_stage": "exact"} if exact else {}
    if kind == "score":
        from megabase.infer import score_tokens

        model, tokens = model_of(preset, **overrides), human_bases(n, store)
        start = time.perf_counter()
        score_tokens(model, tokens)
        seconds = time.perf_counter() - start
    else:  # one training step
        from megabase.model import build_model
        from megabase.pipeline.memory import apply_recompute

        torch.manual_seed(0)
        tokens = torch.from_numpy(human_bases(n + 1, store).astype(np.int64))[None]
        model = apply_recompute(build_model(preset, **overrides), "layer")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        opt.step()
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"kind": kind, "n": n, "seconds": seconds, "peak": peak}))


def run_child(kind: str, n: int, preset: str, store: str | None, exact: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--n", str(n), "--preset", preset]
    cmd += (["--data", store] if store else []) + (["--exact"] if exact else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} at {n} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_kernel(preset: str, queries: int = 2_048) -> list[dict]:
    from megabase.kernels.dsa import dsa_indexer
    from megabase.model import get_preset

    cfg = get_preset(preset, dsa_stage={"start": 0})  # the stage on every query, even at 65,536
    stage = cfg.stage()
    gen = torch.Generator().manual_seed(0)
    out = []
    for keys in (65_536, 262_144, 1_048_576):
        qi = torch.randn(1, queries, cfg.index_heads, cfg.index_dim, generator=gen)
        ki = torch.randn(1, keys, cfg.index_dim, generator=gen)
        wi = torch.rand(1, queries, cfg.index_heads, generator=gen)
        times = {}
        for name, st in (("exact", None), ("stage", stage)):
            start = time.perf_counter()
            dsa_indexer(qi, ki, wi, cfg.topk, offset=keys - queries, stage=st, backend="cpu")
            times[name] = (time.perf_counter() - start) / queries
        out.append({"keys": keys, **times})
    return out


def _windows(store, region: str, length: int, count: int) -> list[np.ndarray]:
    """The first ``count`` tiles of ``length`` of ``region`` with at most half of them N."""
    from megabase.infer.common import resolve_regions

    iv = resolve_regions(store, [region])[0]
    seq = np.asarray(store.tokens(iv.chrom)[iv.start : iv.end])
    out = []
    for s in range(0, len(seq) - length + 1, length):
        tile = np.array(seq[s : s + length])
        if (tile >= 4).mean() <= 0.5:
            out.append(tile)
        if len(out) == count:
            break
    return out


def _layer_inputs(model, seq: torch.Tensor) -> list[tuple]:
    """Each DSA layer's projections ``(q, k, v, qi, ki, wi)`` in one exact full pass of ``seq``."""
    from megabase.model.dsa import DSALayer

    layers = [m for m in model.modules() if isinstance(m, DSALayer)]
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1].tokens)))
             for layer in layers]
    try:
        with torch.no_grad():
            model(seq)
            return [layer.project(x, ids) for layer, x, ids in seen]
    finally:
        for h in hooks:
            h.remove()


def selection_quality(model, stage, tokens: np.ndarray, runs: int = 8, per_run: int = 128,
                      seed: int = 0) -> list[dict]:
    """Per DSA layer of ``model`` (exact: its activations are the reference's), ``stage`` against
    the exact scan: mean (and 10th percentile) attention mass kept, keys kept and the relative
    output error over ``runs`` stretches of ``per_run`` consecutive queries from the window's
    second quarter on."""
    from megabase.kernels.dsa import dsa_indexer, seed_keys, sparse_attention

    seq = torch.from_numpy(np.concatenate([[SEP], tokens[:-1]]).astype(np.int64))[None]
    T = seq.shape[1]
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(np.arange(max(T // 4, stage.first_staged()), T - per_run), runs,
                                replace=False))
    rows = []
    for q, k, v, qi, ki, wi in _layer_inputs(model, seq):
        mass, keys, err = [], [], []
        for s in (int(x) for x in starts):
            rows_q = slice(s, s + per_run)
            args = (qi[:, rows_q], ki[:, : s + per_run], wi[:, rows_q], model.cfg.topk)
            exact = dsa_indexer(*args, offset=s, backend="cpu")
            staged = dsa_indexer(*args, offset=s, backend="cpu", stage=stage,
                                 seeds=seed_keys(seq[:, : s + per_run], s, stage))
            o, p = sparse_attention(q[:, rows_q], k, v, exact, return_probs=True)
            o2 = sparse_attention(q[:, rows_q], k, v, staged)
            kept = (exact[..., :, None] == staged[..., None, :]).any(-1) & (exact >= 0)
            mass += (p * kept).sum(-1).flatten().tolist()
            keys += (kept.sum(-1) / (exact >= 0).sum(-1)).flatten().tolist()
            err += ((o2 - o).flatten(2).norm(dim=-1) / o.flatten(2).norm(dim=-1)).flatten().tolist()
        rows.append({"mass": float(np.mean(mass)), "mass_p10": float(np.quantile(mass, 0.1)),
                     "keys": float(np.mean(keys)), "output_error": float(np.mean(err))})
    return rows


def bench_quality(checkpoint: str, data: str, region: str, windows: int,
                  lengths: tuple[int, int] = (65_536, 262_144)) -> list[dict]:
    from megabase.data import TokenStore
    from megabase.model import load_checkpoint, log_probs
    from megabase.model.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    staged_model = load_checkpoint(ckpt, dsa_stage={"start": 0}).eval()
    exact_model = load_checkpoint(ckpt, dsa_stage="exact").eval()
    stage = staged_model.cfg.stage()
    store = TokenStore(data)
    out = []
    for length, count in ((lengths[0], windows), (lengths[1], 1)):
        tiles = _windows(store, region, length, count)
        quality = [selection_quality(exact_model, stage, t, seed=i) for i, t in enumerate(tiles)]
        layers = [{k: float(np.mean([q[i][k] for q in quality])) for k in quality[0][i]}
                  for i in range(len(quality[0]))]
        bits = {"exact": [], "stage": []}
        for tile in tiles:
            seq = torch.from_numpy(np.concatenate([[SEP], tile]).astype(np.int64))[None]
            scored = (tile < 4) & (np.arange(length) >= stage.first_staged())
            for name, model in (("exact", exact_model), ("stage", staged_model)):
                start = time.perf_counter()
                nats = -log_probs(model, seq, segment=16_384)[0].double().numpy()
                bits[name].append((nats[scored].sum() / np.log(2), int(scored.sum()),
                                   time.perf_counter() - start))
        per = {n: sum(b[0] for b in v) / sum(b[1] for b in v) for n, v in bits.items()}
        diffs = [(s[0] - e[0]) / e[1] for s, e in zip(bits["stage"], bits["exact"])]
        out.append({"length": length, "windows": len(tiles), "layers": layers,
                    "bits_exact": per["exact"], "bits_stage": per["stage"],
                    "diff_per_window": diffs, "bases": sum(b[1] for b in bits["exact"]),
                    "seconds_exact": sum(b[2] for b in bits["exact"]),
                    "seconds_stage": sum(b[2] for b in bits["stage"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", default="score,kernel,train,quality")
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--score-length", type=int, default=1_048_576)
    parser.add_argument("--train-lengths", default="262144,1048576")
    parser.add_argument("--exact-train", default="262144",
                        help="lengths whose training step also runs with the exact scan")
    parser.add_argument("--checkpoint", help="a trained checkpoint (or run folder), for quality")
    parser.add_argument("--data", help="its token store (also the bases of score and train)")
    parser.add_argument("--region", default="chr22:40,000,001-51,304,566")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--quality-lengths", default="65536,262144",
                        help="quality: --windows windows of the first length, one of the second")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.n, args.preset, args.data, args.exact)
        return
    only = set(args.only.split(","))
    print(f"machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"preset {args.preset}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.data or (prepared_store(tmp) if only & {"score", "train"} else None)
        if "score" in only:
            small, big = (run_child("score", n, args.preset, store) for n in (65_536, args.score_length))
            per_small, per_big = small["seconds"] / 65_536, big["seconds"] / args.score_length
            print(f"score: {args.score_length:,} bases {big['seconds']:.0f} s "
                  f"({per_big * 1e6:.0f} us/base, peak RSS {big['peak'] / 1e9:.2f} GB), 65,536 "
                  f"bases {small['seconds']:.1f} s ({per_small * 1e6:.0f} us/base, peak "
                  f"{small['peak'] / 1e9:.2f} GB) -> per-base ratio {per_big / per_small:.2f}x "
                  "(target <= 1.5)", flush=True)
        if "kernel" in only:
            for r in bench_kernel(args.preset):
                print(f"indexer over {r['keys']:,} keys: exact {r['exact'] * 1e6:.0f} us/query, "
                      f"stage {r['stage'] * 1e6:.0f} us/query -> ratio "
                      f"{r['exact'] / r['stage']:.1f}x", flush=True)
        if "train" in only:
            exact_lengths = {int(x) for x in args.exact_train.split(",") if x}
            for n in (int(x) for x in args.train_lengths.split(",")):
                r = run_child("train", n, args.preset, store)
                line = (f"train step at {n:,} tokens (recompute=layer): stage {r['seconds']:.0f} s, "
                        f"peak RSS {r['peak'] / 1e9:.2f} GB")
                if n in exact_lengths:
                    e = run_child("train", n, args.preset, store, exact=True)
                    line += (f"; exact {e['seconds']:.0f} s, peak {e['peak'] / 1e9:.2f} GB -> "
                             f"{e['seconds'] / r['seconds']:.2f}x the time")
                print(line, flush=True)
    if "quality" in only and args.checkpoint and args.data:
        lengths = tuple(int(x) for x in args.quality_lengths.split(","))
        for r in bench_quality(args.checkpoint, args.data, args.region, args.windows, lengths):
            layers = "; ".join(f"layer {i}: mass {q['mass']:.3f} (p10 {q['mass_p10']:.3f}), keys "
                               f"{q['keys']:.3f}, output error {q['output_error']:.3f}"
                               for i, q in enumerate(r["layers"]))
            print(f"quality at {r['length']:,} ({r['windows']} windows, {r['bases']:,} scored "
                  f"bases): {layers}; bits/base exact {r['bits_exact']:.5f}, stage "
                  f"{r['bits_stage']:.5f} (diff {r['bits_stage'] - r['bits_exact']:+.5f}; per "
                  f"window {', '.join(f'{d:+.5f}' for d in r['diff_per_window'])}); scoring "
                  f"{r['seconds_exact']:.0f} s exact, {r['seconds_stage']:.0f} s stage", flush=True)


if __name__ == "__main__":
    main()
