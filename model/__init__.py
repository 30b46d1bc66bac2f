"""megabase.model: config and presets, KDA / DSA / MoE layers, the hybrid LM, the streaming scorer."""

from __future__ import annotations

from .checkpoint import load_checkpoint, read_checkpoint_config, save_checkpoint, verify_checkpoint
from .config import ModelConfig
from .context import Context
from .lm import HybridLM, LMOutput
from .presets import PRESETS, get_preset, parameter_counts
from .stream import (Piece, advance, decode_step, fork, log_probs, prefill, repeat_state,
                     state_bytes, stream)


def build_model(preset: str | ModelConfig = "debug", **overrides) -> HybridLM:
    """A freshly initialised :class:`HybridLM` from a preset name (or config) and field overrides."""
    cfg = preset.replace(**overrides) if isinstance(preset, ModelConfig) else get_preset(preset, **overrides)
    return HybridLM(cfg)


__all__ = ["load_checkpoint", "read_checkpoint_config", "save_checkpoint", "verify_checkpoint",
           "ModelConfig", "Context", "HybridLM", "LMOutput", "log_probs", "stream", "advance", "fork",
           "prefill", "repeat_state", "state_bytes", "decode_step", "Piece", "PRESETS",
           "get_preset", "parameter_counts", "build_model"]
