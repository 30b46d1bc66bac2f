"""GPU measurements for benchmarks/gpu_check.sh: DSA kernels vs reference, gpu-1b training steps.

    python benchmarks/bench_gpu.py --out gpu_check.md [--budget 300] [--lengths 65536,...]

Each measurement is skipped (and says so in the table) once ``--budget`` seconds have been spent,
so the whole script ends in time on a lent machine. Writes one markdown file:

- DSA at T = 16k and 64k (gpu-1b's DSA shapes: 12 query heads, 4 key/value heads, dim 128,
  16 index heads of 64, top-k 2048): forward + backward of indexer + sparse attention + indexer KL,
  Triton vs the PyTorch reference on the same GPU, time and peak memory as ratios.
- gpu-1b, one bf16 training step (AdamW included) at each length with recompute=selective:
  tokens/s, peak GPU memory, MFU (model FLOPs / step time / 989 TFLOP/s dense bf16 of an H100/H200
  SXM), and at the shortest length the cost of recompute=layer and of offload, as ratios of step
  time and peak memory against recompute=selective.

Model FLOPs per token: 6 x active parameters (matmuls, forward + backward) plus, per DSA layer,
12 x topk x heads x head_dim (sparse attention) and 6 x T/2 x index_heads x index_dim (indexer,
causal mean); KDA's chunk products are counted as 6 x heads x head_dim x (64 + head_dim).
"""

from __future__ import annotations

import argparse
import time

import torch

PEAK_BF16 = 989e12


def timed(fn, reps: int = 2) -> tuple[float, float]:
    """(best seconds, peak GiB) of ``fn()`` after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, torch.cuda.max_memory_allocated() / 2**30


def dsa_case(T: int, backend: str):
    from megabase.kernels.dsa import dsa_indexer, indexer_kl_sparse, sparse_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 12, 128, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(1, T, 4, 128, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(1, T, 4, 128, device="cuda", generator=g, requires_grad=True)
    qi = torch.randn(1, T, 16, 64, device="cuda", generator=g, requires_grad=True)
    ki = torch.randn(1, T, 64, device="cuda", generator=g, requires_grad=True)
    wi = torch.randn(1, T, 16, device="cuda", generator=g, requires_grad=True)

    def step():
        idx = dsa_indexer(qi.detach(), ki.detach(), wi.detach(), 2048, backend=backend)
        o, p = sparse_attention(q, k, v, idx, return_probs=True, backend=backend)
        loss = o.float().square().mean() + indexer_kl_sparse(qi, ki, wi, idx, p, backend=backend)
        loss.backward()

    return step


def model_flops_per_token(cfg, T: int, active: int) -> float:
    flops = 6.0 * active
    for i in range(cfg.n_layers):
        if cfg.is_dsa(i):
            flops += 12 * min(cfg.topk, T) * cfg.dsa_heads * cfg.dsa_head_dim
            flops += 6 * (T / 2) * cfg.index_heads * cfg.index_dim
        else:
            flops += 6 * cfg.kda_heads * cfg.kda_head_dim * (64 + cfg.kda_head_dim)
    return flops


def train_case(T: int, recompute: str, offload: bool):
    from megabase.model import build_model, get_preset, parameter_counts
    from megabase.pipeline.memory import apply_offload, apply_recompute

    model = apply_recompute(build_model("gpu-1b").cuda(), recompute)
    if offload:
        apply_offload(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 4, (1, T + 1), device="cuda")
    cfg = get_preset("gpu-1b")
    flops = model_flops_per_token(cfg, T, parameter_counts(cfg)["active"]) * T

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, flops, (model, opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=300.0)
    parser.add_argument("--lengths", default="65536,262144,524288,1048576")
    args = parser.parse_args()
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    lines = [f"# gpu_check — {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")

    emit("## DSA (gpu-1b shapes, top-k 2048): Triton vs reference, fwd+bwd")
    emit("| T | Triton | reference | time ratio | Triton peak | reference peak | memory ratio |")
    emit("|---|---|---|---|---|---|---|")
    for T in (16384, 65536):
        if left() < 30:
            emit(f"| {T:,} | skipped: budget spent | | | | | |")
            continue
        tri = timed(dsa_case(T, "triton"), reps=1)
        torch.cuda.empty_cache()
        ref = timed(dsa_case(T, "reference"), reps=1) if left() > 60 else (float("nan"),) * 2
        torch.cuda.empty_cache()
        emit(f"| {T:,} | {tri[0]:.3f} s | {ref[0]:.3f} s | {ref[0] / tri[0]:.1f}x | "
             f"{tri[1]:.2f} GiB | {ref[1]:.2f} GiB | {ref[1] / tri[1]:.2f}x |")

    emit("")
    emit("## gpu-1b training step (bf16, AdamW, recompute=selective)")
    emit("| T | step | tokens/s | peak GPU memory | MFU |")
    emit("|---|---|---|---|---|")
    lengths = [int(x) for x in args.lengths.split(",")]
    base = None
    for T in lengths:
        if left() < 45:
            emit(f"| {T:,} | skipped: budget spent | | | |")
            continue
        try:
            step, flops, keep = train_case(T, "selective", False)
            seconds, peak = timed(step, reps=1)
        except torch.cuda.OutOfMemoryError:
            emit(f"| {T:,} | out of memory | | | |")
            continue
        finally:
            keep = None  # noqa: F841
            torch.cuda.empty_cache()
        base = base or (T, seconds, peak)
        emit(f"| {T:,} | {seconds:.2f} s | {T / seconds:,.0f} | {peak:.1f} GiB | "
             f"{flops / seconds / PEAK_BF16:.1%} |")

    emit("")
    emit(f"## memory knobs at T = {lengths[0]:,} (ratios vs recompute=selective)")
    emit("| knob | step time | peak memory |")
    emit("|---|---|---|")
    for label, recompute, offload in (("recompute=layer", "layer", False),
                                      ("recompute=selective + offload", "selective", True)):
        if base is None or left() < 45:
            emit(f"| {label} | skipped | |")
            continue
        step, _, keep = train_case(lengths[0], recompute, offload)
        seconds, peak = timed(step, reps=1)
        keep = None  # noqa: F841
        torch.cuda.empty_cache()
        emit(f"| {label} | {seconds / base[1]:.2f}x | {peak / base[2]:.2f}x |")
    emit("")
    emit(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
