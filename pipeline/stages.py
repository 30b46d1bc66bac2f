"""``megabase run``: prepare -> windows -> train -> evaluate, each stage skipped when its output
is already there and valid (the store's checksums, the windows' parameters, the checkpoint's step,
the report's checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from megabase.core.errors import InputError
from megabase.core.locks import holding
from megabase.eval.evaluate import check_apart
from megabase.model import read_checkpoint_config

from .config import RunConfig, check_init_from
from .fit import check_fits
from .plan import RunPlan, resume_point
from .tracking import evaluate_tracked
from .train import fit_plan
from .workdir import ensure_store, ensure_windows, run_dir, windows_path


@dataclass
class RunResult:
    store: Path
    windows: Path
    checkpoint: Path
    report: Path | None
    tracking_uri: str
    run_id: str
    seconds: float
    stages: dict[str, str] = field(default_factory=dict)  # stage -> "done" / "skipped" / ...
    history: list[dict] = field(default_factory=list)
    overall: dict | None = None
    baselines: dict[str, float] = field(default_factory=dict)  # name -> overall bits/base
    evaluation: dict | None = None  # the report (report.json)


def run(cfg: RunConfig, progress: bool = True) -> RunResult:
    """The whole job (see module docs); returns where everything is. The run folder is locked
    throughout: a second ``megabase run`` of the same config is refused, naming the first."""

    if cfg.train.devices * cfg.train.num_nodes > 1:
        raise InputError("megabase run trains in one process; for several devices run `megabase "
                         "train --devices N` and then `megabase evaluate` on its checkpoint")
    started = time.perf_counter()
    check_init_from(cfg)
    with holding(run_dir(cfg), f"run {cfg.name!r}"):  # one `megabase run` per run folder
        return _run(cfg, progress, started)


def _run(cfg: RunConfig, progress: bool, started: float) -> RunResult:


    out = run_dir(cfg)
    point = resume_point(cfg, out, resume=True)  # `run` resumes on its own; refused before writing
    if point.step < cfg.train.steps:
        check_fits(cfg)  # a step that cannot fit in memory: refused before the genome is prepared
    stages = {}
    store, prepared = ensure_store(cfg, progress)
    stages["prepare"] = "skipped (up to date)" if prepared.skipped else "done"
    bed = windows_path(cfg)
    before = bed.stat().st_mtime_ns if bed.is_file() else None
    bed = ensure_windows(cfg, store)
    stages["windows"] = "skipped (up to date)" if before == bed.stat().st_mtime_ns else "done"
    if cfg.eval.enabled:  # refused now, not after the training
        try:
            check_apart(store, cfg.eval.train or cfg.data.train, cfg.eval.regions or cfg.data.eval)
        except InputError as exc:
            key = "eval.train" if cfg.eval.train else "data.train"
            raise InputError(exc.what.replace("{train}", key), exc.path, exc.record) from None

    ckpt = point.checkpoint
    if ckpt is not None and point.step >= cfg.train.steps:
        stages["train"] = f"skipped (checkpoint at step {point.step})"
        history = []
        meta = read_checkpoint_config(ckpt).get("mlflow", {})
        uri, run_id = meta.get("tracking_uri", cfg.tracking_uri()), meta.get("run_id", "")
    else:
        result = fit_plan(RunPlan(cfg, out, store, bed, point), progress)
        stages["train"] = f"resumed from step {result.resumed_from}" if result.resumed_from \
            else "done"
        ckpt, history, uri, run_id = result.checkpoint, result.history, result.tracking_uri, \
            result.run_id

    report_path, overall, baselines, report = None, None, {}, None
    if cfg.eval.enabled:
        report_dir = out / "eval"
        existing = report_dir / "report.json"
        report = json.loads(existing.read_text()) if existing.is_file() else {}
        if report.get("checkpoint") == str(Path(ckpt).resolve()) and \
                stages["train"].startswith("skipped"):
            stages["evaluate"] = "skipped (report of this checkpoint exists)"
        else:
            d = cfg.data
            options = dataclasses.replace(cfg.eval, regions=cfg.eval.regions or d.eval,
                                          train=cfg.eval.train or d.train,
                                          length=cfg.eval.length or d.window_length)
            report = evaluate_tracked(ckpt, store.path, options, out=report_dir,
                                      progress=progress, mlflow_run=run_id, tracking_uri=uri)
            stages["evaluate"] = "done"
        report_path, overall = existing, report["overall"]
        baselines = {k: v["overall"]["bits_per_base"] for k, v in report.get("baselines", {}).items()}
    return RunResult(store.path, bed, Path(ckpt), report_path, uri, run_id,
                     time.perf_counter() - started, stages, history, overall, baselines, report)
