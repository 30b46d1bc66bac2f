"""``megabase train``: windows of a token store -> a trained checkpoint, tracked in MLflow.

Lightning drives the loop (:class:`megabase.pipeline.lit.LitLM`); the memory knobs are applied to
the model here (recompute, then offload), as torchtitan applies them from outside the model.
Layout of a run, under ``WORKDIR/runs/NAME``: ``config.yaml`` (resolved), ``train_log.jsonl``
(one line per optimizer step), ``checkpoints/step-NNNNNN`` and ``checkpoints/latest``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import MLFlowLogger

from megabase.core.atomic import write_atomic
from megabase.core.locks import holding
from megabase.data import ResumableSampler, WindowDataset
from megabase.model import build_model, load_checkpoint
from megabase.model.checkpoint import latest_checkpoint, resolve_checkpoint

from .checkpointing import DirectoryCheckpointIO, PeriodicCheckpoint
from .config import RunConfig, check_init_from, dump_config, flat_params, model_config
from .distributed import trainer_kwargs
from .fit import check_fits
from .lit import LitLM, LogProgress, StepLog
from .plan import RunPlan, resume_point
from .tracking import experiment_id, is_locked, quiet_libraries, resolve_tracking_uri, retry_locked
from .workdir import ensure_windows, open_store, relocate_artifacts, run_dir


class TrainingStream(torch.utils.data.Sampler[int]):
    """Sample indices of :class:`ResumableSampler` order, epoch after epoch, from draw ``start``
    (the samples a resumed run has already consumed) on, without end: the trainer stops at its
    step limit. Having no length also keeps Lightning from closing an "epoch" early after a
    resume (it would restart the stream and repeat data).

    Yields ``epoch * n + index``, as :class:`megabase.data.WindowDataset` expects.

    With data parallelism (``batch``: the global batch, ``context_parallel``: ranks per sequence)
    each data replica yields its consecutive ``batch / replicas`` draws of every global batch; the
    replica is read from torch.distributed when iteration starts (after the trainer set it up).
    """

    def __init__(self, n: int, seed: int, start: int, batch: int = 1, context_parallel: int = 1):
        self.order = ResumableSampler(n, seed).order
        self.n, self.start, self.batch, self.cp = n, start, batch, context_parallel

    def _replica(self) -> tuple[int, int]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank() // self.cp, dist.get_world_size() // self.cp

    def __iter__(self):
        replica, replicas = self._replica()
        share = self.batch // replicas
        epoch, order = -1, None
        k = self.start
        while True:
            if (k % self.batch) // share == replica:
                if k // self.n != epoch:
                    epoch = k // self.n
                    order = self.order(epoch)
                yield epoch * self.n + int(order[k % self.n])
            k += 1


class PatientMLFlowLogger(MLFlowLogger):
    """Lightning's MLflow logger that waits for a store another process holds locked (a
    notebook, `mlflow ui`, a second run) instead of ending the training at its first step; past
    the wait it stops with one line saying what is ``kept``."""

    def __init__(self, kept: str, **kwargs):
        super().__init__(**kwargs)
        self._kept = kept

    def log_metrics(self, metrics, step=None) -> None:
        retry_locked(lambda: super(PatientMLFlowLogger, self).log_metrics(metrics, step),
                     self._tracking_uri, self._kept)

    def finalize(self, status: str = "success") -> None:
        if status != "success":  # the training already failed: its error is the one to report
            try:
                super().finalize(status)
            except Exception as exc:
                if not is_locked(exc):
                    raise
            return
        retry_locked(lambda: super(PatientMLFlowLogger, self).finalize(status),
                     self._tracking_uri, self._kept)


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    history: list[dict]
    tracking_uri: str
    run_id: str
    seconds: float
    resumed_from: int
    is_global_zero: bool = True
    planned_steps: int | None = None  # train.steps, when train.max_minutes stopped it before


def train(cfg: RunConfig, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train ``cfg`` to ``cfg.train.steps`` optimizer steps; with ``resume``, continue the run from
    its latest checkpoint (same per-step losses as an uninterrupted run on CPU in fp32). The run
    folder is locked while it trains: a second process on it is refused, naming the first."""
    from lightning.pytorch.utilities import rank_zero_only


    started = time.perf_counter()
    check_init_from(cfg)
    out = run_dir(cfg)
    zero = rank_zero_only.rank == 0  # only rank 0 writes files and talks to MLflow
    # one writer per run folder: the ranks it starts are its own (and hold no lock)
    with holding(out, f"run {cfg.name!r}") if zero else contextlib.nullcontext():
        point = resume_point(cfg, out, resume)  # refused before any of the run's files is written
        if zero and point.step < cfg.train.steps:
            check_fits(cfg)  # a step that cannot fit in memory: refused now, not killed later
        store = open_store(cfg)
        plan = RunPlan(cfg, out, store, ensure_windows(cfg, store), point)
        return fit_plan(plan, progress, started)


