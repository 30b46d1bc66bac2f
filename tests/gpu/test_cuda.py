"""CUDA checks, run by benchmarks/gpu_check.sh on a GPU machine; skipped everywhere else.

Triton DSA kernels vs the reference at model-like shapes, KDA through fla vs our chunk form, the
hybrid model's streaming vs full log-probs in bf16, and a bf16 training step of gpu-1b-shaped
layers.
"""

import gzip

import numpy as np
import pytest
import torch

from tests.kernels.tolerances import assert_close, rel_rms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bundled_tokens(n: int) -> torch.Tensor:
    from megabase.data import default_genome
    from megabase.core.vocab import TOKEN_TABLE

    with gzip.open(str(default_genome()), "rb") as fh:
        seq = b"".join(line.strip() for line in fh if not line.startswith(b">"))
    tokens = np.frombuffer(seq[: n + 1].translate(TOKEN_TABLE), dtype=np.uint8)
    return torch.from_numpy(tokens.astype(np.int64))[None].cuda()


@pytest.mark.parametrize("T, topk", [(1000, 64), (3001, 256)])
def test_triton_dsa_matches_the_reference_on_cuda(T, topk):
    from megabase.kernels.dsa import dsa_indexer, indexer_kl_sparse, sparse_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 8, 64, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(1, T, 2, 64, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(1, T, 2, 64, device="cuda", generator=g, requires_grad=True)
    qi = torch.randn(1, T, 4, 32, device="cuda", generator=g)
    ki = torch.randn(1, T, 32, device="cuda", generator=g)
    wi = torch.randn(1, T, 4, device="cuda", generator=g)
    idx = dsa_indexer(qi, ki, wi, topk, backend="triton")
    ref = dsa_indexer(qi, ki, wi, topk, backend="reference")
    same = (idx == ref).all(-1).float().mean().item()
    assert same > 0.999, f"{1 - same:.2%} of queries selected another set"  # fp32 sum order
    o, p = sparse_attention(q, k, v, ref, return_probs=True, backend="triton")
    o_ref, p_ref = sparse_attention(q, k, v, ref, return_probs=True, backend="reference")
    assert_close(o, o_ref, "o")
    for name, a, b in zip("qkv", torch.autograd.grad(o.square().sum(), (q, k, v)),
                          torch.autograd.grad(o_ref.square().sum(), (q, k, v))):
        assert_close(a, b, f"d{name}")
    qr = qi.clone().requires_grad_()
    kl, kl_ref = (indexer_kl_sparse(qr, ki, wi, ref, p_ref, backend=b)
                  for b in ("triton", "reference"))
    assert_close(kl, kl_ref, "kl")


def test_kda_through_fla_matches_the_chunk_form():
    pytest.importorskip("fla.ops.kda")
    from megabase.kernels.kda import kda_chunk

    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, K = 2048, 4, 64
    q = torch.randn(1, T, H, K, device="cuda", generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(1, T, H, K, device="cuda", generator=g)
    gate = -5 * torch.sigmoid(torch.randn(1, T, H, K, device="cuda", generator=g) - 3)
    beta = torch.rand(1, T, H, device="cuda", generator=g)
    o, s = kda_chunk(q, k, v, gate, beta, output_final_state=True, backend="fla")
    o_ref, s_ref = kda_chunk(q, k, v, gate, beta, output_final_state=True, backend="torch")
    assert rel_rms(o, o_ref) <= 1e-3 and rel_rms(s, s_ref) <= 1e-3  # fla uses tf32 products


def test_streaming_equals_full_in_bf16():
    from megabase.model import build_model, log_probs

    torch.manual_seed(0)
    model = build_model("debug").cuda().eval()
    tokens = bundled_tokens(20_000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = log_probs(model, tokens)
        stream = log_probs(model, tokens, segment=[1, 4999, 3333, 7, 6000, 5659])
    delta = (full - stream).abs().max().item()
    assert delta <= 0.05, f"max |delta log p| {delta:.4f} nats in bf16"


def test_gpu_1b_layers_train_one_bf16_step():
    from megabase.model import build_model
    from megabase.pipeline.memory import apply_recompute

    model = apply_recompute(build_model("gpu-1b", n_layers=4).cuda(), "selective")
    tokens = bundled_tokens(16_384)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    assert torch.isfinite(out.loss) and 1.0 < out.lm_loss.item() / np.log(2) < 4.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
