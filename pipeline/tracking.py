"""MLflow tracking of evaluation reports, and loading reports back from runs or files: every
conversation with a tracking store lives here (the evaluation floor writes reports and knows
nothing of MLflow; :func:`evaluate_tracked` is ``megabase evaluate``'s scoring plus its run).

The tracking store is always a database (``sqlite:///path/mlflow.db``) or a server
(``http(s)://``): MLflow >= 3.13 refuses the old ``./mlruns`` file store. A plain path ending in
``.db`` is taken as a SQLite file. Artifacts of experiments created here sit beside the database
(``<db dir>/mlartifacts``), never in the working directory.

What a report logs to a run: one metric per context bin (``eval/bits_per_base/ctx_LO-HI``), the
overall numbers, the same per bin for every control and the model's paired gain over it
(``eval/gain_over_control_C/{all,unique,repeat}/ctx_LO-HI``, with ``/ci_lo`` and ``/ci_hi``), the
overall number of every baseline, the copy-model reference per bin (``eval/copy/...``) and
overall under each control (``eval/copy/control_C/...``), what context beyond each control's
limit gives the model and the copy model (``eval/context_worth_C/{model,copy}/{all,unique,
repeat}`` with CIs, and ``.../share``, the model's gain over the copy model's), the recall probe
per distance (``eval/probe/d_D/...``, with the DSA hit rates per layer), the held-out MoE load per
layer (``eval/moe_load_max_over_mean/layer_i``; after ``rebalance``, the load on its regions
before and after, ``eval/moe_rebalance/max_over_mean_{before,after}/layer_i``, and the same
windows' bits with the trained biases, ``.../trained_bits_per_base``, minus the re-fitted ones,
``.../cost_bits_per_base``),
``eval/bits_per_base_by_context`` with the bin's upper edge as step (MLflow draws it as the curve),
the table of every series and bin (``eval/bins.json``, read back with ``mlflow.load_table``), and
``report.json``, ``report.csv`` and ``report.png`` under ``eval/``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from megabase.core.errors import InputError
from megabase.eval.config import EvalConfig
from megabase.eval.report import check_report, report_metrics, report_table, write_report

DEFAULT_TRACKING_URI = "sqlite:///work/mlflow.db"
DEFAULT_EXPERIMENT = "megabase"
TABLE = "eval/bins.json"
REPORT = "eval/report.json"


def given_tracking_uri(uri: str | None = None) -> str:
    """``uri``, else ``$MLFLOW_TRACKING_URI``, else :data:`DEFAULT_TRACKING_URI`, as written
    (what a message names before :func:`resolve_tracking_uri` has opened the store)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def resolve_tracking_uri(uri: str | None = None) -> str:
    """``uri``, else ``$MLFLOW_TRACKING_URI``, else :data:`DEFAULT_TRACKING_URI`; SQLite paths absolute.

    Refuses file stores (``file:``, ``./mlruns``) with the fix in the message. A SQLite store
    that does not exist yet is created (written) here.
    """
    uri = given_tracking_uri(uri)
    if "://" not in uri:
        if not uri.endswith(".db"):
            raise InputError(f"tracking URI {uri!r} is a file store, which MLflow >= 3.13 refuses; "
                             "pass sqlite:///path/mlflow.db (or a path ending in .db)")
        uri = f"sqlite:///{Path(uri).resolve()}"
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        path = path if path.is_absolute() else path.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        _create_once(path)
        return f"sqlite:///{path}"
    if uri.startswith("file:"):
        raise InputError(f"tracking URI {uri!r} is a file store, which MLflow >= 3.13 refuses; "
                         "pass sqlite:///path/mlflow.db")
    return uri


