"""Model benchmarks, each a ratio against a baseline measured in the same run.

    python benchmarks/bench_model.py [--only kda,conv,memory,hybrid,nocompiler] [--lengths 65536,...]

- kda: the PyTorch chunk form (``kda_chunk_torch``) and the C recurrence (``kda_chunk`` on CPU)
  vs the PyTorch recurrence ``kda_recurrent``, forward + backward at T = 8192 (target >= 20x).
- conv: the KDA layer's short convolution + SiLU (``cpu-small``: 384 channels, width 4), forward +
  backward at T = 32,768, the C kernel vs the PyTorch reference (same process, alternated, best of 3).
- memory: the ``debug`` preset, one forward + backward with per-layer recompute at each length, each
  in a fresh process; peak RSS per token at the longest vs the shortest length (target <= 1.3x),
  on real bases of the bundled genome.
- hybrid: one ``cpu-small`` training step vs a dense-attention Transformer (SDPA) of the same width,
  depth and active FFN size at T = 32,768 (target <= 0.2x its time).
- nocompiler: a ``cpu-small`` training step at T = 32,768 on a machine without a C compiler
  (``MEGABASE_NATIVE=0``: the PyTorch KDA chunk form and the reference DSA) vs the C kernels, each
  in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from megabase.kernels.conv import cpu as conv_cpu  # noqa: E402
from megabase.kernels.conv import reference as conv_reference  # noqa: E402
from megabase.kernels.kda import cpu as kda_cpu  # noqa: E402
from megabase.kernels.kda import kda_chunk_torch, kda_recurrent  # noqa: E402
from megabase.model import build_model, get_preset  # noqa: E402
from megabase.model.layers import RMSNorm, SwiGLU  # noqa: E402
from megabase.pipeline.memory import apply_recompute  # noqa: E402


def kda_inputs(T: int, H: int = 4, K: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, K, generator=gen)
    g = -5 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen) - 4)
    beta = torch.rand(1, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def step_time(fn, inputs) -> float:
    start = time.perf_counter()
    o, _ = fn(*inputs)
    o.square().mean().backward()
    return time.perf_counter() - start


def bench_kda(T: int = 8192) -> dict:
    forms = {"chunk": kda_chunk_torch, "recurrent": kda_recurrent}
    if kda_cpu.available():
        forms["c"] = kda_cpu.kda_recurrent
    for fn in forms.values():  # warm up allocators and kernels (and build the C kernel)
        step_time(fn, kda_inputs(256))
    out = {"T": T}
    for name, fn in forms.items():
        reps = 1 if name == "recurrent" else 3
        out[f"{name}_s"] = min(step_time(fn, kda_inputs(T)) for _ in range(reps))
    return out


def bench_conv(T: int = 32768, C: int = 384, W: int = 4) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, C, generator=gen).requires_grad_()
    w = (torch.randn(C, W, generator=gen) / W**0.5).requires_grad_()

    def once(fn):
        start = time.perf_counter()
        y, _ = fn(x, w)
        y.square().mean().backward()
        return time.perf_counter() - start

    times = {"torch": [], "c": []}
    for _ in range(3):  # alternated: the machine's speed drifts between runs of a few seconds
        times["torch"].append(once(conv_reference.short_conv))
        times["c"].append(once(conv_cpu.short_conv))
    return {"T": T, "C": C, **{f"{k}_s": min(v) for k, v in times.items()}}


def real_tokens(T: int) -> torch.Tensor:
    """``T + 1`` real bases: the bundled genome's records, concatenated."""
    import tempfile

    from megabase.data import TokenStore, default_genome, prepare

    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(str(default_genome())), Path(tmp) / "s", progress=False)
        store = TokenStore(Path(tmp) / "s")
        seq = np.concatenate([np.array(store.tokens(n)) for n in store.names])
    if len(seq) < T + 1:
        seq = np.tile(seq, (T + 1) // len(seq) + 1)
    return torch.from_numpy(seq[: T + 1].astype(np.int64))[None]


def current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(T: int) -> None:
    """One debug-preset training step at length T; prints a JSON line (run in a fresh process)."""
    torch.manual_seed(0)
    tokens = real_tokens(T)
    model = apply_recompute(build_model("debug"), "layer")
    baseline = current_rss()
    start = time.perf_counter()
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"T": T, "baseline": baseline, "peak": peak, "seconds": seconds,
                      "loss": float(out.loss)}))


