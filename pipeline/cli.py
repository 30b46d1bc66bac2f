"""The ``megabase`` command line: each subcommand parses its flags and calls one library function.

Bad input (:class:`megabase.data.InputError`) is printed as one line on stderr with exit status 2;
Ctrl-C exits with 130. Heavy imports (torch, datasets) happen inside the subcommands that need them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megabase.core.errors import InputError
from megabase.eval.config import EvalConfig

from . import summary
from megabase.core.errors import TrainingError


def cmd_prepare(args: argparse.Namespace) -> None:
    from megabase.data import default_genome, prepare

    fasta = Path(args.fasta) if args.fasta else Path(str(default_genome()))
    chroms = [c for spec in args.chroms or [] for c in spec.split(",") if c]
    result = prepare(fasta, args.out, chroms=chroms or None, progress=not args.quiet)
    summary.print_prepare(fasta, result)


def cmd_windows(args: argparse.Namespace) -> None:
    from megabase.data import TokenStore, make_windows, windows_comment, write_bed
    from megabase.data.windows import parse_split

    store = TokenStore(args.store)
    splits: dict[str, list[str]] = {}
    for spec in args.split:
        name, regions = parse_split(spec)
        splits.setdefault(name, []).extend(regions)
    windows, per_split = make_windows(
        store, splits, args.length, stride=args.stride, max_n_frac=args.max_n_frac,
        on_short=args.short,
    )
    if not windows:
        if not any(per_split[s].dropped_n for s in per_split):  # nothing was N: nothing was there
            raise InputError("the regions hold no bases (empty records or regions); choose others",
                             store.path)
        raise InputError("every window was dropped; raise --max-n-frac or choose other regions",
                         store.path)
    out = Path(args.out) if args.out else store.path / f"windows-{args.length}.bed"
    write_bed(out, windows, windows_comment(store.path, args.length, args.stride, args.max_n_frac,
                                            splits))
    summary.print_windows(out, args.length, per_split)


def cmd_export(args: argparse.Namespace) -> None:
    from megabase.data import to_hf_dataset

    started = time.perf_counter()
    ds = to_hf_dataset(args.store, args.windows, split=args.split, cache_dir=args.cache_dir)
    ds.save_to_disk(args.out)
    print(f"exported {len(ds):,} windows to {args.out} ({time.perf_counter() - started:.1f} s); "
          f"load with datasets.load_from_disk({str(args.out)!r})")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _section_flags(p: argparse.ArgumentParser, cls, skip=(), aliases: dict | None = None) -> None:
    """One flag per field of the dataclass ``cls``: ``--probe-windows N``, ``--probe`` /
    ``--no-probe`` for a bool; a list takes ``a,b`` or ``[a, b]`` (or repeats). Help and default
    are the field's; a flag not given leaves the field at its default."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        names = [_flag(f.name), *([aliases[f.name]] if aliases and f.name in aliases else [])]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        text = f"{f.metadata.get('help', '')} (default: {'none' if shown in (None, '') else shown})"
        if isinstance(default, bool):
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=text)
        elif isinstance(default, list):
            p.add_argument(*names, dest=f.name, action="append", default=None, metavar="LIST",
                           help=text)
        else:
            p.add_argument(*names, dest=f.name, default=None, metavar="VALUE", help=text)


def _section(cls, args: argparse.Namespace):
    """The dataclass ``cls`` from the flags :func:`_section_flags` made (given ones only)."""
    from .config import build_section

    given = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if isinstance(value, list):  # repeats of a list flag: their items, in order
            value = value[0] if len(value) == 1 else ",".join(value)
        given[f.name] = value
    return build_section(cls, given, "command line", name_of=_flag)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from .tracking import evaluate_tracked

    report = evaluate_tracked(
        args.checkpoint, args.data, _section(EvalConfig, args), out=args.out, windows=args.windows,
        split=args.split, progress=not args.quiet, mlflow_run=args.mlflow_run,
        experiment=args.experiment, tracking_uri=args.tracking_uri, track=not args.no_mlflow)
    summary.print_report(report)


