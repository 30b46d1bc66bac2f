"""The model configuration: one small dataclass, validated, with a readable error for every bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from megabase.core.errors import InputError
from megabase.core.vocab import VOCAB_SIZE
from megabase.kernels.dsa import BACKENDS as DSA_BACKENDS
from megabase.kernels.dsa.stage import Stage
from megabase.kernels.kda import ALIASES as KDA_ALIASES, BACKENDS as KDA_BACKENDS


# How this machine runs the model, not the model: kernels and memory chunking. A checkpoint does not
# keep them; whoever loads it picks them for its device (``auto``: C kernels on CPU, Triton/fla on CUDA).
RUNTIME_FIELDS = ("kda_backend", "dsa_backend", "moe_chunk", "loss_chunk", "dsa_block")
# How the DSA indexer chooses its candidates (megabase.kernels.dsa.stage): saved with the
# model, and a loader may choose otherwise (the exact scan as the reference, or another stage).
STAGE_FIELDS = ("dsa_stage", "dsa_stage_from", "dsa_stage_block", "dsa_stage_blocks",
                "dsa_stage_local", "dsa_stage_seed", "dsa_stage_seed_cap", "dsa_stage_carry")
STAGES = ("exact", "mean", "max")


@dataclass
class ModelConfig:
    """Shape and memory knobs of the hybrid KDA / DSA / MoE language model.

    Layer ``i`` is DSA when ``dsa_period > 0`` and ``i % dsa_period == dsa_period - 1``, else KDA
    (period 4 over 45 layers gives 34 KDA + 11 DSA). The first ``dense_layers`` FFNs are dense SwiGLU,
    the rest MoE. DSA layers use no positional encoding: the KDA layers carry position (as in Kimi
    Linear), which also makes streaming exact.
    """

    d_model: int = 64
    n_layers: int = 4
    vocab_size: int = 8  # the 7 tokens of megabase.core.vocab, padded to a multiple of 8
    tie_embeddings: bool = False  # the head's 4 rows start at zero (untied) or are the bases' embeddings
    kmer_embed: int = 0  # the input also embeds the exact k-mers ending at each token, k = 2..kmer_embed
    norm_eps: float = 1e-6
    mixer: str = "hybrid"  # hybrid: KDA / DSA by dsa_period; attention: full causal attention (dense baseline)
    dsa_period: int = 4
    # Kimi Delta Attention
    kda_heads: int = 2
    kda_head_dim: int = 32
    kda_conv: int = 4
    kda_gate_rank: int = 16
    kda_lower_bound: float = -5.0
    # DeepSeek Sparse Attention
    dsa_heads: int = 2
    dsa_kv_heads: int = 1
    dsa_head_dim: int = 32
    index_heads: int = 2
    index_dim: int = 16
    topk: int = 64
    keep_recent: int = 0
    dsa_kmer: int = 0  # DSA queries/keys/indexer also hash the last dsa_kmer tokens (0: none)
    rope_base: float = 500000.0  # rotary base of the attention mixer (DSA layers use no positions)
    indexer_mode: str = "sparse"
    # The indexer's candidate stage: from position dsa_stage_from on, a query scores only the
    # local window (>= dsa_stage_local latest keys), the dsa_stage_blocks best blocks of
    # dsa_stage_block keys by their summary (mean: HISA; max: Quest bounds) and the keys after
    # earlier copies of its last dsa_stage_seed bases; exact: every earlier key (the reference)
    dsa_stage: str = "max"
    dsa_stage_from: int = 65536
    dsa_stage_block: int = 128
    dsa_stage_blocks: int = 64
    dsa_stage_local: int = 1024
    dsa_stage_seed: int = 16
    dsa_stage_seed_cap: int = 16
    dsa_stage_carry: int = 32
    indexer_loss_weight: float = 0.01
    # Mixture of Experts
    n_experts: int = 4
    experts_per_token: int = 2
    expert_dim: int = 64
    shared_expert_dim: int = 64
    routed_scale: float = 1.0
    dense_layers: int = 0
    dense_dim: int = 128
    bias_update: str = "quantile"  # quantile | sign (DeepSeek-V3) | proportional: MoE.update_bias
    bias_update_rate: float = 0.5  # quantile: fraction of the solved step; else the bias step size
    seq_aux_weight: float = 0.0
    # Runtime choices (RUNTIME_FIELDS): memory knobs and kernels, not saved in checkpoints
    moe_chunk: int = 16384
    loss_chunk: int = 65536
    dsa_block: int = 256
    kda_backend: str = "auto"  # cpu (the recurrence in C) on CPU, fla on CUDA
    dsa_backend: str = "auto"  # cpu (C indexer, sparse products) on CPU, Triton kernels on CUDA

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        kinds = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
        for f in fields(self):
            value = getattr(self, f.name)
            want = kinds.get(str(f.type), ())
            if want and (not isinstance(value, want) or (isinstance(value, bool) and f.type != "bool")):
                raise InputError(f"model.{f.name} must be a{'n' if f.type == 'int' else ''} "
                                 f"{f.type}, got {value!r}")
        positive = ["d_model", "n_layers", "vocab_size", "kda_heads", "kda_head_dim", "kda_conv",
                    "kda_gate_rank", "dsa_heads", "dsa_kv_heads", "dsa_head_dim", "index_heads",
                    "index_dim", "topk", "n_experts", "experts_per_token", "expert_dim",
                    "moe_chunk", "loss_chunk", "dsa_block", "dense_dim", "dsa_stage_block",
                    "dsa_stage_blocks", "dsa_stage_local"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ("dsa_period", "dense_layers", "keep_recent", "shared_expert_dim", "dsa_kmer",
                     "kmer_embed", "dsa_stage_from", "dsa_stage_seed", "dsa_stage_seed_cap",
                     "dsa_stage_carry"):
            if getattr(self, name) < 0:
                raise InputError(f"model.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.kmer_embed == 1 or self.kmer_embed > 10:
            raise InputError(f"model.kmer_embed must be 0 (off) or 2..10 (a table of 4^k rows per "
                             f"k), got {self.kmer_embed}")
        if self.vocab_size < VOCAB_SIZE:
            raise InputError(f"model.vocab_size must be >= {VOCAB_SIZE} (the nucleotide vocabulary)")
        if self.dsa_heads % self.dsa_kv_heads:
            raise InputError(f"model.dsa_heads ({self.dsa_heads}) must be a multiple of "
                             f"model.dsa_kv_heads ({self.dsa_kv_heads})")
        for name in ("moe_chunk", "loss_chunk"):
            if getattr(self, name) % 1024:
                raise InputError(f"model.{name} must be a multiple of 1024, got {getattr(self, name)}")
        if 1024 % self.dsa_block:
            raise InputError(f"model.dsa_block must divide 1024, got {self.dsa_block}")
        if self.experts_per_token > self.n_experts:
            raise InputError(f"model.experts_per_token ({self.experts_per_token}) exceeds "
                             f"model.n_experts ({self.n_experts})")
        if not self.bias_update_rate >= 0 or (self.bias_update == "quantile" and self.bias_update_rate > 1):
            raise InputError(f"model.bias_update_rate must be >= 0 (and <= 1 for the quantile "
                             f"update), got {self.bias_update_rate!r}")
        if not self.kda_lower_bound < 0:
            raise InputError(f"model.kda_lower_bound must be negative, got {self.kda_lower_bound}")

        # "torch", the reference's old name, is still in configs saved before the rename
        self.kda_backend = KDA_ALIASES.get(self.kda_backend, self.kda_backend)
        choices = {"indexer_mode": ("sparse", "dense"), "kda_backend": KDA_BACKENDS,
                   "dsa_stage": STAGES,
                   "dsa_backend": DSA_BACKENDS,
                   "bias_update": ("quantile", "sign", "proportional"), "mixer": ("hybrid", "attention")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"model.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")

        if self.dsa_stage != "exact":
            try:
                self.stage()
            except ValueError as exc:
                raise InputError(f"model.dsa_stage_*: {exc}") from None
            if self.keep_recent > self.dsa_stage_local:
                raise InputError(f"model.keep_recent ({self.keep_recent}) must not exceed "
                                 f"model.dsa_stage_local ({self.dsa_stage_local})")

    def stage(self):
        """The DSA indexer's candidate stage (:class:`megabase.kernels.dsa.Stage`), or None for
        the exact scan."""
        if self.dsa_stage == "exact":
            return None
        return Stage(self.dsa_stage, self.dsa_stage_from, self.dsa_stage_block,
                     self.dsa_stage_blocks, self.dsa_stage_local, self.dsa_stage_seed,
                     self.dsa_stage_seed_cap, self.dsa_stage_carry)

    def is_dsa(self, layer: int) -> bool:
        return self.mixer == "hybrid" and self.dsa_period > 0 and \
            layer % self.dsa_period == self.dsa_period - 1

    def mixer_kind(self, layer: int) -> str:
        """``"kda"``, ``"dsa"`` or ``"attention"``: the mixer of layer ``layer``."""
        if self.mixer == "attention":
            return "attention"
        return "dsa" if self.is_dsa(layer) else "kda"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers

    @property
    def layer_kinds(self) -> str:
        """e.g. ``"KKKD"``: K for KDA, D for DSA, A for full attention, one letter per layer."""
        return "".join(self.mixer_kind(i)[0].upper() for i in range(self.n_layers))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_dict(self) -> dict:
        """The fields that define the model (what a checkpoint saves): all but ``RUNTIME_FIELDS``."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Build from a dict; an unknown key is an error that names the valid keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown model config key {unknown[0]!r}; valid keys: "
                             f"{', '.join(sorted(known))}")
        return cls(**data)

    def replace(self, **overrides) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **overrides})
