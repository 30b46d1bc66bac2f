"""The one tolerance table every kernel test uses: relative RMS error of kernel vs reference."""

import torch

RTOL_RMS = {
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected||_2 / ||expected||_2`` in fp64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.pow(2).mean().sqrt()
    err = (a - e).pow(2).mean().sqrt()
    return float(err / denom) if denom > 0 else float(err)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    tol = RTOL_RMS[expected.dtype if expected.dtype in RTOL_RMS else torch.float32]
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.2e} > {tol:.0e}"
