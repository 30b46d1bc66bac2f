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
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO

from megabase.data.atomic import write_atomic
from megabase.model.checkpoint import WEIGHTS, save_checkpoint

from .errors import CheckpointWriteError

TRAINER_STATE = "trainer.pt"
LATEST = "latest"


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / TRAINER_STATE).is_file() else None


def trainer_state(path: Path) -> dict:
    """``trainer.pt`` of a checkpoint (optimizer, loops, RNG...), read without unpickling code."""
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)


def saved_step(path: Path) -> int:
    """Optimizer steps done when ``path`` was written."""
    return int(trainer_state(path)["global_step"])


class PeriodicCheckpoint(pl.Callback):
    """Saves every ``every`` optimizer steps and at the end; keeps the newest ``keep``."""

    def __init__(self, run_dir: Path, every: int, keep: int = 2):
        self.dir, self.every, self.keep = Path(run_dir) / "checkpoints", every, keep

    def save(self, trainer: pl.Trainer) -> Path:
        name = f"step-{trainer.global_step:06d}"
        path = self.dir / name
        # rank 0's view for every rank: a slower rank would see the files rank 0 just wrote and
        # skip the collective save
        if trainer.strategy.broadcast((path / TRAINER_STATE).is_file()):
            return path
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except OSError as exc:
            kept = latest_checkpoint(self.dir.parent)
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {exc.strerror or exc}; "
                f"{'kept ' + str(kept) if kept else 'no earlier checkpoint'}") from exc
        if trainer.is_global_zero:  # the weights are the same on every rank; rank 0 writes them
            write_atomic(self.dir / LATEST, (name + "\n").encode())
            for old in sorted(p for p in self.dir.glob("step-*") if p.is_dir())[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        trainer.strategy.barrier("megabase.checkpoint")
        return path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accum = trainer.accumulate_grad_batches
        if (batch_idx + 1) % accum == 0 and trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer)
