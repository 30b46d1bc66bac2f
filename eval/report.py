"""Evaluation reports: bins per series (model, controls, baselines) -> report.json, report.csv, PNG.

``report.json`` holds ``bins`` (a list of objects with ``context_lo, context_hi, n_tokens,
nats_per_base, bits_per_base, perplexity, unique, repeat, bits_per_base_ci``; the bins cover every
scored base), ``overall`` with the same fields, ``windows_sha256`` (which windows were scored),
and beside them ``controls``, ``probe``, ``baselines``, ``copy_reference`` (the copy model's
curve, its own controls and gains over them), ``context_worth`` (per control: what context beyond
its limit gives the model and the copy model) and the published ``anchors``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from megabase.core.atomic import write_atomic
from megabase.core.errors import InputError
from megabase.data.progress import Progress

from .bins import BinAccumulator
from .journal import Journal

ANCHORS = {
    "order-0 entropy of DNA": "about 1.95-2.0 bits/base",
    "DNA compressors, whole human genome": "1.38 (JARVIS3) - 1.6 bits/base",
    "Evo 2 7B at 1M context (its own validation mix)": "1.377 bits/base",
}


def score_series(scorer, store, windows, edges, n_boot: int = 1000, seed: int = 0,
                 progress: bool = True, desc: str = "scoring", block: int | None = None,
                 journal: Journal | None = None) -> dict:
    """Score every window with ``scorer`` and bin it: ``{"bins", "overall", "n_windows",
    "ci_unit"}`` (:func:`accumulate`'s arguments)."""
    return accumulate(scorer, store, windows, edges, progress, desc, block=block,
                      journal=journal).summary(n_boot=n_boot, seed=seed)


def accumulate(scorer, store, windows, edges, progress: bool = True, desc: str = "scoring",
               block: int | None = None, journal: Journal | None = None,
               counter: np.ndarray | None = None) -> BinAccumulator:
    """Score every window with ``scorer``: the per-window (``block``: per-block) sums of each bin.
    ``progress``: a bar on a terminal, else a log line every half minute
    (:mod:`megabase.data.progress`).

    ``journal`` (:class:`~megabase.eval.journal.Journal`): windows finished by a stopped try of
    this evaluation are read from it under the series name ``desc``, the others written to it as
    they finish. ``counter``: an array the scorer adds to as it scores (a MoE load count, the copy
    model's statistics); its change over each window is journaled too, and added back for a
    window read from the journal, so it ends as an uninterrupted evaluation's."""
    acc = BinAccumulator(list(edges), block=block)
    done = [journal.get(desc, i) if journal else None for i in range(len(windows))]
    left = sum(d is None for d in done)
    with Progress(left, desc, unit="window", enabled=progress) as bar:
        if left < len(windows):
            bar.write(f"megabase: {desc}: {len(windows) - left} of {len(windows)} windows "
                      "finished by the stopped evaluation")
        for i, w in enumerate(windows):
            if done[i] is not None:
                acc.add_rows(np.array(done[i]["nats"]), np.array(done[i]["counts"]))
                if counter is not None:
                    _add(counter, done[i]["counter"])
                continue
            before = None if counter is None else _copy(counter)
            tokens, mask = store.fetch(w.chrom, w.start, w.end)
            nll = scorer(tokens)
            scored = ~np.isnan(nll)
            nats, counts = acc.window_rows(np.nan_to_num(nll), scored, mask)
            acc.add_rows(nats, counts)
            if journal is not None:
                extra = {} if counter is None else {"counter": _delta(counter, before)}
                journal.add(desc, i, nats=nats, counts=counts, **extra)
            bar.update(1, bases=w.length)
    return acc


def _add(counter, values: list) -> None:
    """``counter += values`` in place (a numpy array or a torch tensor)."""
    if isinstance(counter, np.ndarray):
        counter += np.array(values, dtype=counter.dtype)
    else:
        counter += counter.new_tensor(values)


def _copy(counter):
    return counter.copy() if isinstance(counter, np.ndarray) else counter.clone()


def _delta(counter, before) -> list:
    """``counter - before`` as nested lists (a numpy array or a torch tensor)."""
    return np.asarray(counter - before).tolist()


def windows_sha256(store, windows) -> str:
    """A digest of the windows a report scored (each one's record, by the sha256 of its tokens
    in ``store``, and its ``start end``, in order), so that `compare` can tell two reports of the
    same bases from two of as many different ones."""
    import hashlib

    digest = hashlib.sha256()
    for w in windows:
        record = store.records[store.resolve(w.chrom)]
        digest.update(f"{record.get('tokens_sha256', w.chrom)}\t{w.start}\t{w.end}\n".encode())
    return digest.hexdigest()


def series(report: dict) -> dict[str, dict]:
    """Every binned curve of a report by name: the model, ``control<=N``, ``baseline names``,
    ``copy model`` and ``copy model, context <= ~N``."""
    out = {report.get("name", "model"): report} if "bins" in report else {}
    for limit, summary in report.get("controls", {}).items():
        out[f"control, context <= ~{limit}"] = summary
    out.update(report.get("baselines", {}))
    ref = report.get("copy_reference")
    if ref:
        out[ref["name"]] = ref
        for limit, summary in ref.get("controls", {}).items():
            out[f"{ref['name']}, context <= ~{limit}"] = summary
    return out


def roles(report: dict) -> dict[str, str]:
    """The role of each of :func:`series`' curves: ``model`` (a baseline report's own curve too),
    ``control``, ``baseline``, ``reference`` (the copy model) or ``reference control``."""
    out = {report.get("name", "model"): "model"}
    out.update({f"control, context <= ~{c}": "control" for c in report.get("controls", {})})
    out.update({name: "baseline" for name in report.get("baselines", {})})
    ref = report.get("copy_reference")
    if ref:
        out[ref["name"]] = "reference"
        out.update({f"{ref['name']}, context <= ~{c}": "reference control"
                    for c in ref.get("controls", {})})
    return out


def to_csv(report: dict) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["series", "context_lo", "context_hi", "n_tokens", "nats_per_base",
                     "bits_per_base", "perplexity", "bits_ci_lo", "bits_ci_hi",
                     "unique_bits_per_base", "repeat_bits_per_base"])
    for name, s in series(report).items():
        for b in [*s["bins"], {**s["overall"], "context_lo": "all", "context_hi": "all"}]:
            writer.writerow([name, b["context_lo"], b["context_hi"], b["n_tokens"],
                             b["nats_per_base"], b["bits_per_base"], b["perplexity"],
                             *b["bits_per_base_ci"], b["unique"]["bits_per_base"],
                             b["repeat"]["bits_per_base"]])
    return buf.getvalue()