def cmd_log(args: argparse.Namespace) -> None:
    from megabase.eval.report import check_loggable

    from .tracking import DEFAULT_EXPERIMENT, log_saved_report

    out = Path(args.report)
    path = out / "report.json" if out.is_dir() else out
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("no report.json here (a folder `megabase evaluate` wrote)", out) from None
    except ValueError as exc:
        raise InputError(f"is not a megabase report ({exc})", path) from None
    check_loggable(report, str(path))
    tracking = dict(tracking_uri=args.tracking_uri, run_id=args.mlflow_run,
                    experiment=args.experiment or DEFAULT_EXPERIMENT,
                    run_name=f"evaluate {Path(str(report.get('checkpoint', out))).name}")
    report = log_saved_report(report, path.parent, tracking)
    m = report["mlflow"]
    print(f"logged {path} to MLflow run {m['run_id']} ({m['tracking_uri']})")


def cmd_baseline(args: argparse.Namespace) -> None:
    from megabase.eval.evaluate import copy_baseline, markov_baseline

    given = {k: v for k, v in (("length", args.length), ("n_boot", args.bootstrap),
                               ("seed", args.seed)) if v is not None}  # else the function's defaults
    common = dict(progress=not args.quiet, **given)
    if args.kind == "markov":
        if args.order is None:
            raise InputError("baseline markov needs --order K (0..14)")
        report = markov_baseline(args.data, args.order, _csv(args.train), _csv(args.eval),
                                 args.out, **common)
    else:
        options = _section(EvalConfig, args)
        report = copy_baseline(args.data, _csv(args.train), _csv(args.eval), args.out,
                               spec=options.copy_spec(), controls=list(options.controls), **common)
    if args.experiment:  # the report is on disk first: a failing store costs no scoring
        from .tracking import log_saved_report

        log_saved_report(report, Path(args.out), dict(
            tracking_uri=args.tracking_uri, experiment=args.experiment, run_name=report["name"],
            kind="baseline"))
    summary.print_report(report)


def cmd_compare(args: argparse.Namespace) -> None:
    from megabase.eval.compare import compare

    if args.csv and Path(args.csv).is_dir():
        raise InputError("is a directory; --csv takes a file name", args.csv)
    from .tracking import load_report

    table = compare(args.refs, lambda ref: load_report(ref, args.tracking_uri),
                    with_baselines=args.baselines)
    summary.print_compare(table)
    if args.csv:
        from megabase.core.atomic import write_atomic

        write_atomic(Path(args.csv), table.to_csv().encode())
        print(f"table written to {args.csv}")


def cmd_score(args: argparse.Namespace) -> None:
    from megabase.infer import score

    result = score(args.checkpoint, args.data, _csv(",".join(args.regions)), out=args.out,
                   entropy=args.entropy, context=args.context, segment=args.segment,
                   formats=tuple(_csv(args.format)), progress=not args.quiet,
                   dsa_stage=args.dsa_stage)
    summary.print_score(result)


def cmd_generate(args: argparse.Namespace) -> None:
    from megabase.infer import generate

    result = generate(args.checkpoint, args.length, out=args.out, data=args.data,
                      prompt_region=args.prompt_region, prompt_fasta=args.prompt_fasta,
                      samples=args.samples, temperature=args.temperature, top_k=args.top_k,
                      seed=args.seed, segment=args.segment, progress=not args.quiet,
                      dsa_stage=args.dsa_stage)
    summary.print_generate(result)


def cmd_embed(args: argparse.Namespace) -> None:
    from megabase.infer import embed

    regions = _csv(",".join(args.regions)) if args.regions else None
    result = embed(args.checkpoint, args.data, windows=args.windows, regions=regions,
                   split=args.split, layer=args.layer, per_base=args.per_base, out=args.out,
                   segment=args.segment, progress=not args.quiet, dsa_stage=args.dsa_stage)
    summary.print_embed(result)


