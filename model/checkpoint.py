"""Model checkpoints: a directory with ``model.safetensors`` and ``config.json``.

``config.json`` holds ``{"format", "version", "model": <ModelConfig fields>, "vocab", ...extra}``
(the model's fields only: kernels and chunk sizes are the loader's choice, ``RUNTIME_FIELDS``);
``build_model``-compatible, human-readable, and loading never unpickles anything. ``sha256`` in it
records every other file's digest at write time, and ``config_sha256`` the digest of the config
itself (:func:`config_digest`); every loader reads the config through
:func:`read_checkpoint_config`, which refuses an edited one, and loading checks the weights.
Writes go to a temporary sibling directory that is renamed into place, so a crash never leaves a
half checkpoint. Optimizer and data-loader state, when a trainer saves them, sit beside these two
files (``trainer.pt``).

Where a checkpoint is found lives here too, so every command resolves a path the same way: a run
folder's ``checkpoints/step-NNNNNN`` folders, the ``checkpoints/latest`` pointer that names the
newest complete one (:func:`latest_checkpoint`), a path that is either (:func:`resolve_checkpoint`)
and a reader's hold on it against the rotation of a run training meanwhile
(:func:`held_checkpoint`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megabase.core.atomic import building_dir, current_umask, file_sha256, naming
from megabase.core.errors import InputError
from megabase.core.locks import hold_reading, release_reading
from megabase.core.vocab import vocab_dict

from .config import NEUTRAL_FIELDS, RUNTIME_FIELDS, STAGE_FIELDS, ModelConfig
from .lm import HybridLM


FORMAT = "megabase-checkpoint"
VERSION = 1
WEIGHTS, CONFIG = "model.safetensors", "config.json"
CONFIG_SHA256 = "config_sha256"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def config_digest(config: dict) -> str:
    """sha256 (hex) of a checkpoint config without its ``config_sha256`` field, over a canonical
    JSON (sorted keys, no spaces) of the config as JSON reads it back, so the digest of the dict
    written equals the digest of the file read."""
    fields = {k: v for k, v in json.loads(json.dumps(config)).items() if k != CONFIG_SHA256}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def save_safetensors(state: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file`` of ``state`` to ``path``; a failed write (a full disk, a
    file-size limit) is the OSError it was, naming ``path``, not safetensors' own error type."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, str(path), metadata=metadata)
    except SafetensorError as exc:  # "...: I/O error: File too large (os error 27)"
        code = _OS_ERROR.search(str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number) or errno.errorcode.get(number, str(number)),
                      str(path)) from None
    # safetensors creates the file 0600: the weights of a shared project's run were readable by
    # their writer alone, beside a config.json the umask let everyone read
    os.chmod(path, 0o666 & ~current_umask())
    return Path(path)


def save_checkpoint(model: HybridLM, path: str | Path, extra: dict | None = None,
                    files: dict[str, bytes] | None = None) -> Path:
    """Write ``model`` (weights, buffers, config) to the directory ``path`` atomically.

    ``extra``: more JSON fields for ``config.json`` (run id, step, data manifest...).
    ``files``: more files to place in the directory (e.g. an optimizer state), name -> bytes.
    """
    path = Path(path)
    with building_dir(path, mode=0o755) as tmp:  # an OSError names path/<file>, not the temporary
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_safetensors(state, tmp / WEIGHTS, metadata={"format": FORMAT})
        for name, data in (files or {}).items():
            with naming(tmp / name):
                (tmp / name).write_bytes(data)
        config = {"format": FORMAT, "version": VERSION, "model": model.cfg.model_dict(),
                  "vocab": vocab_dict(), **(extra or {}),
                  "sha256": {name: file_sha256(tmp / name) for name in [WEIGHTS, *(files or {})]}}
        config[CONFIG_SHA256] = config_digest(config)
        with naming(tmp / CONFIG):
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
    """``config.json`` of a checkpoint, validated; InputError names what is wrong. Every loader
    of a checkpoint (score, embed, generate, variants, evaluate, export-model, rl, train's
    ``--resume`` and ``init_from``) reads it here, so an edited config is refused everywhere."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise InputError(f"not a checkpoint: expected {CONFIG} and {WEIGHTS} in it", path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except ValueError as exc:
        raise InputError(f"{CONFIG} is not valid JSON ({exc})", path) from None
    header = [config.get("format"), config.get("version")] if isinstance(config, dict) else []
    if header != [FORMAT, VERSION]:
        raise InputError(f"{CONFIG} is not a version-{VERSION} megabase checkpoint", path)
    recorded = config.get(CONFIG_SHA256)
    # a checkpoint written before configs were checksummed records none and loads unchecked: its
    # weights are still checked, and refusing it would strand every checkpoint trained before
    if recorded is not None and recorded != config_digest(config):
        raise InputError("was changed after the checkpoint was written (its sha256 differs from "
                         f"the one recorded in it, {CONFIG_SHA256}); the model it describes is not "
                         "the one trained: restore the file as written", path / CONFIG)
    if config.get("vocab") != vocab_dict():
        raise InputError("checkpoint was trained with a different vocabulary", path)
    return config