def plot(report: dict, path: Path) -> None:
    """Bits/base vs prior context (log x), one line per series, CI bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for name, s in series(report).items():
        pts = [((max(b["context_lo"], 1) * b["context_hi"]) ** 0.5, b["bits_per_base"],
                *b["bits_per_base_ci"]) for b in s["bins"] if b["n_tokens"]]
        if not pts:
            continue
        x, y, lo, hi = (np.array([p[i] for p in pts], dtype=float) for i in range(4))
        (line,) = ax.plot(x, y, marker="o", label=name)
        if not np.isnan(lo).all():
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xscale("log")
    ax.set_xlabel("prior context (bases)")
    ax.set_ylabel("bits / base")
    ax.set_title(report.get("title", "held-out loss by prior context"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``report.csv`` and ``report.png`` into ``out`` (each atomically)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {**report, "anchors": ANCHORS}
    paths = {"json": out / "report.json", "csv": out / "report.csv", "png": out / "report.png"}
    write_atomic(paths["json"], (json.dumps(report, indent=1) + "\n").encode())
    write_atomic(paths["csv"], to_csv(report).encode())
    plot(report, paths["png"])
    return paths


BIN_FIELDS = ("context_lo", "context_hi", "n_tokens", "bits_per_base")


def check_report(report, source: str) -> None:
    """The fields `compare` and the notebooks read, with their types; an InputError names the
    first that is missing or wrong (a half-written or hand-edited report)."""
    if not isinstance(report, dict) or not isinstance(report.get("bins"), list) \
            or not isinstance(report.get("overall"), dict):
        raise InputError("not a megabase report (no 'bins' list and 'overall' table)", source)
    for i, b in enumerate([*report["bins"], report["overall"]]):
        where = f"bins[{i}]" if i < len(report["bins"]) else "overall"
        for key in BIN_FIELDS[2:] if where == "overall" else BIN_FIELDS:
            value = b.get(key) if isinstance(b, dict) else None
            if key != "bits_per_base" and not isinstance(value, int) or \
                    key == "bits_per_base" and value is not None and not isinstance(value, (int, float)):
                raise InputError(f"not a complete megabase report: {where}.{key} is "
                                 f"{'missing' if value is None else repr(value)[:40]}", source)


def check_loggable(report, source: str) -> None:
    """:func:`check_report`, then everything logging reads (the metrics, the table of every
    series, the CSV), built once before any run is made: an InputError says what is missing or
    malformed in a hand-edited or half-written report, instead of a traceback half-way through."""
    check_report(report, source)
    try:
        report_metrics(report)
        report_table(report)
        to_csv(report)
    except KeyError as exc:
        raise InputError(f"not a complete megabase report: no {exc.args[0]!r} field where "
                         "logging needs one", source) from None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise InputError(f"not a complete megabase report: {str(exc)[:120]}", source) from None


def bin_key(b: dict) -> str:
    return f"ctx_{b['context_lo']}-{b['context_hi']}"


def report_metrics(report: dict) -> dict[str, float]:
    """The flat metrics of a report, NaN-free: what it logs to a tracking run
    (:mod:`megabase.pipeline.tracking` lists them)."""
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
    for name, a in report.get("ablations", {}).items():
        add(f"eval/ablation/{name}", a, per_bin=True)
        for part in ("all", "unique", "repeat"):
            g = (a.get("cost_beyond") or {}).get(part)
            if g:
                key = f"eval/ablation/{name}/cost_beyond/{part}"
                out[key] = g["gain_bits_per_base"]
                out[key + "/ci_lo"], out[key + "/ci_hi"] = g["ci"]
    for key in ("seconds", "tries"):
        if isinstance(report.get(key), (int, float)):
            out[f"eval/{key}"] = float(report[key])
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
    role_of = roles(report)
    cols: dict[str, list] = {k: [] for k in (
        "series", "role", "context_lo", "context_hi", "n_tokens", "bits_per_base",
        "nats_per_base", "bits_ci_lo", "bits_ci_hi", "unique_bits_per_base",
        "repeat_bits_per_base")}
    for name, s in series(report).items():
        for b in s["bins"]:
            row = {"series": name, "role": role_of.get(name, "model"),
                   "context_lo": b["context_lo"], "context_hi": b["context_hi"],
                   "n_tokens": b["n_tokens"], "bits_per_base": b["bits_per_base"],
                   "nats_per_base": b["nats_per_base"], "bits_ci_lo": b["bits_per_base_ci"][0],
                   "bits_ci_hi": b["bits_per_base_ci"][1],
                   "unique_bits_per_base": b["unique"]["bits_per_base"],
                   "repeat_bits_per_base": b["repeat"]["bits_per_base"]}
            for key, value in row.items():
                cols[key].append(value)
    return cols
