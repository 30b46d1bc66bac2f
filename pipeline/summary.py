"""Short human-readable summaries that end each command (rich tables on stdout)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from megabase.eval.bins import unit_words


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}" if whole else "-"


def print_prepare(fasta: Path, result) -> None:
    """Per record: length, N % (of length), repeat % and GC % (of ACGT bases); totals; throughput."""
    console = Console()
    if result.skipped:
        console.print(f"[green]up to date[/]: {result.store} already holds {fasta} "
                      f"({len(result.records)} records); nothing to do")
        return
    table = Table(title=f"token store {result.store}", title_justify="left")
    for col in ("record", "length", "N %", "repeat % of ACGT", "GC % of ACGT"):
        table.add_column(col, justify="left" if col == "record" else "right")
    total = dict(length=0, n_count=0, softmasked=0, gc_count=0)
    rows = result.records if len(result.records) <= 40 else result.records[:40]
    for rec in result.records:
        for key in total:
            total[key] += rec[key]
    for rec in rows:
        table.add_row(*_prepare_cells(rec["name"], rec))
    if len(result.records) > len(rows):
        table.add_row(f"... {len(result.records) - len(rows)} more", "", "", "", "")
    table.add_row(*_prepare_cells(f"total ({len(result.records)})", total), style="bold")
    console.print(table)
    secs = max(result.seconds, 1e-9)
    console.print(f"{total['length'] / 1e6:,.1f} Mbp in {result.seconds:.2f} s: "
                  f"{total['length'] / 1e6 / secs:,.0f} Mbp/s, "
                  f"{result.source_bytes / 1e6 / secs:,.0f} MB/s of {fasta.name}")


def _prepare_cells(name: str, rec: dict) -> list[str]:
    acgt = rec["length"] - rec["n_count"]
    return [name, f"{rec['length']:,}", _pct(rec["n_count"], rec["length"]),
            _pct(rec["softmasked"], acgt), _pct(rec["gc_count"], acgt)]


def print_windows(out: Path, length: int, per_split: dict) -> None:
    """Per split: regions, windows kept, bases, short windows, windows dropped for N."""
    console = Console()
    table = Table(title=f"windows of {length:,} bases -> {out}", title_justify="left")
    for col in ("split", "regions", "windows", "bases", "short", "dropped (N)"):
        table.add_column(col, justify="left" if col in ("split", "regions") else "right")
    for name, info in per_split.items():
        regions = ", ".join(info.regions)
        table.add_row(name, regions if len(regions) < 60 else regions[:57] + "...",
                      f"{info.windows:,}", f"{info.bases:,}", f"{info.short:,}",
                      f"{info.dropped_n:,}")
    console.print(table)


def _bits(entry: dict) -> str:
    return "-" if entry["bits_per_base"] is None else f"{entry['bits_per_base']:.4f}"


def print_report(report: dict) -> None:
    """Bits/base per context bin for every series of a report, the probe, and the anchors."""
    from megabase.eval.report import ANCHORS, series

    console = Console()
    curves = series(report)
    table = Table(title=f"bits/base by prior context ({report['n_windows']:,} windows)",
                  title_justify="left")
    table.add_column("context")
    table.add_column("bases", justify="right")
    for name in curves:
        table.add_column(name, justify="right")
    for i, b in enumerate(report["bins"]):
        table.add_row(f"[{b['context_lo']:,}, {b['context_hi']:,})", f"{b['n_tokens']:,}",
                      *(_bits(c["bins"][i]) for c in curves.values()))
    overall = report["overall"]
    table.add_row("all", f"{overall['n_tokens']:,}", *(_bits(c["overall"]) for c in curves.values()),
                  style="bold")
    console.print(table)
    lo, hi = overall["bits_per_base_ci"]
    if lo is not None:
        console.print(f"{report['name']}: {overall['bits_per_base']:.4f} bits/base "
                      f"(95% CI {lo:.4f}-{hi:.4f} over {unit_words(report.get('ci_unit'))}); repeat "
                      f"{_bits(overall['repeat'])}, unique {_bits(overall['unique'])}")
    for limit, rows in report.get("context_gain", {}).items():
        cells = []
        for row in rows:
            g = row["all"]
            if row["context_lo"] >= int(limit) and g["gain_bits_per_base"] is not None:
                lo, hi = g["ci"]
                ci = "" if lo is None else f" [{lo:+.4f}, {hi:+.4f}]"
                cells.append(f"[{row['context_lo']:,}, {row['context_hi']:,}) "
                             f"{g['gain_bits_per_base']:+.4f}{ci}")
        if cells:
            console.print(f"gain over the control <= ~{int(limit):,} (bits/base, paired 95% CI): "
                          + "; ".join(cells))
    for row in report.get("probe", []):
        lo, hi = row.get("second_copy_ci", (None, None))
        ci = f" (95% CI {lo:.3f}-{hi:.3f})" if lo is not None else ""
        hits = row.get("dsa_hit_rate")
        hit = ""
        if hits and row.get("chance_hit_rate") is not None:
            hit = ("; DSA top-k holds the aligned key for "
                   + ", ".join("-" if h is None else f"{h:.0%}" for h in hits)
                   + f" of queries (chance {row['chance_hit_rate']:.0%})")
        copies = row.get("n_copies", row.get("n_windows"))
        where = f"{row.get('n_windows', '?')} windows" + (
            f", {copies} copies" if copies != row.get("n_windows") else "")
        console.print(f"recall probe d={row['distance']:,} ({where}): "
                      f"first copy {row['first_copy_bits_per_base']:.3f}, second copy "
                      f"{row['second_copy_bits_per_base']:.3f} bits/base{ci}{hit}")
    best = report.get("best_baseline")
    if best:
        console.print(f"best baseline: {best['name']}, {best['bits_per_base']:.4f} bits/base")
    for line in _copy_lines(report):
        console.print(line)
    for line in _ablation_lines(report):
        console.print(line)
    for line in _moe_lines(report):
        console.print(line)
    console.print("published anchors: " + "; ".join(f"{k}: {v}" for k, v in ANCHORS.items()))
    tries = report.get("tries", 1)
    cost = f"{report['seconds']:.1f} s" + (f" over {tries} tries" if tries > 1 else "")
    console.print(f"report: {', '.join(report['files'].values())} ({cost})")
    if report.get("mlflow"):
        m = report["mlflow"]
        console.print(f"MLflow run {m['run_id']} in {m['tracking_uri']}; browse with "
                      f"`mlflow ui --backend-store-uri {m['tracking_uri']}`")


def print_score(result) -> None:
    """Per region: bases, scored bases, mean bits/base (and entropy); files; time and peak memory."""
    console = Console()
    table = Table(title="per-base surprisal", title_justify="left")
    with_entropy = any(t.entropy is not None for t in result.tracks)
    for col in ("region", "bases", "scored", "mean bits/base") + (("mean entropy",) if with_entropy else ()):
        table.add_column(col, justify="left" if col == "region" else "right")
    for t in result.tracks:
        scored = int((t.bits == t.bits).sum())
        row = [str(t.region.spec), f"{len(t.bits):,}", f"{scored:,}", _num(t.mean_bits)]
        if with_entropy:
            row.append(_num(float(t.entropy[t.bits == t.bits].mean()) if scored else float("nan")))
        table.add_row(*row)
    console.print(table)
    for name, path in result.files.items():
        console.print(f"  {name}: {path}")
    bases = sum(len(t.bits) for t in result.tracks)
    console.print(f"{bases:,} bases in {result.seconds:.1f} s ({bases / max(result.seconds, 1e-9):,.0f} "
                  f"bases/s), peak memory {result.peak_rss / 2**30:.2f} GiB")


def print_generate(result) -> None:
    """Per sample: seed, length, GC %, mean log2 p; the prompt's GC; files; speed."""
    console = Console()
    table = Table(title=f"generated after {result.prompt} ({result.prompt_length:,} bases)",
                  title_justify="left")
    for col in ("sample", "seed", "bases", "GC %", "mean bits/base"):
        table.add_column(col, justify="right")
    for i, s in enumerate(result.samples):
        table.add_row(str(i + 1), str(s.seed), f"{len(s.tokens):,}", f"{100 * s.gc:.1f}",
                      _num(float(-s.log_probs.mean() / 0.6931471805599453)))
    console.print(table)
    for name, path in result.files.items():
        console.print(f"  {name}: {path}")
    console.print(f"{sum(len(s.tokens) for s in result.samples):,} bases in {result.seconds:.1f} s "
                  f"({result.bases_per_s:,.1f} bases/s with the prompt's pass), peak memory "
                  f"{result.peak_rss / 2**30:.2f} GiB")


