"""A training run resolved once: its folder, store, windows and where it resumes.

``megabase run`` and ``megabase train`` both build a :class:`RunPlan` under the run's lock,
before any of the run's files is written, and hand it to :func:`megabase.pipeline.train.fit_plan`;
nothing below them finds the run's folders, its latest checkpoint or its MLflow run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megabase.core.errors import InputError
from megabase.model import read_checkpoint_config

from megabase.model.checkpoint import latest_checkpoint

from .checkpointing import resumable_state
from .config import RunConfig, resume_differences


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: ``checkpoint`` (None for a fresh start), the optimizer ``step``
    it holds (0 fresh) and the MLflow ``run_id`` it was logged to (None fresh)."""

    checkpoint: Path | None = None
    step: int = 0
    run_id: str | None = None


@dataclass(frozen=True)
class RunPlan:
    """Everything a training stage needs decided: the config, the run folder ``out``
    (``WORKDIR/runs/NAME``), the token ``store``, the ``windows`` BED and the resume point."""

    cfg: RunConfig
    out: Path
    store: object  # megabase.data.TokenStore
    windows: Path
    resume: ResumePoint


def resume_point(cfg: RunConfig, out: Path, resume: bool) -> ResumePoint:
    """The run ``out``'s resume point: fresh when it has no checkpoints; with ``resume``, its
    latest complete checkpoint whose files check out (an earlier one, with a warning, when the
    latest is damaged), after refusing settings that would change the model or its data.
    Without ``resume`` a run that has checkpoints is refused: a fresh start never mixes in."""
    ckpt = latest_checkpoint(out, fallback=resume)
    if ckpt is None:
        return ResumePoint()
    if not resume:
        raise InputError(f"run {cfg.name!r} already has checkpoints; pass --resume to continue it "
                         "or set name to start another", out)
    check_resume(out, cfg)
    state, ckpt = resumable_state(out, ckpt)
    step = int(state["global_step"])
    t = cfg.train
    check_data_position(ckpt, state, step * t.batch_size * t.grad_accum, t.seed)
    return ResumePoint(ckpt, step, read_checkpoint_config(ckpt).get("mlflow", {}).get("run_id"))


def check_resume(out: Path, cfg: RunConfig) -> None:
    """A resume keeps what makes the run one run: settings that change the model or its data
    stream refuse in one line listing what differs; the others (steps, minutes, evaluation...)
    are what the new ``config.yaml`` records."""
    path = out / "config.yaml"
    if not path.is_file():
        return
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"cannot read the run's config ({exc})", path) from None
    refused, _ = resume_differences(saved if isinstance(saved, dict) else {}, cfg)
    if refused:
        raise InputError(f"run {cfg.name!r} was started with other settings ({'; '.join(refused)}); "
                         "resume it with its own, or set another name (--set name=...) to start a "
                         "new run", path)


def check_data_position(ckpt: Path, state: dict, expected: int, seed: int) -> None:
    """The checkpoint's saved sample position (``state``: its trainer state) must match what its
    step implies under this config: a resume with another batch size, accumulation or seed would
    replay other data."""
    saved = state.get("megabase_data", {})
    if saved and (saved["samples_consumed"] != expected or saved["seed"] != seed):
        raise InputError(f"checkpoint consumed {saved['samples_consumed']} samples with seed "
                         f"{saved['seed']}, but this config implies {expected} with seed {seed}: "
                         "resume with the batch size, grad_accum and seed it was trained with",
                         ckpt)