def cmd_variants(args: argparse.Namespace) -> None:
    from megabase.infer import score_variants

    result = score_variants(args.checkpoint, args.data, args.vcf, out=args.out, window=args.window,
                            both_strands=args.both_strands, multiallelic=args.multiallelic,
                            progress=not args.quiet, dsa_stage=args.dsa_stage,
                            context=args.context, horizon=args.horizon)
    summary.print_variants(result)


def cmd_export_model(args: argparse.Namespace) -> None:
    from megabase.infer.hf import export_model

    summary.print_export_model(export_model(args.checkpoint, args.out, report=args.report))


def cmd_train(args: argparse.Namespace) -> None:
    from .config import load_config
    from .train import train

    sets = list(args.set or [])
    for key in ("devices", "num_nodes", "context_parallel"):
        if getattr(args, key) is not None:
            sets.append(f"train.{key}={getattr(args, key)}")
    cfg = load_config(args.config, sets)
    result = train(cfg, resume=args.resume, progress=not args.quiet)
    if result.is_global_zero:
        summary.print_train(result)


def cmd_run(args: argparse.Namespace) -> None:
    from .config import load_config
    from .stages import run

    cfg = load_config(args.config, args.set or [])
    summary.print_run(run(cfg, progress=not args.quiet))


def cmd_rl(args: argparse.Namespace) -> None:
    from megabase.rl import load_rl_config, rl

    cfg = load_rl_config(args.config, args.set or [])
    result = rl(cfg, progress=not args.quiet)
    if result is not None:  # None: the generator's rank of a launched job
        summary.print_rl(result)