def print_embed(result) -> None:
    """What was embedded, the array's shape, files, time and peak memory."""
    console = Console()
    kind = "per base" if result.per_base else "mean-pooled per window"
    bases = sum(w.length for w in result.windows)
    console.print(f"embedded {len(result.windows):,} windows ({bases:,} bases), layer {result.layer}, "
                  f"{kind}: array {tuple(result.embeddings.shape)}")
    for name, path in result.files.items():
        console.print(f"  {name}: {path}")
    console.print(f"{result.seconds:.1f} s ({bases / max(result.seconds, 1e-9):,.0f} bases/s), "
                  f"peak memory {result.peak_rss / 2**30:.2f} GiB")


def print_export_model(result) -> None:
    """Where the folder is, what it holds, and how to load it."""
    console = Console()
    console.print(f"exported {result.checkpoint} ({result.parameters['total']:,} parameters) to "
                  f"{result.out} in {result.seconds:.1f} s")
    console.print(f"  model card quotes: {result.report or 'no evaluation report (none found)'}")
    console.print(f"  files: {', '.join(result.files)}")
    console.print(f"  load: AutoModelForCausalLM.from_pretrained({str(result.out)!r}, "
                  "trust_remote_code=True)")


def print_variants(result) -> None:
    """How many alleles, the spread of their scores, files, time and peak memory."""
    console = Console()
    deltas = [v.delta for v in result.variants]
    from megabase.infer.variants import scope

    console.print(f"scored {len(deltas):,} variants (alleles) in {result.windows:,} passes "
                  f"({scope(result.window, result.context, result.horizon)}): "
                  f"log p(alt) - log p(ref) median {_num(sorted(deltas)[len(deltas) // 2])} nats, "
                  f"min {_num(min(deltas))}, max {_num(max(deltas))}" if deltas else
                  "no variants in the VCF")
    for name, path in result.files.items():
        console.print(f"  {name}: {path}")
    console.print(f"{result.seconds:.1f} s, peak memory {result.peak_rss / 2**30:.2f} GiB")


