"""Named model presets, one registry. Each states its parameter count (total and active)."""

from __future__ import annotations

from megabase.core.errors import InputError

from .config import ModelConfig
from .lm import HybridLM


DENSE_DIM = 463  # 1,820,672 active parameters; cpu-small: 1,820,796

PRESETS: dict[str, dict] = {
    # Tests: every part present (KDA, DSA with top-k below test lengths, MoE) at toy width.
    "debug": dict(
        d_model=32, n_layers=4, kmer_embed=4, kda_heads=2, kda_head_dim=16, kda_gate_rank=8,
        dsa_heads=2, dsa_kv_heads=1, dsa_head_dim=16, index_heads=2, index_dim=8, topk=32, dsa_kmer=16,
        n_experts=4, experts_per_token=2, expert_dim=32, shared_expert_dim=32,
        moe_chunk=4096, loss_chunk=16384, dsa_block=128,
    ),
    # The CPU demo: trains on 2 cores in minutes on 16k-64k windows.
    "cpu-small": dict(
        d_model=128, n_layers=8, kmer_embed=8, kda_heads=4, kda_head_dim=32, kda_gate_rank=16,
        dsa_heads=4, dsa_kv_heads=2, dsa_head_dim=32, index_heads=2, index_dim=16, topk=256, dsa_kmer=16,
        n_experts=8, experts_per_token=2, expert_dim=128, shared_expert_dim=128,
        moe_chunk=8192, loss_chunk=32768, dsa_block=256,
    ),
    # The dense baseline of cpu-small: full causal attention (SDPA, RoPE) in every layer and dense
    # SwiGLU FFNs, widths chosen so its active parameters match cpu-small's (see parameter_counts).
    "cpu-small-dense": dict(
        d_model=128, n_layers=8, kmer_embed=8, mixer="attention", dsa_heads=4, dsa_kv_heads=2,
        dsa_head_dim=32,
        dense_layers=8, dense_dim=DENSE_DIM, loss_chunk=32768,
    ),
    # One large GPU (H100/H200 class) at 512k-1M tokens with recompute.
    "gpu-1b": dict(
        d_model=1536, n_layers=24, kmer_embed=8, kda_heads=12, kda_head_dim=128, kda_gate_rank=128,
        dsa_heads=12, dsa_kv_heads=4, dsa_head_dim=128, index_heads=16, index_dim=64, topk=2048,
        keep_recent=64, dsa_kmer=16, n_experts=16, experts_per_token=2, expert_dim=768,
        shared_expert_dim=768, dense_layers=1, dense_dim=4096,
        moe_chunk=65536, loss_chunk=131072, dsa_block=512,
    ),
    # Our reading of the published 45-layer hybrid: 34 KDA + 11 DSA (i % 4 == 3), 64 routed experts
    # + 1 shared, 4 active, first layer dense. Widths follow the public ~30B-A3B "flash" class.
    "glm5-flash": dict(
        d_model=2048, n_layers=45, kmer_embed=8, kda_heads=32, kda_head_dim=128, kda_gate_rank=128,
        dsa_heads=32, dsa_kv_heads=4, dsa_head_dim=128, index_heads=32, index_dim=128, topk=2048,
        keep_recent=64, dsa_kmer=16, n_experts=64, experts_per_token=4, expert_dim=1536,
        shared_expert_dim=1536, dense_layers=1, dense_dim=10240,
        moe_chunk=65536, loss_chunk=131072, dsa_block=512,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset's config, with field overrides. Unknown names and fields are clear errors."""
    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name], overrides)


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """``{"total", "active"}`` parameters, counted on the meta device (no memory is allocated).

    Active counts one token's path: all weights but the routed experts it does not use and the
    rows of the k-mer embedding tables other than its own ``kmer_embed - 1``.
    """
    import torch

    with torch.device("meta"):
        model = HybridLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    inactive = sum(
        (moe.w13.numel() + moe.w2.numel()) * (cfg.n_experts - cfg.experts_per_token) // cfg.n_experts
        for moe in model.moe_layers()
    )
    if model.kmers is not None:
        inactive += model.kmers.table.numel() - (cfg.kmer_embed - 1) * cfg.d_model
    return {"total": total, "active": total - inactive}