def fit_plan(plan: RunPlan, progress: bool = True, started: float | None = None) -> TrainResult:
    """Train the resolved run ``plan`` (:mod:`.plan`) to ``train.steps``; the caller holds the
    run's lock (rank 0)."""
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.utilities import rank_zero_only



    started = time.perf_counter() if started is None else started
    cfg, out, store, bed = plan.cfg, plan.out, plan.store, plan.windows
    ckpt, start_step, run_id = plan.resume.checkpoint, plan.resume.step, plan.resume.run_id
    zero = rank_zero_only.rank == 0
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    out.mkdir(parents=True, exist_ok=True)
    if zero:
        write_atomic(out / "config.yaml", dump_config(cfg).encode())

    if zero and ckpt is not None and cfg.tracking.tracking_uri is None:
        relocate_artifacts(cfg.root)  # the workdir may have moved since the run began
    uri = resolve_tracking_uri(cfg.tracking_uri())
    quiet_libraries()
    from mlflow.tracking import MlflowClient

    logger = False
    if zero:
        def start_run(run_id=run_id):
            experiment_id(MlflowClient(uri), uri, cfg.tracking.experiment)  # artifacts beside db
            logger = PatientMLFlowLogger(
                kept=f"the checkpoints in {out / 'checkpoints'} stay: continue with "
                     "`megabase train --resume` (or `megabase run`) once it is free",
                experiment_name=cfg.tracking.experiment, run_name=cfg.tracking.run_name or cfg.name,
                tracking_uri=uri, run_id=run_id, tags={"megabase.kind": "train"})
            if run_id is None:
                logger.log_hyperparams(flat_params(cfg))
            return logger

        logger = retry_locked(start_run, uri, "nothing was trained")
        run_id = logger.run_id

    t = cfg.train
    pl.seed_everything(t.seed, workers=True, verbose=False)
    if t.init_from is not None and start_step == 0:  # a resumed run has its own weights
        model = load_checkpoint(resolve_checkpoint(t.init_from), **cfg.model.overrides).train()
    else:
        model = build_model(model_config(cfg))
    lit = LitLM(model, cfg, log_path=out / "train_log.jsonl")  # parallelized in configure_model
    lit.progress = progress
    dataset = WindowDataset(store, bed, split="train", rc_prob=cfg.data.rc_prob, seed=t.seed)
    replicas = t.devices * t.num_nodes // t.context_parallel
    stream = TrainingStream(len(dataset), t.seed, start_step * per_step, t.batch_size,
                            t.context_parallel)
    loader = torch.utils.data.DataLoader(dataset, batch_size=t.batch_size // replicas,
                                         sampler=stream, num_workers=t.num_workers, drop_last=True)
    extra = {"window_length": cfg.data.window_length, "run": cfg.name,
             # what `megabase evaluate` scores and fits its baselines on unless told otherwise
             "regions": {"train": list(cfg.data.train), "eval": list(cfg.data.eval)},
             "mlflow": {"tracking_uri": uri, "run_id": run_id},
             "data": {"store": str(store.path), "windows": str(bed)},
             **({"init_from": str(resolve_checkpoint(t.init_from).resolve())} if t.init_from else {})}
    saver = PeriodicCheckpoint(out, t.checkpoint_every)
    terminal = sys.stderr.isatty()  # else a log file: lines every so often, not a bar's redraws
    shown = [] if not progress else [TQDMProgressBar()] if terminal else \
        [LogProgress(start_step, t.steps)]
    trainer = pl.Trainer(
        **trainer_kwargs(t.devices, t.num_nodes), max_steps=t.steps, max_epochs=-1,
        max_time=None if t.max_minutes is None else datetime.timedelta(minutes=t.max_minutes),
        precision="bf16-mixed" if t.precision == "bf16" else "32-true",
        accumulate_grad_batches=t.grad_accum, gradient_clip_val=t.grad_clip or None,
        logger=logger, log_every_n_steps=1, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=progress and terminal,
        num_sanity_val_steps=0, callbacks=[StepLog(), saver, *shown],
        plugins=[DirectoryCheckpointIO(model, lambda: extra)],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before.*")
        warnings.filterwarnings("ignore", ".*Checkpoint directory .* exists and is not empty.*")
        warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")
        if start_step < t.steps:
            try:
                trainer.fit(lit, train_dataloaders=loader, ckpt_path=str(ckpt) if ckpt else None)
            except SystemExit:
                # Lightning turns Ctrl-C (and SIGTERM, which the CLI makes one) into sys.exit(1)
                # with nothing said; the CLI's interrupted line and status 130 are the contract
                if trainer.interrupted:
                    raise KeyboardInterrupt from None
                raise
    final = latest_checkpoint(out)
    steps = trainer.global_step or start_step  # the final checkpoint's step
    if not trainer.is_global_zero:
        return TrainResult(out, final, steps, lit.history, uri, "", time.perf_counter() - started,
                           start_step, is_global_zero=False)
    def record_checkpoint():
        client = MlflowClient(uri)
        client.set_tag(run_id, "megabase.checkpoint", str(final))
        client.log_dict(run_id, {"checkpoint": str(final), "step": steps}, "checkpoint.json")
        for path in (out / "config.yaml", store.path / "manifest.json"):
            if path.is_file():
                client.log_artifact(run_id, str(path))

    retry_locked(record_checkpoint, uri, f"the trained checkpoint {final} stays: evaluate it "
                 f"with `megabase evaluate --checkpoint {out}` once it is free")
    return TrainResult(out, final, steps, lit.history, uri, run_id,
                       time.perf_counter() - started, start_step,
                       planned_steps=t.steps if steps < t.steps else None)


def read_train_log(run: Path) -> dict[int, dict]:
    """``step -> row`` of a run's log; a step logged twice (before a kill, and after the resume
    that redid it) keeps its last row."""
    rows = {}
    path = Path(run) / "train_log.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return rows


def loss_curve(run: Path) -> np.ndarray:
    rows = read_train_log(run)
    return np.array([rows[s]["loss"] for s in sorted(rows)])