def print_compare(table) -> None:
    """A :class:`megabase.eval.compare.Comparison` as one table, gains vs the first column; more
    than three curves (a sweep) print one row per curve instead, so that the table stays readable."""
    console = Console()
    if len(table.columns) > 3:
        _print_compare_rows(console, table)
        return
    out = Table(title="bits/base by prior context", title_justify="left")
    out.add_column("context")
    for name in table.columns:
        out.add_column(name, justify="right")
    for name in table.columns[1:]:
        out.add_column(f"gain of {name}", justify="right")
    gains = [table.gain(c) for c in range(1, len(table.columns))]
    for r, row in enumerate(table.rows):
        label = f"[{row[0]:,}, {row[1]:,})" if row else "all"
        cells = [_num(b[r]) for b in table.bits] + [_num(g[r], signed=True) for g in gains]
        out.add_row(label, *cells, style=None if row else "bold")
    console.print(out)
    if gains:
        console.print(f"gain = bits/base of {table.columns[0]!r} minus the column's: positive "
                      "means fewer bits, a better model")
    for line in table.notes():
        console.print(f"note: {line}")


def _num(x: float, signed: bool = False) -> str:
    if x != x:
        return "-"
    return f"{x:+.4f}" if signed else f"{x:.4f}"


def _mlflow_hint(uri: str, run_id: str) -> str:
    return (f"MLflow run {run_id} in {uri}\n  browse: mlflow ui --backend-store-uri {uri}  "
            "(then open http://127.0.0.1:5000)")


