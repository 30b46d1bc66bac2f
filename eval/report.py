"""Evaluation reports: bins per series (model, controls, baselines) -> report.json, report.csv, PNG.

``report.json`` holds ``bins`` (a list of objects with ``context_lo, context_hi, n_tokens,
nats_per_base, bits_per_base, perplexity, unique, repeat, bits_per_base_ci``), ``overall`` with the
same fields, and beside them ``controls``, ``probe``, ``baselines``, ``copy_reference`` (the copy
model's curve, its own controls and gains over them), ``context_worth`` (per control: what context
beyond its limit gives the model and the copy model) and the published ``anchors``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from megabase.data.atomic import write_atomic

from .bins import BinAccumulator

ANCHORS = {
    "order-0 entropy of DNA": "about 1.95-2.0 bits/base",
    "DNA compressors, whole human genome": "1.38 (JARVIS3) - 1.6 bits/base",
    "Evo 2 7B at 1M context (its own validation mix)": "1.377 bits/base",
}


def score_series(scorer, store, windows, edges, n_boot: int = 1000, seed: int = 0,
                 progress: bool = True, desc: str = "scoring") -> dict:
    """Score every window with ``scorer`` and bin it: ``{"bins", "overall", "n_windows"}``."""
    return accumulate(scorer, store, windows, edges, progress, desc).summary(n_boot=n_boot,
                                                                             seed=seed)


def accumulate(scorer, store, windows, edges, progress: bool = True,
               desc: str = "scoring") -> BinAccumulator:
    """Score every window with ``scorer``: the per-window sums of each bin."""
    from tqdm import tqdm

    acc = BinAccumulator(list(edges))
    for w in tqdm(windows, desc=desc, unit="window", disable=None if progress else True,
                  leave=False):
        tokens, mask = store.fetch(w.chrom, w.start, w.end)
        nll = scorer(tokens)
        scored = ~np.isnan(nll)
        acc.add_window(np.nan_to_num(nll), scored, mask)
    return acc


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
