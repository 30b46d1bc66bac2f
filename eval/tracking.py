"""MLflow tracking of evaluation reports, and loading reports back from runs or files.

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

import json
import os
import tempfile
from pathlib import Path

from megabase.core.errors import InputError

from .report import check_report

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
    import fcntl

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
    import logging

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
    import time

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


def bin_key(b: dict) -> str:
    return f"ctx_{b['context_lo']}-{b['context_hi']}"


def report_metrics(report: dict) -> dict[str, float]:
    """The flat metrics of a report (see the module docs), NaN-free."""
    out: dict[str, float] = {}

    def add(prefix: str, summary: dict, per_bin: bool) -> None:
        o = summary["overall"]
        out[f"{prefix}/n_tokens"] = float(o["n_tokens"])
        for field in ("bits_per_base", "nats_per_base", "perplexity"):
            out[f"{prefix}/{field}"] = o[field]
        for part in ("unique", "repeat"):
            out[f"{prefix}/{part}/bits_per_base"] = o[part]["bits_per_base"]
        if per_bin:
            for b in summary["bins"]:
                out[f"{prefix}/bits_per_base/{bin_key(b)}"] = b["bits_per_base"]
                out[f"{prefix}/n_tokens/{bin_key(b)}"] = float(b["n_tokens"])

    add("eval", report, per_bin=True)
    for limit, summary in report.get("controls", {}).items():
        add(f"eval/control_{limit}", summary, per_bin=True)
    for name, summary in report.get("baselines", {}).items():
        add("eval/baseline/" + name.replace(" ", "_"), summary, per_bin=False)
    for limit, rows in report.get("context_gain", {}).items():
        for row in rows:
            for part in ("all", "unique", "repeat"):
                g = row[part]
                key = f"eval/gain_over_control_{limit}/{part}/{bin_key(row)}"
                out[key] = g["gain_bits_per_base"]
                out[key + "/ci_lo"], out[key + "/ci_hi"] = g["ci"]
    ref = report.get("copy_reference")
    if ref:
        add("eval/copy", ref, per_bin=True)
        for limit, summary in ref.get("controls", {}).items():
            add(f"eval/copy/control_{limit}", summary, per_bin=False)
    for limit, worth in report.get("context_worth", {}).items():
        for who in ("model", "copy"):
            for part in ("all", "unique", "repeat"):
                g = worth[who][part]
                key = f"eval/context_worth_{limit}/{who}/{part}"
                out[key] = g["gain_bits_per_base"]
                out[key + "/ci_lo"], out[key + "/ci_hi"] = g["ci"]
        out[f"eval/context_worth_{limit}/share"] = worth["share"]
    for row in report.get("probe", []):
        d = row["distance"]
        for field in ("first_copy_bits_per_base", "second_copy_bits_per_base", "gain_bits_per_base"):
            out[f"eval/probe/d_{d}/{field}"] = row[field]
        for i, rate in enumerate(row.get("dsa_hit_rate") or []):
            out[f"eval/probe/d_{d}/dsa_hit_rate/layer_{i}"] = rate
    for row in report.get("moe_load", []):
        out[f"eval/moe_load_max_over_mean/layer_{row['layer']}"] = row["max_over_mean"]
        out[f"eval/moe_idle_experts/layer_{row['layer']}"] = float(row["idle_experts"])
    fit = (report.get("moe_rebalance") or {}).get("max_over_mean") or []
    kept = (report.get("moe_rebalance") or {}).get("kept", len(fit) - 1)
    for i, (before, after) in enumerate(zip(fit[0], fit[kept]) if fit else []):
        out[f"eval/moe_rebalance/max_over_mean_before/layer_{i}"] = before
        out[f"eval/moe_rebalance/max_over_mean_after/layer_{i}"] = after
    if (report.get("moe_rebalance") or {}).get("cost"):
        out["eval/moe_rebalance/cost_bits_per_base"] = \
            report["moe_rebalance"]["cost"]["all"]["gain_bits_per_base"]
        out["eval/moe_rebalance/trained_bits_per_base"] = \
            report["moe_rebalance"]["trained"]["bits_per_base"]
    return {k: float(v) for k, v in out.items() if v is not None and v == v}  # empty bins: none


def report_table(report: dict) -> dict[str, list]:
    """Columns of one row per (series, bin): what ``eval/bins.json`` holds. ``role`` is
    ``model`` for the report's own curve (a baseline report's too), else ``control``, ``baseline``,
    ``reference`` (the copy model) or ``reference control``."""
    from .report import roles as curve_roles, series

    roles = curve_roles(report)
    cols: dict[str, list] = {k: [] for k in (
        "series", "role", "context_lo", "context_hi", "n_tokens", "bits_per_base",
        "nats_per_base", "bits_ci_lo", "bits_ci_hi", "unique_bits_per_base",
        "repeat_bits_per_base")}
    for name, s in series(report).items():
        for b in s["bins"]:
            row = {"series": name, "role": roles.get(name, "model"),
                   "context_lo": b["context_lo"], "context_hi": b["context_hi"],
                   "n_tokens": b["n_tokens"], "bits_per_base": b["bits_per_base"],
                   "nats_per_base": b["nats_per_base"], "bits_ci_lo": b["bits_per_base_ci"][0],
                   "bits_ci_hi": b["bits_per_base_ci"][1],
                   "unique_bits_per_base": b["unique"]["bits_per_base"],
                   "repeat_bits_per_base": b["repeat"]["bits_per_base"]}
            for key, value in row.items():
                cols[key].append(value)
    return cols


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
    import time

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