def weights_sha256(path: str | Path) -> str:
    """The sha256 of a checkpoint's weights: what identifies it wherever its folder is moved
    (recorded at write time; computed for a checkpoint from before checksums)."""
    path = Path(path)
    recorded = (read_checkpoint_config(path).get("sha256") or {}).get(WEIGHTS)
    return recorded if isinstance(recorded, str) else file_sha256(path / WEIGHTS)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", **runtime) -> HybridLM:
    """The model saved at ``path``, in eval mode, on ``device``; ``runtime``: kernels and chunk
    sizes for this machine (``RUNTIME_FIELDS``, default ``auto`` / the ModelConfig defaults;
    older checkpoints that recorded them have them ignored), and the DSA indexer's candidate
    stage (``dsa_stage``: the checkpoint's own, with the fields given changed, e.g.
    ``dsa_stage="exact"`` or ``dsa_stage={"start": 0}``; a checkpoint from before the stage
    existed gets the defaults, which select as it did up to ``Stage.start``), and options that
    start as the identity (``NEUTRAL_FIELDS``: ``dsa_gate=True`` adds open gates to a checkpoint
    made without them; their weights start at zero)."""
    from safetensors.torch import load_file

    allowed = RUNTIME_FIELDS + STAGE_FIELDS + NEUTRAL_FIELDS
    unknown = sorted(set(runtime) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a runtime choice; choose from {', '.join(allowed)}")
    config = read_checkpoint_config(path)
    verify_checkpoint(path)
    fields = {k: v for k, v in config["model"].items() if k not in RUNTIME_FIELDS}
    for name in NEUTRAL_FIELDS:
        if name in runtime and fields.get(name) and not runtime[name]:
            raise InputError(f"the checkpoint was trained with {name}; it cannot be switched off",
                             path)
    model = HybridLM(ModelConfig.from_dict(fields, runtime))
    state = load_file(str(Path(path) / WEIGHTS), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if runtime.get("dsa_gate") and not fields.get("dsa_gate"):
        missing = [k for k in missing if not k.endswith(".gate_proj.weight")]
    if missing or unexpected:
        raise InputError(f"weights do not match the config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})", path)
    return model.to(device).eval()


TRAINER_STATE = "trainer.pt"  # what a training checkpoint holds beside the model's files
LATEST = "latest"  # RUN/checkpoints/latest: the name of the newest complete checkpoint


STEP_NAME = re.compile(r"step-\d{6,}")


def checkpoint_step(path: Path) -> int:
    """The step in a ``step-N`` folder's name."""
    return int(path.name[len("step-"):])


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's ``checkpoints/step-N`` folders that hold every file, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if STEP_NAME.fullmatch(p.name)
                   and (p / TRAINER_STATE).is_file() and (p / WEIGHTS).is_file()),
                  key=checkpoint_step)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder as given, or a run folder's latest checkpoint."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return latest_checkpoint(path) or path
    return path


@contextmanager
def held_checkpoint(path: str | Path, tries: int = 5) -> Iterator[Path]:
    """:func:`resolve_checkpoint` of ``path``, held for the block (``core.locks.hold_reading``)
    so that the rotation of a run training meanwhile cannot remove it. When rotation removes a
    run folder's latest checkpoint before it is held, the new latest is taken (up to ``tries``
    times). A folder that is not there is yielded unheld: reading it gives the error."""
    fd = None
    for _ in range(tries):
        ckpt = resolve_checkpoint(path)
        if not (ckpt / WEIGHTS).is_file():  # no checkpoint: no hold file in the user's folder
            break
        try:
            fd = hold_reading(ckpt)
            break
        except FileNotFoundError:
            if ckpt == Path(path):  # not a run's latest: no other one to take
                break
    try:
        yield ckpt
    finally:
        release_reading(fd)


def latest_checkpoint(run_dir: Path, fallback: bool = False) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or None for a run with no checkpoints.

    A pointer that is not a ``step-N`` name, or that names a folder which is missing or
    incomplete, or a run folder with checkpoints but no pointer, is an InputError offering the
    newest complete checkpoint; with ``fallback`` that one is returned instead, with a warning.
    """
    pointer = Path(run_dir) / "checkpoints" / LATEST
    complete = complete_checkpoints(run_dir)
    if not pointer.is_file() and not complete:
        return None
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        if not STEP_NAME.fullmatch(name):
            problem = f"names {name[:60]!r}, not a checkpoint of this run (step-NNNNNN)"
        elif (pointer.parent / name) in complete:
            return pointer.parent / name
        else:
            problem = f"names {name}, which is missing or incomplete"
    else:
        problem = "is missing, yet the run holds checkpoints"
    newest = complete[-1] if complete else None
    if fallback and newest is not None:
        print(f"warning: {pointer} {problem}; resuming from the newest complete checkpoint, "
              f"{newest.name}", file=sys.stderr)
        return newest
    offer = (f"; `--resume` continues from the newest complete checkpoint, {newest.name}"
             if newest is not None else "; no complete checkpoint is left: start another run name")
    raise InputError(f"{problem}{offer}", pointer)