def bench_memory(lengths: list[int]) -> list[dict]:
    rows = []
    for T in lengths:
        done = subprocess.run([sys.executable, __file__, "--memory-child", str(T)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"memory run at T={T} failed:\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["net_per_token"] = (row["peak"] - row["baseline"]) / T
        row["peak_per_token"] = row["peak"] / T
        rows.append(row)
        print(f"  T={T:>9,}: peak RSS {row['peak'] / 2**30:6.2f} GiB "
              f"(step {(row['peak'] - row['baseline']) / 2**30:6.2f} GiB, "
              f"{row['net_per_token']:8.0f} B/token), {row['seconds']:7.1f} s", flush=True)
    return rows


class DenseBlock(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ffn = SwiGLU(d, hidden)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, T, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, d))
        return x + self.ffn(self.norm2(x))


class DenseLM(nn.Module):
    """The baseline: a plain Transformer with SDPA attention, same width/depth/active FFN."""

    def __init__(self, d: int, layers: int, heads: int, hidden: int, vocab: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(DenseBlock(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def bench_hybrid(T: int = 32768) -> dict:
    cfg = get_preset("cpu-small")
    tokens = real_tokens(T)
    hybrid = build_model("cpu-small")
    dense = DenseLM(cfg.d_model, cfg.n_layers, cfg.dsa_heads,
                    cfg.experts_per_token * cfg.expert_dim + cfg.shared_expert_dim)

    def step(model, loss_of):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_of(model).backward()
        return time.perf_counter() - start

    def hybrid_loss(m):
        return m(tokens[:, :-1], tokens[:, 1:]).loss

    def dense_loss(m):
        return m(tokens[:, :-1], tokens[:, 1:])

    short = tokens[:, :2049]
    hybrid(short[:, :-1], short[:, 1:]).loss.backward()  # warm-up
    dense(short[:, :-1], short[:, 1:]).backward()
    t_hybrid = min(step(hybrid, hybrid_loss) for _ in range(2))
    t_dense = step(dense, dense_loss)
    return {"T": T, "hybrid_s": t_hybrid, "dense_s": t_dense, "ratio": t_hybrid / t_dense}


def nocompiler_child(backend: str, T: int = 32768) -> None:
    tokens = real_tokens(T)
    model = build_model("cpu-small", dsa_backend=backend)
    short = tokens[:, :2049]
    model(short[:, :-1], short[:, 1:]).loss.backward()  # warm-up
    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"backend": backend, "step_s": min(times)}))


def bench_nocompiler() -> dict:
    out = {}
    for name, backend, native in (("nocompiler", "cpu", "0"), ("c", "cpu", "1")):
        env = {**os.environ, "MEGABASE_NATIVE": native}
        run = subprocess.run([sys.executable, __file__, "--nocompiler-child", backend], env=env,
                             capture_output=True, text=True, check=True)
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--only", default="kda,conv,memory,hybrid")
    parser.add_argument("--lengths", default="65536,262144,1048576")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nocompiler-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.nocompiler_child:
        nocompiler_child(args.nocompiler_child)
        return
    only = set(args.only.split(","))
    print(f"machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)
    if "kda" in only:
        r = bench_kda()
        print(f"kda fwd+bwd T={r['T']}: PyTorch recurrent {r['recurrent_s']:.3f} s, PyTorch chunk "
              f"{r['chunk_s']:.3f} s -> ratio recurrent/chunk {r['recurrent_s'] / r['chunk_s']:.1f}x "
              "(target >= 20)", flush=True)
        if "c_s" in r:
            print(f"  C recurrence (kda_chunk's CPU default) {r['c_s']:.3f} s -> "
                  f"{r['recurrent_s'] / r['c_s']:.1f}x the PyTorch recurrence, "
                  f"{r['chunk_s'] / r['c_s']:.1f}x the PyTorch chunk form", flush=True)
    if "conv" in only and conv_cpu.available():
        r = bench_conv()
        print(f"short conv + SiLU fwd+bwd [1, {r['T']:,}, {r['C']}]: PyTorch {r['torch_s']:.3f} s, C "
              f"{r['c_s']:.3f} s -> ratio {r['torch_s'] / r['c_s']:.1f}x", flush=True)
    if "memory" in only:
        print("debug preset, forward+backward, recompute=layer:", flush=True)
        rows = bench_memory([int(x) for x in args.lengths.split(",")])
        first, last = rows[0], rows[-1]
        print(f"ratio peak RSS/token T={last['T']:,} vs T={first['T']:,}: "
              f"{last['peak_per_token'] / first['peak_per_token']:.2f}x whole process, "
              f"{last['net_per_token'] / first['net_per_token']:.2f}x step only (target <= 1.3)")
    if "hybrid" in only:
        r = bench_hybrid()
        print(f"cpu-small step T={r['T']:,}: hybrid {r['hybrid_s']:.2f} s, dense SDPA "
              f"{r['dense_s']:.2f} s -> ratio hybrid/dense {r['ratio']:.3f}x (target <= 0.2)")
    if "nocompiler" in only:
        r = bench_nocompiler()
        print(f"cpu-small step T=32,768: without a C compiler {r['nocompiler']:.2f} s, C kernels "
              f"{r['c']:.2f} s -> ratio {r['nocompiler'] / r['c']:.2f}x")


if __name__ == "__main__":
    main()
