"""Training checkpoints in the model's own format, written by Lightning through a CheckpointIO plugin.

A training checkpoint is a model checkpoint (``model.safetensors`` + ``config.json``, loadable by
``megabase evaluate``) with ``trainer.pt`` beside it: optimizer, scheduler, loop counters and RNG
states, saved with ``torch.save`` and read back with ``weights_only=True`` (no arbitrary unpickling).
Checkpoints go to ``RUN/checkpoints/step-NNNNNN``; ``RUN/checkpoints/latest`` names the newest
complete one and is rewritten only after it is fully on disk, so a failed write (disk full, a kill)
leaves the previous checkpoint in place and still named.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO

from megabase.core.atomic import remove_stale_temps, write_atomic
from megabase.core.errors import CheckpointWriteError, InputError
from megabase.core.locks import remove_unless_read
from megabase.model import verify_checkpoint
from megabase.model.checkpoint import (LATEST, TRAINER_STATE, WEIGHTS, checkpoint_step,
                                       complete_checkpoints, save_checkpoint)


class DirectoryCheckpointIO(CheckpointIO):
    """Lightning's checkpoint dict <-> a megabase checkpoint directory (see module docs).

    ``extra()`` returns the JSON fields for ``config.json`` at save time (run id, window length...).
    """

    def __init__(self, model: torch.nn.Module, extra):
        super().__init__()
        self.model, self.extra = model, extra

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        buf = io.BytesIO()
        torch.save(rest, buf)
        extra = {**self.extra(), "step": int(checkpoint.get("global_step", 0))}
        save_checkpoint(self.model, path, extra=extra, files={TRAINER_STATE: buf.getvalue()})

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        from safetensors.torch import load_file

        path = Path(path)
        state = torch.load(path / TRAINER_STATE, map_location=map_location or "cpu",
                           weights_only=True)
        weights = load_file(str(path / WEIGHTS), device="cpu")
        state["state_dict"] = {f"model.{k}": v for k, v in weights.items()}
        return state

    def remove_checkpoint(self, path) -> None:
        shutil.rmtree(path, ignore_errors=True)


def trainer_state(path: Path) -> dict:
    """``trainer.pt`` of a checkpoint (optimizer, loops, RNG...), read without unpickling code;
    checked against its recorded sha256. A damaged file is an InputError naming it."""
    verify_checkpoint(path, (TRAINER_STATE, WEIGHTS))
    try:
        return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle: torch's hints are not for our users
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{TRAINER_STATE} cannot be read ({reason[:120]})", path / TRAINER_STATE) from None


def resumable_state(run_dir: Path, ckpt: Path) -> tuple[dict, Path]:
    """``(trainer_state, checkpoint)`` to resume from: ``ckpt``, or when its files are damaged
    the newest complete checkpoint before it, with a warning; none left is the InputError."""
    try:
        return trainer_state(ckpt), ckpt
    except InputError as damaged:
        earlier = [p for p in complete_checkpoints(run_dir) if checkpoint_step(p) < checkpoint_step(ckpt)]
        if not earlier:
            raise
        print(f"warning: {damaged}; resuming from the checkpoint before it, {earlier[-1].name}",
              file=sys.stderr)
        return resumable_state(run_dir, earlier[-1])


def saved_step(path: Path) -> int:
    """Optimizer steps done when ``path`` was written."""
    return int(trainer_state(path)["global_step"])


def rotate_checkpoints(run_dir: Path, step: int, keep: int) -> list[Path]:
    """Remove the run's complete checkpoints older than ``step`` but the newest ``keep - 1``
    of them (other files in ``checkpoints/`` stay), except those a reader holds
    (:func:`~megabase.model.checkpoint.held_checkpoint`: ``megabase evaluate``), which a later rotation removes. Returns the
    ones kept for their readers."""
    older = [p for p in complete_checkpoints(run_dir) if checkpoint_step(p) < step]
    return [old for old in older[: -(keep - 1) or None] if not remove_unless_read(old)]


class PeriodicCheckpoint(pl.Callback):
    """Saves every ``every`` optimizer steps and at the end; keeps the newest ``keep``, and any
    older one that ``megabase evaluate`` is reading (``held_checkpoint``) until it is done."""

    def __init__(self, run_dir: Path, every: int, keep: int = 2):
        self.dir, self.every, self.keep = Path(run_dir) / "checkpoints", every, keep
        self.written: list[str] = []  # by this process: a folder left by another is overwritten

    def save(self, trainer: pl.Trainer) -> Path:
        name = f"step-{trainer.global_step:06d}"
        path = self.dir / name
        if name in self.written:  # the end of training at a step just saved periodically
            return path
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except OSError as exc:
            kept = complete_checkpoints(self.dir.parent)
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {exc.strerror or exc}; "
                f"{'kept ' + str(kept[-1]) if kept else 'no earlier checkpoint'}") from exc
        self.written.append(name)
        if trainer.is_global_zero:  # the weights are the same on every rank; rank 0 writes them
            write_atomic(self.dir / LATEST, (name + "\n").encode())
            rotate_checkpoints(self.dir.parent, trainer.global_step, self.keep)
        trainer.strategy.barrier("megabase.checkpoint")
        return path

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero and self.dir.is_dir():  # temps of a run killed mid-write
            for name in ("step-*", LATEST):
                remove_stale_temps(self.dir, name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accum = trainer.accumulate_grad_batches
        if (batch_idx + 1) % accum == 0 and trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer)