def _csv(text: str | None) -> list[str]:
    """Comma-separated names; commas inside region coordinates are kept."""
    from megabase.data.windows import split_regions

    return split_regions(text) if text else []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megabase",
        description="Train and evaluate DNA language models on megabase-long windows.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="FASTA -> token store (tokens + repeat mask + manifest)")
    p.add_argument("fasta", nargs="?", help="plain/gzip/bgzip FASTA (default: the bundled genome)")
    p.add_argument("--out", required=True, help="token store directory to write")
    p.add_argument("--chroms", action="append", metavar="NAMES",
                   help="comma-separated records to keep (chr1 and 1 both match); default all")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("windows", help="token store -> BED of train/eval windows")
    p.add_argument("store", help="token store directory (from `megabase prepare`)")
    p.add_argument("--length", type=_positive_int, required=True, help="window length in bases")
    p.add_argument("--split", action="append", required=True, metavar="NAME=REGIONS",
                   help="e.g. train=chr01,chr02 or eval=chr22:1-400,000 (repeatable)")
    p.add_argument("--stride", type=_positive_int, default=None, help="default: --length")
    p.add_argument("--max-n-frac", type=float, default=0.5,
                   help="drop windows with a larger fraction of N (default 0.5)")
    p.add_argument("--short", choices=("keep", "refuse"), default="keep",
                   help="a record shorter than --length: one shorter window, or an error")
    p.add_argument("--out", help="BED file to write (default STORE/windows-LENGTH.bed)")
    p.set_defaults(func=cmd_windows)

    p = sub.add_parser("export", help="windows -> Hugging Face datasets.Dataset on disk")
    p.add_argument("store", help="token store directory")
    p.add_argument("--windows", required=True, help="BED file of windows")
    p.add_argument("--split", help="export only this split")
    p.add_argument("--out", required=True, help="directory for Dataset.save_to_disk")
    p.add_argument("--cache-dir", help="where datasets writes its Arrow cache")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("evaluate", help="checkpoint + held-out windows -> loss by prior context")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--data", required=True, help="token store directory")
    p.add_argument("--windows", help="BED of windows (default: tile --regions)")
    p.add_argument("--split", default="eval", help="split of the BED to score (default eval)")
    _section_flags(p, EvalConfig, skip=("enabled",), aliases={"baselines": "--baseline"})
    p.add_argument("--out", help="report directory (default CHECKPOINT/eval; a run's checkpoint: "
                   "RUN/eval/step-N)")
    _tracking_flags(p)
    p.add_argument("--mlflow-run", metavar="RUN_ID",
                   help="log the report to this MLflow run (default: the checkpoint's own run)")
    p.add_argument("--no-mlflow", action="store_true", help="log nothing to MLflow")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("log", help="a report written earlier -> MLflow (e.g. after the store "
                       "was locked)")
    p.add_argument("report", help="report folder (or its report.json)")
    _tracking_flags(p)
    p.add_argument("--mlflow-run", metavar="RUN_ID", help="log it to this run (default: a new run "
                   "of --experiment)")
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("score", help="checkpoint + regions -> per-base surprisal tracks "
                       "(bedGraph, bigWig)")
    _checkpoint_flag(p)
    p.add_argument("--data", required=True, help="token store directory")
    p.add_argument("--regions", action="append", required=True, metavar="REGIONS",
                   help="e.g. chr22 or chr22:1-1,048,576 (comma-separated, repeatable)")
    p.add_argument("--out", required=True, help="folder for surprisal.bedgraph / surprisal.bw "
                   "(other files in it are left alone)")
    p.add_argument("--entropy", action="store_true",
                   help="also the entropy of each predicted distribution (entropy.*)")
    p.add_argument("--context", type=_whole, default=0,
                   help="bases before each region read as context, not scored (default 0)")
    _segment_flag(p, "bases per streamed piece: bounds the memory")
    p.add_argument("--format", default="bedgraph,bigwig", help="bedgraph, bigwig or both (default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("generate", help="checkpoint + prompt -> sampled continuations (FASTA)")
    _checkpoint_flag(p)
    p.add_argument("--length", type=_positive_int, required=True, help="bases to generate")
    p.add_argument("--out", required=True, help="FASTA file to write")
    p.add_argument("--data", help="token store directory (with --prompt-region)")
    p.add_argument("--prompt-region", help="prompt: a region of the store, e.g. chr22:1-65,536")
    p.add_argument("--prompt-fasta", help="prompt: the first record of this FASTA file")
    p.add_argument("--samples", type=_positive_int, default=1,
                   help="sequences to draw, seeds SEED, SEED+1, ... (default 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1)")
    p.add_argument("--top-k", type=_whole, default=0,
                   help="sample among the k most likely bases only (default 0: all four)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _segment_flag(p, "prompt bases per streamed piece")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("embed", help="checkpoint + windows -> hidden states (datasets.Dataset, .npy)")
    _checkpoint_flag(p)
    p.add_argument("--data", required=True, help="token store directory")
    p.add_argument("--windows", help="BED of windows (4th column: split)")
    p.add_argument("--split", help="embed only this split of the BED")
    p.add_argument("--regions", action="append", metavar="REGIONS",
                   help="instead of a BED: e.g. chr22:1-1,048,576 (comma-separated, repeatable)")
    p.add_argument("--layer", type=_positive_int, help="block whose output to take (default: last)")
    p.add_argument("--per-base", action="store_true", help="one vector per base, not the mean")
    p.add_argument("--out", required=True, help="folder for embeddings.npy and embeddings.dataset")
    _segment_flag(p, "bases per streamed piece: bounds the memory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("export-model", help="checkpoint -> Hugging Face model folder "
                       "(transformers Auto* classes with trust_remote_code, tokenizer, model card)")
    _checkpoint_flag(p)
    p.add_argument("--out", required=True, help="the model folder: absent, empty or an earlier export")
    p.add_argument("--report", help="evaluation report.json the model card quotes (default: the "
                   "run's own report of this checkpoint, if any)")
    p.set_defaults(func=cmd_export_model)

    p = sub.add_parser("variants", help="checkpoint + VCF -> zero-shot variant effects (TSV, VCF)")
    _checkpoint_flag(p)
    p.add_argument("--data", required=True, help="token store directory")
    p.add_argument("--vcf", required=True, help="VCF (plain or bgzip) of SNVs and short indels")
    p.add_argument("--out", required=True, help="folder for variants.tsv and variants.vcf.gz")
    p.add_argument("--window", type=_positive_int, default=65_536,
                   help="bases per window; variants in one window share its reference pass "
                   "(default 65,536)")
    p.add_argument("--context", type=_positive_int,
                   help="give every variant C to 2C bases of prior context instead of tiling "
                   "windows (what context length does to a score)")
    p.add_argument("--horizon", type=_nonnegative_int,
                   help="sum each score over the variant and this many bases after it (default: "
                   "to the window's end; 256 with --context)")
    p.add_argument("--both-strands", action="store_true",
                   help="also score the reverse complement and average the two")
    p.add_argument("--multiallelic", choices=("split", "refuse"), default="split",
                   help="a record with several ALT alleles: score each (default) or stop")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_variants)

    p = sub.add_parser("baseline", help="order-k Markov baseline, or the copy-model reference "
                       "with its controls -> the same report format")
    p.add_argument("kind", choices=["markov", "copy"])
    p.add_argument("--data", required=True, help="token store directory")
    p.add_argument("--order", type=int, help="markov: the Markov order K (0..14)")
    for f in dataclasses.fields(EvalConfig):
        if f.name in ("copy_orders", "copy_seeds", "controls"):
            p.add_argument(_flag(f.name).replace("--copy-", "--"), dest=f.name, action="append",
                           default=None, metavar="LIST",
                           help=f"copy: {f.metadata['help']} (default: "
                           f"{','.join(map(str, f.default_factory()))})")
    p.add_argument("--train", required=True, help="records/regions to fit on, e.g. chr01,chr02")
    p.add_argument("--eval", required=True, help="records/regions to score, e.g. chr22")
    p.add_argument("--length", type=_positive_int, help="window length for binning")
    p.add_argument("--bootstrap", type=_positive_int, help="bootstrap resamples")
    p.add_argument("--seed", type=int, help="bootstrap seed")
    p.add_argument("--out", required=True, help="report directory")
    _tracking_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("train", help="train a model on a token store's windows (MLflow-tracked)")
    _config_flags(p)
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    p.add_argument("--devices", type=_positive_int, help="processes (GPUs, or CPU ranks) per node")
    p.add_argument("--num-nodes", type=_positive_int, help="nodes (with torchrun or SLURM)")
    p.add_argument("--context-parallel", type=_positive_int, metavar="P",
                   help="ranks sharing each sequence (must divide devices * nodes)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("run", help="prepare -> windows -> train -> evaluate in one command "
                       "(no arguments: the CPU demo on the bundled genome)")
    _config_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("rl", help="reinforcement learning from a checkpoint: asynchronous generator "
                       "and trainer, in-flight weight updates, routing replay (MLflow-tracked)")
    p.add_argument("--config", required=True, help="YAML RL config (see configs/rl-*.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, e.g. steps=10 or reward.threshold=0.9")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_rl)

    p = sub.add_parser("compare", help="bits/base per context bin of several reports side by side")
    p.add_argument("refs", nargs="+", metavar="RUN_ID_OR_REPORT",
                   help="report.json, a report directory, or an MLflow run id")
    p.add_argument("--baselines", action="store_true",
                   help="also show each report's controls and baselines")
    p.add_argument("--tracking-uri", help="MLflow store for run ids (default $MLFLOW_TRACKING_URI "
                   "or sqlite:///work/mlflow.db)")
    p.add_argument("--csv", help="also write the table as CSV")
    p.set_defaults(func=cmd_compare)
    return parser


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (see configs/); default: the CPU demo")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, e.g. train.steps=10 or model.preset=debug")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _checkpoint_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a run folder (its latest checkpoint)")
    p.add_argument("--dsa-stage", metavar="STAGE", help="the DSA indexer's candidate stage: "
                   "exact (every earlier key), max or mean; default: the checkpoint's")