def _print_compare_rows(console, table) -> None:
    out = Table(title="bits/base by prior context, one row per curve", title_justify="left")
    out.add_column("curve")
    for row in table.rows:
        out.add_column(f"[{row[0]:,}, {row[1]:,})" if row else "all", justify="right")
    out.add_column("gain (all)", justify="right")
    for c, name in enumerate(table.columns):
        out.add_row(name, *[_num(b) for b in table.bits[c]], _num(table.gain(c)[-1], signed=True))
    console.print(out)
    console.print(f"gain = bits/base of {table.columns[0]!r} minus the row's: positive means fewer "
                  "bits, a better model")
    for line in table.notes():
        console.print(f"note: {line}")


def moe_warning(layer: int, ratio: float, idle: int, step: int) -> str:
    """The one-line warning of a MoE layer whose routing collapses."""
    what = f"max/mean expert load {ratio:.2f}" + (f", {idle} expert(s) idle" if idle else "")
    return (f"warning: MoE layer {layer} at step {step}: {what} (balanced is 1; see "
            "model.bias_update / bias_update_rate / seq_aux_weight)")


def moe_health(rows: list[dict]) -> list[str]:
    """Warning lines for the summary: layers over the collapse ratio or with idle experts at the
    last step, and how many steps each layer spent so."""
    from .lit import COLLAPSE_RATIO

    rows = [r for r in rows if "moe_load_per_layer" in r]
    if not rows:
        return []
    out = []
    for i, (ratio, idle) in enumerate(zip(rows[-1]["moe_load_per_layer"], rows[-1]["moe_idle_experts"])):
        bad = sum(r["moe_load_per_layer"][i] > COLLAPSE_RATIO or r["moe_idle_experts"][i] > 0
                  for r in rows)
        if ratio > COLLAPSE_RATIO or idle:
            out.append(moe_warning(i, ratio, idle, rows[-1]["step"]) +
                       f"; {bad} of {len(rows)} steps so")
    return out


def lengths_trained(rows: list[dict]) -> str:
    """``"150 x 2,048, ..., 2 x 1,048,576"``: how many of ``rows``' steps trained at each length
    (the sequence-length warm-up's, in order)."""
    counts: dict[int, int] = {}
    for r in rows:
        counts[r["window_length"]] = counts.get(r["window_length"], 0) + 1
    return ", ".join(f"{n} x {length:,}" for length, n in counts.items())


def print_train(result) -> None:
    """Steps, final loss, speed, and where the checkpoint and the MLflow run are."""
    console = Console()
    rows = result.history
    table = Table(title=f"training: {result.run_dir.name}", title_justify="left")
    for col in ("", "value"):
        table.add_column(col)
    table.add_row("steps", f"{result.steps}" + (f" (resumed at {result.resumed_from})"
                                                 if result.resumed_from else "")
                  + (f" of {result.planned_steps}: train.max_minutes reached"
                     if result.planned_steps else ""))
    if rows:
        first, last = rows[0], rows[-1]
        table.add_row("loss (bits/base)", f"{first['bits_per_base']:.4f} at step {first['step']} "
                      f"-> {last['bits_per_base']:.4f} at step {last['step']}")
        table.add_row("window lengths", lengths_trained(rows))
        speed = sum(r["tokens_per_s"] for r in rows) / len(rows)
        table.add_row("tokens/s (mean)", f"{speed:,.0f}")
        full = [r["peak_mem_gib"] for r in rows if r["window_length"] == last["window_length"]]
        peak = f"{max(r['peak_mem_gib'] for r in rows):.2f} GiB"
        if len(full) < len(rows):  # the warm-up's steps too: the longest windows' own peak
            peak += f" ({max(full):.2f} GiB in the steps of {last['window_length']:,} tokens)"
        table.add_row("peak memory", peak)
        if "moe_load_per_layer" in last:
            table.add_row("MoE max/mean load per layer (last step)",
                          " ".join(f"{r:.2f}" for r in last["moe_load_per_layer"]))
    table.add_row("time", f"{result.seconds:.1f} s")
    console.print(table)
    for line in moe_health(rows):
        console.print(f"[yellow]{line}[/]")
    console.print(f"checkpoint: {result.checkpoint}")
    console.print(_mlflow_hint(result.tracking_uri, result.run_id))


