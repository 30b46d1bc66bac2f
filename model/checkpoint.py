"""Model checkpoints: a directory with ``model.safetensors`` and ``config.json``.

``config.json`` holds ``{"format", "version", "model": <ModelConfig fields>, "vocab", ...extra}``
(the model's fields only: kernels and chunk sizes are the loader's choice, ``RUNTIME_FIELDS``);
``build_model``-compatible, human-readable, and loading never unpickles anything. ``sha256`` in it
records every file's digest at write time; loading checks the weights against it. Writes go to a
temporary sibling directory that is renamed into place, so a crash never leaves a half checkpoint.
Optimizer and data-loader state, when a trainer saves them, sit beside these two files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megabase.data.atomic import building_dir, file_sha256
from megabase.data.errors import InputError
from megabase.data.vocab import vocab_dict

from .config import RUNTIME_FIELDS, STAGE_FIELDS, ModelConfig
from .lm import HybridLM

FORMAT = "megabase-checkpoint"
VERSION = 1
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def save_checkpoint(model: HybridLM, path: str | Path, extra: dict | None = None,
                    files: dict[str, bytes] | None = None) -> Path:
    """Write ``model`` (weights, buffers, config) to the directory ``path`` atomically.

    ``extra``: more JSON fields for ``config.json`` (run id, step, data manifest...).
    ``files``: more files to place in the directory (e.g. an optimizer state), name -> bytes.
    """
    from safetensors.torch import save_file

    path = Path(path)
    with building_dir(path, mode=0o755) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        config = {"format": FORMAT, "version": VERSION, "model": model.cfg.model_dict(),
                  "vocab": vocab_dict(), **(extra or {}),
                  "sha256": {name: file_sha256(tmp / name) for name in [WEIGHTS, *(files or {})]}}
        (tmp / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return path


def verify_checkpoint(path: str | Path, names: tuple[str, ...] = (WEIGHTS,)) -> None:
    """Checks ``names`` against the sha256 recorded when the checkpoint was written (checkpoints
    from before checksums pass unchecked); a mismatch is an InputError naming the file."""
    path = Path(path)
    recorded = read_checkpoint_config(path).get("sha256") or {}
    for name in names:
        if name in recorded and file_sha256(path / name) != recorded[name]:
            raise InputError(f"{name} is damaged: its sha256 differs from the one recorded when "
                             "the checkpoint was written", path / name)


def read_checkpoint_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint, validated; InputError names what is wrong."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise InputError(f"not a checkpoint: expected {CONFIG} and {WEIGHTS} in it", path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except ValueError as exc:
        raise InputError(f"{CONFIG} is not valid JSON ({exc})", path) from None
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise InputError(f"{CONFIG} is not a version-{VERSION} megabase checkpoint", path)
    if config.get("vocab") != vocab_dict():
        raise InputError("checkpoint was trained with a different vocabulary", path)
    return config


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", **runtime) -> HybridLM:
    """The model saved at ``path``, in eval mode, on ``device``; ``runtime``: kernels and chunk
    sizes for this machine (``RUNTIME_FIELDS``, default ``auto`` / the ModelConfig defaults;
    older checkpoints that recorded them have them ignored), and the DSA indexer's candidate
    stage (``STAGE_FIELDS``: the checkpoint's own unless given; a checkpoint from before the
    stage existed gets the ModelConfig defaults, which select as it did up to
    ``dsa_stage_from``)."""
    from safetensors.torch import load_file

    allowed = RUNTIME_FIELDS + STAGE_FIELDS
    unknown = sorted(set(runtime) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a runtime choice; choose from {', '.join(allowed)}")
    config = read_checkpoint_config(path)
    verify_checkpoint(path)
    fields = {k: v for k, v in config["model"].items() if k not in RUNTIME_FIELDS}
    model = HybridLM(ModelConfig.from_dict({**fields, **runtime}))
    state = load_file(str(Path(path) / WEIGHTS), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(f"weights do not match the config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})", path)
    return model.to(device).eval()
