"""The C sigmoid / SwiGLU (kernels/pointwise) against PyTorch's, and what they do to a step.

    python benchmarks/bench_pointwise.py [--length 16384] [--repeat 5]

The C kernels exist for exactness (an output's bits depend on its input only, not on the tensor's
length or the thread count); this checks they cost nothing: forward + backward of each op on
``[length x 4, 128]`` values, and a cpu-small training step (forward + backward) at ``length``
tokens with the C kernels and with PyTorch's ops (the kernel switched off in the same process),
interleaved. Prints each time and the ratio C / PyTorch (<= 1: no cost).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, timeit  # noqa: E402

import torch  # noqa: E402

from megabase.kernels.pointwise import cpu, reference  # noqa: E402


def op_times(n: int, repeat: int) -> dict[str, tuple[float, float]]:
    x = (torch.randn(n, 128) * 4).requires_grad_()
    out = {}
    for name in ("sigmoid", "swiglu"):
        times = []
        for impl in (getattr(cpu, name), getattr(reference, name)):
            def run():
                impl(x).sum().backward()
            times.append(timeit(run, repeat))
        out[name] = tuple(times)
    return out


def step_times(length: int, repeat: int) -> tuple[float, float]:
    from megabase.model import build_model

    torch.manual_seed(0)
    model = build_model("cpu-small")
    x = torch.randint(0, 4, (1, length + 1))
    available = cpu.available
    fast, slow = [], []

    def step():
        out = model(x[:, :-1], x[:, 1:])
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    for _ in range(repeat):
        for kind, times in (("c", fast), ("torch", slow)):
            cpu.available = available if kind == "c" else (lambda: False)
            times.append(timeit(step, 1))
    cpu.available = available
    return min(fast), min(slow)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16_384)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not cpu.available():
        sys.exit("the C kernel is unavailable here (no compiler?): nothing to compare")
    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    for name, (c, t) in op_times(args.length * 4, args.repeat).items():
        print(f"{name:8s} fwd+bwd [{args.length * 4:,} x 128]: C {c * 1e3:.1f} ms, "
              f"PyTorch {t * 1e3:.1f} ms, ratio {c / t:.2f}")
    c, t = step_times(args.length, args.repeat)
    print(f"cpu-small step at {args.length:,} tokens: C {c:.2f} s, PyTorch {t:.2f} s, "
          f"ratio {c / t:.2f}")


if __name__ == "__main__":
    main()