def _ci(entry: dict) -> str:
    lo, hi = entry.get("bits_per_base_ci") or (None, None)
    return "" if lo is None else f" (95% CI {lo:.4f}-{hi:.4f})"


def evaluation_lines(report: dict) -> list[str]:
    """The instruments of a report in a few lines: the best baseline and whether the model's CI
    clears it, the gain over the context control beyond it, the recall probe, held-out MoE load."""
    lines = []
    best = report.get("best_baseline")
    if best and report.get("overall"):
        base = report["baselines"][best["name"]]["overall"]
        model = report["overall"]
        apart = model["bits_per_base_ci"][1] is not None and base["bits_per_base_ci"][0] is not None \
            and model["bits_per_base_ci"][1] < base["bits_per_base_ci"][0]
        lines.append(f"best baseline {best['name']}: {best['bits_per_base']:.4f}{_ci(base)}; the "
                     f"model is {'below it, CIs apart' if apart else 'not below it with the CIs apart'}")
    for limit, rows in report.get("context_gain", {}).items():
        far = [r for r in rows if r["context_lo"] >= int(limit) and r["all"]["gain_bits_per_base"] is not None]
        if far:
            cells = ", ".join(f"[{r['context_lo']:,}, {r['context_hi']:,}) "
                              f"{r['all']['gain_bits_per_base']:+.4f}" for r in far)
            lines.append(f"context gain over the <= ~{int(limit):,} control (bits/base): {cells}")
    probe = report.get("probe", [])
    if probe:
        lines.append("recall probe, second vs first copy (bits/base): " + ", ".join(
            f"d={r['distance']:,} {r['second_copy_bits_per_base']:.3f} vs "
            f"{r['first_copy_bits_per_base']:.3f}" for r in probe))
    return lines + _copy_lines(report) + _moe_lines(report)


def _gain(entry: dict) -> str:
    g, (lo, hi) = entry["gain_bits_per_base"], entry["ci"]
    if g is None:
        return "-"
    return f"{g:+.4f}" + ("" if lo is None else f" [{lo:+.4f}, {hi:+.4f}]")


def _copy_lines(report: dict) -> list[str]:
    """The copy-model reference overall, and per control what context beyond its limit gives the
    model and the copy model (paired 95% CIs) and the model's share of the copy model's gain."""
    ref = report.get("copy_reference")
    if not ref:
        return []
    lines = [f"copy-model reference ({ref.get('label', ref['name'])}): "
             f"{ref['overall']['bits_per_base']:.4f} bits/base{_ci(ref['overall'])}"]
    for limit, w in report.get("context_worth", {}).items():
        share = "" if w["share"] is None else f"; the model gets {w['share']:.0%} of the copy model's"
        lines.append(f"context beyond ~{int(limit):,} ([{w['context_lo']:,}, {w['context_hi']:,})): "
                     f"the copy model gains {_gain(w['copy']['all'])} bits/base, the model "
                     f"{_gain(w['model']['all'])}{share}")
    return lines


def _ablation_lines(report: dict) -> list[str]:
    """Per ablation, what it costs the model beyond its limit (ablated minus full, paired 95%
    CIs), repeat and unique apart: negative where the context it cuts was doing harm."""
    lines = []
    for name, a in report.get("ablations", {}).items():
        beyond = a.get("cost_beyond")
        if beyond is None:
            continue
        parts = ", ".join(f"{kind} {_gain(beyond[kind])}" for kind in ("all", "unique", "repeat"))
        lines.append(f"ablation {name} ({a['label']}): beyond [{beyond['context_lo']:,}, "
                     f"{beyond['context_hi']:,}) it costs {parts} bits/base")
    return lines


