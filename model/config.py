"""The model configuration: one small dataclass, validated, with a readable error for every bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from megabase.core.errors import InputError
from megabase.core.vocab import VOCAB_SIZE
from megabase.kernels.dsa import BACKENDS as DSA_BACKENDS
from megabase.kernels.dsa.stage import MODES as STAGES, Stage
from megabase.kernels.kda import ALIASES as KDA_ALIASES, BACKENDS as KDA_BACKENDS


# How this machine runs the model, not the model: kernels and memory chunking. A checkpoint does not
# keep them; whoever loads it picks them for its device (``auto``: C kernels on CPU, Triton/fla on CUDA).
RUNTIME_FIELDS = ("kda_backend", "dsa_backend", "moe_chunk", "loss_chunk", "dsa_block")
# Options whose parameters start as the identity: a checkpoint made without one may be loaded with
# it switched on (train.init_from), and computes what it did until training moves them.
NEUTRAL_FIELDS = ("dsa_gate",)
# The flat names the DSA candidate stage's fields had before it became one sub-config
# (``dsa_stage``, a Stage): config.json files and YAML overrides written then still read.
LEGACY_STAGE = {"dsa_stage_from": "start", "dsa_stage_block": "block",
                "dsa_stage_blocks": "blocks", "dsa_stage_local": "local",
                "dsa_stage_seed": "seed", "dsa_stage_seed_cap": "seed_cap",
                "dsa_stage_carry": "carry"}
# How the DSA indexer chooses its candidates: saved with the model, and a loader may choose
# otherwise (the exact scan as the reference, or another stage).
STAGE_FIELDS = ("dsa_stage", *LEGACY_STAGE)


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
    dsa_gate: bool = False  # a head-wise output gate on each DSA layer, open at the start
    rope_base: float = 500000.0  # rotary base of the attention mixer (DSA layers use no positions)
    indexer_mode: str = "sparse"
    # The indexer's candidate stage (megabase.kernels.dsa.stage.Stage): from position start on,
    # a query scores only its local window, the best blocks by their summary and the keys after
    # earlier copies of its last bases; summary "exact": every earlier key (the reference)
    dsa_stage: Stage = field(default_factory=Stage)
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
                    "moe_chunk", "loss_chunk", "dsa_block", "dense_dim"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ("dsa_period", "dense_layers", "keep_recent", "shared_expert_dim", "dsa_kmer",
                     "kmer_embed"):
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
                   "dsa_backend": DSA_BACKENDS,
                   "bias_update": ("quantile", "sign", "proportional"), "mixer": ("hybrid", "attention")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"model.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")

        if not isinstance(self.dsa_stage, Stage):
            self.dsa_stage = _stage(self.dsa_stage)
        if not self.dsa_stage.exact and self.keep_recent > self.dsa_stage.local:
            raise InputError(f"model.keep_recent ({self.keep_recent}) must not exceed "
                             f"model.dsa_stage.local ({self.dsa_stage.local})")

    def stage(self) -> Stage | None:
        """The DSA indexer's candidate stage as the kernels take it: None for the exact scan."""
        return None if self.dsa_stage.exact else self.dsa_stage

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
    def from_dict(cls, data: dict, overrides: dict | None = None) -> "ModelConfig":
        """Build from a dict (``to_dict``'s shape) and ``overrides`` of some of its fields; an
        unknown key is an error that names the valid keys. ``dsa_stage`` may be a Stage, a
        mapping of some of its fields (an override changes only those: ``{"start": 0}``) or
        a summary (``"exact"``); the stage's flat names of before (``dsa_stage_from``, ...)
        still read."""
        merged = _flat_stage(data)
        for key, value in _flat_stage(overrides or {}).items():
            if key == "dsa_stage" and "dsa_stage" in merged:
                value = {**merged["dsa_stage"], **value}
            merged[key] = value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise InputError(f"unknown model config key {unknown[0]!r}; valid keys: "
                             f"{', '.join(sorted(known))}")
        return cls(**merged)

    def replace(self, **overrides) -> "ModelConfig":
        return ModelConfig.from_dict(self.to_dict(), overrides)


def _stage_fields(value) -> dict:
    """``dsa_stage`` given as a Stage, a mapping of its fields or a summary, as a mapping."""
    if isinstance(value, Stage):
        return dataclasses.asdict(value)
    if isinstance(value, str):
        return {"summary": value}
    if isinstance(value, dict):
        return dict(value)
    raise InputError(f"model.dsa_stage must be a mapping of the candidate stage's fields or one "
                     f"of {', '.join(STAGES)}, got {value!r}")


def _flat_stage(data: dict) -> dict:
    """``data`` with the stage as one mapping under ``dsa_stage`` (read from its legacy flat keys
    too), when it gives any of it."""
    data = dict(data)
    given = {LEGACY_STAGE[key]: data.pop(key) for key in list(data) if key in LEGACY_STAGE}
    if "dsa_stage" in data or given:
        data["dsa_stage"] = {**_stage_fields(data.get("dsa_stage", {})), **given}
    return data


def _stage(value) -> Stage:
    """The Stage ``value`` describes (see :func:`_stage_fields`); a bad field is one line."""
    values = _stage_fields(value)
    names = [f.name for f in fields(Stage)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise InputError(f"unknown model.dsa_stage key {unknown[0]!r}; valid keys: "
                         f"{', '.join(names)}")
    try:
        return Stage(**values)
    except ValueError as exc:
        raise InputError(f"model.dsa_stage.{exc}") from None