def _create_once(path: Path) -> None:
    """Create (or bring up to date) a SQLite store once, under a lock beside it: two processes
    that both find no store would otherwise race through MLflow's schema migrations, and one
    fails. The lock file says ``ready`` once the schema is complete."""
    marker = path.with_name(path.name + ".lock")
    if path.is_file() and marker.is_file() and marker.read_text() == "ready\n":
        return

    with open(marker, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        if path.is_file() and lock.read() == "ready\n":
            return  # another process made it while we waited
        quiet_libraries()
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(f"sqlite:///{path}", (path.parent / "mlartifacts").resolve().as_uri())
        lock.truncate(0)
        lock.write("ready\n")


def quiet_libraries() -> None:
    """Keep MLflow's and Lightning's start-up chatter (database migrations, hardware lines, tips)
    out of a command's output; their warnings and errors still show."""

    import mlflow  # noqa: F401  (configures its loggers on import; levels are set after)

    for name in ("mlflow", "alembic", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # it logs every database error it then raises; the raise becomes the command's one line
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


LOCK_WAIT_S = 120.0  # how long a command waits for a locked store ($MEGABASE_TRACKING_WAIT_S)


class TrackingStoreError(RuntimeError):
    """The tracking store failed for a reason of the machine it is on (:data:`STORE_FAILURES`: a
    full disk, a file-size limit, I/O errors, read-only storage); what was computed is on disk,
    and the message names the store, the reason and how to log it later. Exit status 3."""


class TrackingLockedError(TrackingStoreError):
    """The SQLite tracking store stayed locked by another process past the wait; what was
    computed is on disk, and the message says how to log it later."""


# SQLite's messages for a store that cannot be written (sqlite3.OperationalError, reaching us
# wrapped by SQLAlchemy and MLflow): ENOSPC, EFBIG under `ulimit -f`, EIO, a read-only file
STORE_FAILURES = ("database or disk is full", "disk I/O error", "readonly database",
                  "unable to open database file")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_locked(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is SQLite's "database is locked"."""
    return any("database is locked" in str(e) for e in _chain(exc))


def store_failure(exc: BaseException) -> str | None:
    """Which of :data:`STORE_FAILURES` ``exc`` (or what caused it) is, or None."""
    for e in _chain(exc):
        found = next((f for f in STORE_FAILURES if f in str(e)), None)
        if found:
            return found
    return None


def retry_locked(call, uri: str, kept: str, wait_s: float | None = None):
    """``call()``, tried again while the store at ``uri`` is locked by another process (each try
    already waits SQLite's busy timeout), for up to ``wait_s`` seconds in all (default
    :data:`LOCK_WAIT_S`); then :class:`TrackingLockedError` saying what is ``kept`` on disk. A
    store that cannot be written (:func:`store_failure`) is a :class:`TrackingStoreError` at
    once, saying the same."""

    wait_s = float(os.environ.get("MEGABASE_TRACKING_WAIT_S", LOCK_WAIT_S)) if wait_s is None \
        else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except Exception as exc:
            reason = store_failure(exc)
            if reason:
                raise TrackingStoreError(f"{uri}: the MLflow store cannot be written ({reason}); "
                                         f"{kept}") from None
            if not is_locked(exc):
                raise
            if time.monotonic() >= deadline:
                raise TrackingLockedError(
                    f"{uri}: the MLflow store is locked by another process (waited "
                    f"{wait_s:g} s; $MEGABASE_TRACKING_WAIT_S sets how long); {kept}") from None
            time.sleep(1.0)


def _client(uri: str):
    quiet_libraries()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, uri: str, name: str) -> str:
    """Id of experiment ``name``, created (artifacts beside a SQLite database) if missing."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


def open_run(tracking_uri: str | None = None, run_id: str | None = None,
             experiment: str = DEFAULT_EXPERIMENT, run_name: str | None = None,
             kind: str = "evaluate") -> dict[str, str]:
    """``run_id`` checked to exist, or a new run of ``experiment`` tagged ``megabase.kind``.

    Returns ``{"tracking_uri", "run_id", "experiment_id", "created"}``; an unknown run id is an
    InputError naming the store.
    """
    uri = resolve_tracking_uri(tracking_uri)
    client = _client(uri)
    if run_id:
        try:
            run = client.get_run(run_id)
        except Exception as exc:
            if is_locked(exc) or store_failure(exc):  # the store's trouble, not the run id's
                raise
            raise InputError(f"MLflow run {run_id!r} not found in {uri}") from None
        return {"tracking_uri": uri, "run_id": run_id, "experiment_id": run.info.experiment_id,
                "created": False}
    exp = experiment_id(client, uri, experiment)
    run = client.create_run(exp, run_name=run_name, tags={"megabase.kind": kind})
    return {"tracking_uri": uri, "run_id": run.info.run_id, "experiment_id": exp, "created": True}


def log_report(report: dict, files: dict[str, Path], target: dict) -> None:
    """Log ``report`` and its written ``files`` to the run ``target`` (from :func:`open_run`).

    A run created by :func:`open_run` is ended here; a given run (a training run) keeps its status.
    """
    from mlflow.entities import Metric, Param

    client = _client(target["tracking_uri"])
    run_id = target["run_id"]
    have = client.get_run(run_id).data.params
    now = _now_ms()
    metrics = [Metric(k, v, now, 0) for k, v in report_metrics(report).items()]
    metrics += [Metric("eval/bits_per_base_by_context", b["bits_per_base"], now,
                       int(b["context_hi"])) for b in report["bins"] if b["n_tokens"]]
    params = [Param(f"eval.{k}", str(report[k])[:500]) for k in
              ("name", "checkpoint", "data", "split", "train", "eval", "n_windows",
               "window_length", "edges")
              if k in report and f"eval.{k}" not in have]
    for start in range(0, len(metrics), 1000):  # the store's batch limit
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    if params:
        client.log_batch(run_id, params=params)
    client.log_table(run_id, report_table(report), TABLE)
    for path in files.values():
        client.log_artifact(run_id, str(path), "eval")
    if target.get("created"):
        client.set_terminated(run_id)


def abandon_run(target: dict) -> None:
    """Delete a run :func:`open_run` created (nothing half-logged is left); keep a given one."""
    if target.get("created"):
        try:
            _client(target["tracking_uri"]).delete_run(target["run_id"])
        except Exception:  # the original error is the one to report
            pass


def _now_ms() -> int:

    return int(time.time() * 1000)


def load_report(ref: str, tracking_uri: str | None = None) -> dict:
    """A report from a ``report.json`` file, a directory holding one, or an MLflow run id."""
    path = Path(ref)
    if path.is_dir():
        path = path / "report.json"
    if path.is_file():
        try:
            report = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"not a report: {exc}", path) from None
        check_report(report, str(path))
        report.setdefault("source", str(path))
        return report
    if "/" in ref or ref.endswith(".json") or Path(ref).suffix:
        raise InputError("no such report file or directory", ref)
    uri = resolve_tracking_uri(tracking_uri)
    client = _client(uri)
    try:
        run = client.get_run(ref)
    except Exception:
        raise InputError(f"{ref!r} is neither a report file nor a run in {uri}") from None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(ref, REPORT, tmp)
        except Exception:
            raise InputError(f"MLflow run {ref} has no {REPORT}; evaluate it into that run ({{mlflow_run}}"
                             f" {ref})", options=("mlflow_run",)) from None
        report = json.loads(Path(local).read_text())
    check_report(report, f"MLflow run {ref}")
    report["name"] = run.info.run_name or report.get("name", ref)
    report["source"] = f"run {ref}"
    return report


def tracking_target(config: dict, checkpoint: Path, mlflow_run: str | None = None,
                    experiment: str | None = None, tracking_uri: str | None = None) -> dict | None:
    """Where a checkpoint's report goes: :func:`open_run`'s arguments, or None (a checkpoint of no
    recorded run, and neither a run nor an experiment named). ``mlflow_run``, else the run
    recorded in the checkpoint's ``config`` (key ``mlflow``) unless ``tracking_uri`` names
    another store, else a new run of ``experiment`` when one is named or the store is another. A
    named run is opened now: a wrong run id fails before minutes of scoring."""
    recorded = config.get("mlflow") or {}
    elsewhere = tracking_uri is not None and recorded.get("tracking_uri") is not None and \
        retry_locked(lambda: resolve_tracking_uri(tracking_uri), tracking_uri,
                     "nothing was scored yet") != recorded["tracking_uri"]
    run = mlflow_run or (None if experiment or elsewhere else recorded.get("run_id"))
    if elsewhere and not run:  # another store than the training run's: a new run there
        experiment = experiment or DEFAULT_EXPERIMENT
    if not (run or experiment):
        return None
    uri = tracking_uri or (recorded.get("tracking_uri") if run == recorded.get("run_id") else None)
    target = dict(tracking_uri=uri, run_id=run, experiment=experiment or DEFAULT_EXPERIMENT,
                  run_name=f"evaluate {Path(checkpoint).name}")
    if run:
        retry_locked(lambda: open_run(**target), given_tracking_uri(uri), "nothing was scored yet")
    return target


def evaluate_tracked(checkpoint: str | Path, data: str | Path, options: EvalConfig | None = None,
                     out: str | Path | None = None, windows: str | Path | None = None,
                     split: str = "eval", progress: bool = True, mlflow_run: str | None = None,
                     experiment: str | None = None, tracking_uri: str | None = None,
                     track: bool = True) -> dict:
    """:func:`megabase.eval.evaluate.evaluate`, then the report logged to its run
    (:func:`tracking_target`; ``track=False`` logs nothing). The report is on disk before MLflow
    is asked for anything, so a tracking store that fails or stays locked costs no scoring
    (:func:`log_saved_report` logs it later); a run is created only then, and deleted if logging
    fails."""
    # here, not at the top: they load torch, which megabase log and compare never need
    from megabase.eval.evaluate import check_output, evaluate
    from megabase.model.checkpoint import held_checkpoint, read_checkpoint_config

    options = (options or EvalConfig()).check()  # bad options are refused before anything is read
    if out is not None:
        check_output(Path(out))
    with held_checkpoint(checkpoint) as held:
        target = None
        if track:
            target = tracking_target(read_checkpoint_config(held), held, mlflow_run, experiment,
                                     tracking_uri)
        report = evaluate(held, data, options, out, windows, split, progress)
        if target:
            log_saved_report(report, Path(report["files"]["json"]).parent, target)
        return report


def log_saved_report(report: dict, out: Path, tracking: dict) -> dict:
    """Log a report written in ``out`` to MLflow (``tracking``: :func:`open_run` arguments), then
    record the run in its ``report.json``; waits a while for a locked store (retry_locked)."""
    given = given_tracking_uri(tracking.get("tracking_uri"))
    where = "--mlflow-run " + tracking["run_id"] if tracking.get("run_id") else \
        "--experiment " + str(tracking.get("experiment", DEFAULT_EXPERIMENT))

    def kept(uri: str) -> str:
        return f"the report is in {out}; log it later with `megabase log {out} --tracking-uri " \
            f"{uri} {where}`"

    # making a new store writes it: a full disk fails here already
    uri = retry_locked(lambda: resolve_tracking_uri(given), given, kept(given))
    target = retry_locked(lambda: open_run(**{**tracking, "tracking_uri": uri}), uri, kept(uri))
    report["mlflow"] = {k: target[k] for k in ("tracking_uri", "run_id", "experiment_id")}
    try:
        files = write_report(report, out)
        retry_locked(lambda: log_report(report, files, target), uri, kept(uri))
    except BaseException:
        abandon_run(target)
        report.pop("mlflow")
        write_report(report, out)  # no run named that holds nothing
        raise
    return report
