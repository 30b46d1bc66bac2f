"""KDA on the CPU: the recurrence itself in C (``recurrent.c``), forward and backward.

Same signature and conventions as :func:`megabase.kernels.kda.reference.kda_recurrent`, whose loop
it runs: per token a few passes over each head's ``[K, V]`` state, heads in parallel. On two cores
that is several times faster than the chunkwise PyTorch form, whose many small products are bound by
dispatch and memory traffic. Autograd keeps the inputs and the state at every ``CHUNK``-th token;
the backward recomputes one chunk's states at a time (exact: the same operations in the same order),
so memory is O(T * (K + V)) with nothing quadratic in the chunk. The state and every sum are fp64
(inputs and outputs fp32), and so is the final state it returns: a recurrence carried across calls
(``initial_state``) is bit-for-bit the one computed in one call, however a sequence is cut.

Built on first use by :mod:`megabase.kernels.native`; :func:`available` is False where it cannot be.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from megabase.kernels import native
from megabase.kernels.precision import full_precision

CHUNK = 64

_F, _I = ctypes.c_void_p, ctypes.c_int64


def _lib():
    return native.bind(str(Path(__file__).with_name("recurrent.c")), {
        "megabase_kda_forward": [_F] * 6 + [_I] * 5 + [_F] * 3 + [ctypes.c_int],
        "megabase_kda_backward": [_F] * 8 + [_I] * 5 + [_F] * 6 + [ctypes.c_int],
    }, native.REASSOCIATE)


def available() -> bool:
    """Whether the C kernel is built (or can be) and enabled."""
    return _lib() is not None


def _ptr(x: torch.Tensor | None):
    return None if x is None else x.data_ptr()


class _Recurrent(torch.autograd.Function):
    """``q, k, g [N, T, K]``, ``v [N, T, V]``, ``beta [N, T]`` (fp32, contiguous, q pre-scaled),
    ``s0 [N, K, V]`` (fp64) or None -> ``(o [N, T, V] fp32, final state [N, K, V] fp64)``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0):
        N, T, K = q.shape
        V = v.shape[-1]
        o = q.new_empty(N, T, V)
        sT = q.new_empty(N, K, V, dtype=torch.float64)
        ckpt = q.new_empty(N, (T + CHUNK - 1) // CHUNK, K, V, dtype=torch.float64)
        status = _lib().megabase_kda_forward(
            _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(s0), N, T, K, V, CHUNK, _ptr(o),
            _ptr(sT), _ptr(ckpt), torch.get_num_threads())
        if status:
            raise MemoryError("the native KDA kernel could not allocate its buffers")
        ctx.save_for_backward(q, k, v, g, beta, ckpt)
        ctx.has_s0 = s0 is not None
        return o, sT

    @staticmethod
    @full_precision
    def backward(ctx, do, dsT):
        q, k, v, g, beta, ckpt = ctx.saved_tensors
        N, T, K = q.shape
        V = v.shape[-1]
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        ds0 = q.new_empty(N, K, V, dtype=torch.float64)
        do = do.float().contiguous()
        dsT = None if dsT is None else dsT.double().contiguous()
        status = _lib().megabase_kda_backward(
            _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(ckpt), _ptr(do), _ptr(dsT), N, T,
            K, V, CHUNK, *[_ptr(x) for x in grads], _ptr(ds0), torch.get_num_threads())
        if status:
            raise MemoryError("the native KDA kernel could not allocate its buffers")
        return (*grads, ds0 if ctx.has_s0 else None)


@full_precision
def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token KDA in C: ``(o [B, T, HV, V] (dtype of v), final_state [B, HV, K, V] fp64
    or None)``; CPU tensors, ``HV`` a multiple of ``H``, ``initial_state`` of any float dtype."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[-1]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of query/key heads ({H})")
    # the C kernel reads these layouts unchecked
    if k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, HV, K) or \
            beta.shape != (B, T, HV) or (initial_state is not None
                                         and initial_state.shape != (B, HV, K, V)):
        raise ValueError(f"KDA inputs do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    scale = K**-0.5 if scale is None else scale

    def heads(x, repeat=1):  # [B, T, h, *] -> [B * HV, T, *]
        x = x.float().repeat_interleave(repeat, dim=2) if repeat > 1 else x.float()
        return x.transpose(1, 2).reshape(B * HV, T, *x.shape[3:]).contiguous()

    s0 = None if initial_state is None else initial_state.double().reshape(B * HV, K, V).contiguous()
    o, sT = _Recurrent.apply(heads(q, HV // H) * scale, heads(k, HV // H), heads(v), heads(g),
                             heads(beta[..., None])[..., 0].contiguous(), s0)
    o = o.reshape(B, HV, T, V).transpose(1, 2).to(v.dtype)
    return o, (sT.reshape(B, HV, K, V) if output_final_state else None)