def _segment_flag(p: argparse.ArgumentParser, what: str) -> None:
    from megabase.infer.common import DEFAULT_SEGMENT

    p.add_argument("--segment", type=_positive_int, default=DEFAULT_SEGMENT,
                   help=f"{what} (default {DEFAULT_SEGMENT:,})")


def _tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", help="log the report to a new MLflow run of this experiment")
    p.add_argument("--tracking-uri", help="MLflow store, sqlite:///path/mlflow.db or http(s)://... "
                   "(default $MLFLOW_TRACKING_URI or sqlite:///work/mlflow.db)")


def _whole(text: str, least: int = 0) -> int:
    from .config import comma_hint, parse_number

    value = parse_number(text, int)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}{comma_hint(text)}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'positive' if least else 'at least 0'}, "
                                         f"got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole(text, 1)


def _nonnegative_int(text: str) -> int:
    return _whole(text, 0)


def _terminated(signum, frame):
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does: temp folders go, nothing half-kept


# what the library calls an argument (InputError options) is, to a user of a subcommand, its flag
# (`max_n_frac` -> `--max-n-frac`, but for these); to a user of `megabase run` / `train`, a key
# of the run config
FLAGS = {"on_short": "--short keep", "splits": "--split"}
CONFIG_KEYS = {"length": "data.window_length", "stride": "data.stride",
               "max_n_frac": "data.max_n_frac", "out": "data.store",
               "baselines": "eval.baselines", "train": "data.train"}