def _moe_lines(report: dict) -> list[str]:
    loads = [r["max_over_mean"] for r in report.get("moe_load", []) if r["max_over_mean"]]
    if not loads:
        return []
    idle = sum(r["idle_experts"] for r in report["moe_load"])
    lines = [f"held-out MoE load, max/mean per layer {' '.join(f'{x:.2f}' for x in loads)}"
             + (f", {idle} idle expert(s)" if idle else ", no idle expert")]
    fit = report.get("moe_rebalance")
    if fit and fit["max_over_mean"]:
        kept = fit.get("kept", len(fit["max_over_mean"]) - 1)
        before, after = (" ".join(f"{x:.2f}" for x in row) for row in
                         (fit["max_over_mean"][0], fit["max_over_mean"][kept]))
        lines.append(f"MoE biases re-fitted first on {', '.join(fit['regions'])} ({fit['bases']:,} "
                     f"bases, {fit['rounds']} rounds, kept those after round {kept}): max/mean "
                     f"there {before} -> {after}")
        cost, was = fit["cost"]["all"], fit["trained"]
        if cost["gain_bits_per_base"] is not None:
            lo, hi = (f"{x:+.4f}" if x is not None else "?" for x in cost["ci"])
            loads = " ".join(f"{r['max_over_mean']:.2f}" for r in was["moe_load"])
            lines.append(f"with the trained biases the same windows score {was['bits_per_base']:.4f} "
                         f"bits/base (max/mean {loads}): the imbalance costs "
                         f"{cost['gain_bits_per_base']:+.4f} ({lo}, {hi}) bits/base")
    return lines


def print_run(result) -> None:
    """What each stage did, the held-out result, and where everything is."""
    console = Console()
    table = Table(title="megabase run", title_justify="left")
    table.add_column("stage")
    table.add_column("")
    for stage, what in result.stages.items():
        table.add_row(stage, what)
    console.print(table)
    if result.history:
        first, last = result.history[0], result.history[-1]
        console.print(f"training loss {first['bits_per_base']:.4f} -> "
                      f"{last['bits_per_base']:.4f} bits/base over {last['step']} steps")
    for line in moe_health(result.history):
        console.print(f"[yellow]{line}[/]")
    if result.overall:
        o = result.overall
        beside = "; ".join(f"{k} {v:.4f}" for k, v in result.baselines.items() if v is not None)
        console.print(f"held-out: {o['bits_per_base']:.4f} bits/base{_ci(o)} over "
                      f"{o['n_tokens']:,} bases"
                      + (f" (beside it: {beside})" if beside else " (order-0 DNA is ~1.95-2.0)"))
    for line in evaluation_lines(result.evaluation or {}):
        console.print(line)
    console.print(f"store: {result.store}\nwindows: {result.windows}\n"
                  f"checkpoint: {result.checkpoint}")
    if result.report:
        console.print(f"report: {result.report} (+ report.csv, report.png)")
    console.print(_mlflow_hint(result.tracking_uri, result.run_id))
    console.print(f"total {result.seconds:.1f} s")


def print_rl(result) -> None:
    """Reward, held-out check, KL, mismatch and staleness at the start and the end; files."""
    console = Console()
    table = Table(title=f"rl: {result.steps} steps in {result.seconds / 60:.1f} min",
                  title_justify="left")
    for col in ("", "first 5 steps", "last 5 steps"):
        table.add_column(col, justify="left" if not col else "right")
    rows = [("reward", "reward"), ("held-out motif hits", "heldout/motif_hits"),
            ("KL to the start (k3)", "kl_start"), ("bits/base under the start", "start_bits_per_base"),
            ("mismatch k3 (same weights)", "mismatch/k3"),
            ("routing differs", "mismatch/routing_differs"),
            ("distinct 6-mers", "sample/distinct_kmers")]
    for label, key in rows:
        fmt = (lambda x: "-" if x != x else f"{x:.2e}") if key.startswith("mismatch") else _num
        table.add_row(label, fmt(result.mean(key, first=5)), fmt(result.mean(key, last=5)))
    console.print(table)
    st = result.staleness
    console.print(f"groups kept {st['kept']:,}, dropped {st['dropped']:,} (lag histogram "
                  f"{st['lag_histogram']})")
    if result.seconds_to_target is not None:
        console.print(f"target reward reached after {result.seconds_to_target:.0f} s")
    console.print(f"  checkpoint: {result.checkpoint}")
    for name, path in result.files.items():
        console.print(f"  {name}: {path}")