RL_KEYS = {"regions": "prompt.regions", "dsa_stage": "checkpoint"}


# libgomp's threads (torch's on Linux) spin 300,000 rounds before they sleep; 10,000 costs
# nothing alone and gives most of sleeping's gain beside another job (benchmarks/bench_threads.py)
SPINCOUNT = "10000"


def share_cores() -> None:
    """Let torch's idle OpenMP threads spin only briefly before they sleep, unless the user chose.

    At OpenMP's default a thread with no work spins for a while: alone that costs nothing, but
    beside another job on the same cores the spinners take the cores that job's threads wait for
    (the demo beside other work: 2,183 CPU-seconds for 875 alone). Read when torch loads its
    OpenMP runtime, so it is set before torch is imported.
    """
    if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT


def main(argv: list[str] | None = None) -> int:
    share_cores()
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        args.func(args)
    except InputError as exc:
        if args.command in ("run", "train"):
            line = exc.named(lambda name: CONFIG_KEYS.get(name, name))
        elif args.command == "rl":
            line = exc.named(lambda name: RL_KEYS.get(name, name))
        else:
            line = exc.named(lambda name: FLAGS.get(name) or _flag(name))
        print(f"megabase {args.command}: error: {line}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"megabase {args.command}: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as exc:
        kept = getattr(exc, "kept", None) or "nothing half-written was kept"
        print(f"megabase {args.command}: interrupted; {kept}", file=sys.stderr)
        return 130
    except OSError as exc:  # disk full, read-only folder, name too long, file-size limit...
        print(f"megabase {args.command}: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        from .tracking import TrackingStoreError, is_locked, store_failure

        if isinstance(exc, TrackingStoreError) or is_locked(exc):
            line = str(exc).splitlines()[0]
        elif store_failure(exc):  # raised where no report waits to be logged
            line = f"the MLflow store cannot be written ({store_failure(exc)})"
        else:
            raise
        print(f"megabase {args.command}: error: {line}", file=sys.stderr)
        return 3
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


def os_error_line(exc: OSError) -> str:
    """One line for an OSError: the file (a long name shortened), the system's reason."""
    name = str(exc.filename) if exc.filename is not None else ""
    if len(name) > 120:
        name = f"{name[:60]}...{name[-40:]} ({len(name)} characters)"
    reason = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"{name}: {reason}" if name else reason


if __name__ == "__main__":
    sys.exit(main())
