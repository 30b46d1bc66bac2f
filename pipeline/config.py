"""Run configuration: small dataclasses read from YAML, with ``--set section.key=value`` overrides.

Every key is checked: an unknown key, a value of the wrong type, or a value outside its choices is
one :class:`InputError` naming the file, the key and what is valid. The resolved config (defaults
filled in, overrides applied) is what a run saves and logs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from megabase.core.errors import InputError
from megabase.eval.config import EvalConfig

PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "layer", "selective")


@dataclass
class DataConfig:
    """Genome, store and windows. Paths are relative to the run's ``workdir`` unless absolute."""

    fasta: str | None = None  # None: the bundled genome (chr01, chr02, chr22 of U. maydis)
    chroms: list[str] = field(default_factory=list)  # records kept by prepare; empty: all
    store: str = "store"
    train: list[str] = field(default_factory=lambda: ["chr01", "chr02"])
    eval: list[str] = field(default_factory=lambda: ["chr22"])
    window_length: int = 16384
    stride: int | None = None
    max_n_frac: float = 0.5
    rc_prob: float = 0.5
    # synthetic repeats (megabase.data.augment): a training curriculum, never applied to evaluation;
    # the defaults are the demo's, which without them does not learn to copy (docs/science.md 11)
    repeat_frac: float = 0.05  # fraction of each training window's bases overwritten by copies
    repeat_frac_first: float | None = 0.5  # the fraction in the first repeat_first_steps steps
    repeat_first_steps: int = 120
    repeat_length: list[int] = field(default_factory=lambda: [20, 1000])  # copy length min, max
    repeat_divergence: float = 0.0  # most a copy's substitution rate can be


@dataclass
class ModelSection:
    """A preset of :mod:`megabase.model.presets` and field overrides of its ``ModelConfig``."""

    preset: str = "cpu-small"
    overrides: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    """Optimisation, schedule and memory knobs. ``steps`` count optimizer steps."""

    steps: int = 128
    # wall-clock cap on this invocation's training (Lightning's max_time): it stops at the first
    # step past it and saves a checkpoint there; the LR schedule still assumes ``steps``
    max_minutes: float | None = None
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "fp32"
    seed: int = 0
    seq_warmup: bool = True  # short windows first, doubling up to data.window_length
    seq_warmup_start: int = 2048
    seq_warmup_steps: int = 40  # optimizer steps per length, fewer where the run needs (.warmup)
    indexer_warmup_steps: int = 0  # first steps with dense DSA attention, the indexer fitted to it
    # fine-tuning: start from this checkpoint's weights and model (model.overrides may then set
    # only the kernels and the DSA candidate stage); a fresh optimizer and schedule
    init_from: str | None = None
    recompute: str = "none"
    # windows longer than segment_from tokens are trained in segments of segment tokens, with the
    # gradients of the whole window and one segment's activations alive (megabase.model.walk);
    # segment null: every window at once (the reference)
    segment: int | None = 4096
    segment_from: int = 32768
    offload: bool = False
    trim_heap: bool = False  # CPU: return freed heap to the OS between blocks (lower peak RSS)
    checkpoint_every: int = 64
    num_workers: int = 0
    # scale-out (megabase train --devices/--num-nodes/--context-parallel): world = devices * num_nodes
    # ranks, in groups of context_parallel sharing each sequence; batch_size is the global batch
    devices: int = 1
    num_nodes: int = 1
    context_parallel: int = 1

    def walks(self, length: int) -> bool:
        """Whether a window of ``length`` tokens is walked in segments (past ``segment_from``, and
        longer than one segment); the trainer runs whole what :func:`megabase.model.walk.unwalkable`
        refuses."""
        return self.segment is not None and length > max(self.segment, self.segment_from)


@dataclass
class TrackingConfig:
    tracking_uri: str | None = None  # None: sqlite:///<workdir>/mlflow.db
    experiment: str = "megabase"
    run_name: str | None = None  # None: the config's name


@dataclass
class RunConfig:
    name: str = "demo"
    workdir: str = "work"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def root(self) -> Path:
        return Path(self.workdir).resolve()

    def path(self, rel: str) -> Path:
        """``rel`` under the workdir (absolute paths stay as they are)."""
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def tracking_uri(self) -> str:
        return self.tracking.tracking_uri or f"sqlite:///{self.root / 'mlflow.db'}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {("train", "precision"): PRECISIONS, ("train", "recompute"): RECOMPUTE}
MIN_SEGMENT = 1024  # a walked segment: long enough that its fixed costs do not dominate
POSITIVE = {("data", "window_length"), ("train", "steps"), ("train", "batch_size"),
            ("train", "grad_accum"), ("train", "checkpoint_every"), ("train", "seq_warmup_start"),
            ("train", "seq_warmup_steps"), ("train", "devices"), ("train", "num_nodes"),
            ("train", "context_parallel")}


def _convert(value, hint, where: str, source: str):
    """``value`` as type ``hint`` (YAML scalars and ``--set`` strings alike), or an InputError."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        return _convert(value, args[0], where, source)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):  # "chr01,chr02:1-200,000": commas inside coordinates stay
            from megabase.data.windows import split_regions

            value = split_regions(value)
        if not isinstance(value, list):
            raise InputError(f"{where} must be a list, got {value!r}", source)
        return [_convert(v, item, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if hint is dict:
        if not isinstance(value, dict):
            raise InputError(f"{where} must be a mapping, got {value!r}", source)
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise InputError(f"{where} must be true or false, got {value!r}", source)
    if hint in (int, float):
        if isinstance(value, bool):
            raise InputError(f"{where} must be a number, got {value!r}", source)
        number = parse_number(value, hint)
        if number is None:
            raise InputError(f"{where} must be {'an integer' if hint is int else 'a number'}, "
                             f"got {_short(value)}{comma_hint(value)}", source)
        if not math.isfinite(number):
            raise InputError(f"{where} must be a finite number, got {value!r}", source)
        return number
    if hint is str:
        if isinstance(value, (dict, list)):
            raise InputError(f"{where} must be a string, got {value!r}", source)
        return str(value)
    raise TypeError(hint)


# a comma in a number is a thousands separator only where every group after it has three digits:
# ``65,536`` is 65536, but ``0,7`` (a decimal comma), ``1,5`` and ``4096,8192`` (two numbers) are
# refused; dropping the comma would read them as 7, 15 and 40968192
_GROUPED = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+")


def parse_number(value, kind: type = int):
    """``value`` (a YAML scalar or a command-line string) as ``kind`` (int or float), or None.
    Underscores group digits as in Python (``1_048_576``); a comma only as a thousands separator
    of a whole number (``1,048,576``), never in a fraction, where it may be a decimal comma."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, float) and kind is float):
        return kind(value)
    text = str(value).strip()
    if "," in text:
        if kind is not int or not _GROUPED.fullmatch(text):  # 1,500 minutes or 1.5?
            return None
        text = text.replace(",", "")
    try:
        return kind(text.replace("_", "")) if "__" not in text else None
    except ValueError:
        return None


def comma_hint(value) -> str:
    """Why a number with a comma was refused (empty when it has none)."""
    if "," not in str(value):
        return ""
    return (" (a comma may only separate the thousands of a whole number, as in 65,536; write "
            "a decimal point for a fraction, and one number)")


def build_section(cls, data: dict, source: str, name_of=str):
    """``cls`` (a section's dataclass) from ``{field: value}`` (strings from a command line or
    YAML values), converted and checked as a config file's section is; ``name_of(field)`` is how an
    error names a field (e.g. as a CLI flag)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        if name not in known:
            raise InputError(f"unknown option {name_of(name)!r}", source)
        kwargs[name] = _convert(parse_value(value, name_of(name)), hints[name], name_of(name), source)
    return cls(**kwargs)


def parse_value(text, source: str):
    """A ``--set`` or flag value: YAML flow syntax for lists and mappings (``[0, 4, 7]``,
    ``{topk: 64}``), anything else as the string it is (``0,4,7`` is split later, by its type).
    ``source`` names the value in a YAML error."""
    if isinstance(text, str) and text.strip()[:1] in ("[", "{"):
        return _yaml(text, source)
    return text


def _build(cls, data: dict, prefix: str, source: str):
    if not isinstance(data, dict):
        raise InputError(f"{prefix or 'the config'} must be a mapping, got {data!r}", source)
    hints = typing.get_type_hints(cls)
    known = known_keys(cls)
    for key in data:
        if key not in known:
            where = f"{prefix}.{key}" if prefix else key
            raise InputError(f"unknown key {where!r}; valid keys{' in ' + prefix if prefix else ''}:"
                             f" {', '.join(known)}", source)
    kwargs = {}
    for name in known:
        if name not in data:
            continue
        where = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if data[name] is not None and not isinstance(data[name], dict):
                # ``--set data=`` would otherwise read as an empty section: every key's default
                raise InputError(f"{where} is a section, not a value (got {_short(data[name])}); "
                                 f"set its keys, e.g. {where}.{next(iter(known_keys(hint)))}=...",
                                 source)
            kwargs[name] = _build(hint, data[name] or {}, where, source)
            continue
        value = _convert(data[name], hint, where, source)
        choices = CHOICES.get((prefix, name))
        if choices and value not in choices:
            raise InputError(f"{where} = {value!r} is not one of {', '.join(choices)}", source)
        if (prefix, name) in POSITIVE and value < 1:
            raise InputError(f"{where} must be at least 1, got {value}", source)
        if (prefix, name) == ("train", "max_minutes") and value is not None and not value > 0:
            raise InputError(f"{where} must be a positive number of minutes, got {value}", source)
        kwargs[name] = value
    return cls(**kwargs)


def known_keys(cls) -> list[str]:
    """The keys a config section ``cls`` takes, in order."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _set(tree: dict, assignment: str) -> None:
    """Apply one ``section.key=value`` (the value stays a string; ``_build`` converts it)."""
    if "=" not in assignment:
        raise InputError(f"--set {assignment!r}: expected section.key=value")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InputError(f"--set {assignment!r}: {part!r} is not a section")
        node = child
    source = f"--set {key.strip()}"
    if "overrides" in parts[1:]:
        value = _yaml(value, source)  # model fields: YAML scalars too (ints, floats, bools)
    else:
        value = parse_value(value, source)
    node[parts[-1]] = value


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error line quotes a value, never a whole one."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(text):,} chars)"


# YAML 1.2's floats: PyYAML follows YAML 1.1, which reads ``1e-3`` (no dot) as a string
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
                        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)


def _yaml(text: str, source: str):
    """YAML without aliases: ``*name`` would let a few hundred bytes expand to gigabytes (a
    "billion laughs"), and no megabase config needs one. ``1e-3`` is a float, as in YAML 1.2."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise InputError(f"YAML alias at line {mark.line + 1} (aliases are not allowed in "
                                 "a megabase config: write the value out)", source)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            # PyYAML keeps the last of two equal keys: a second ``train:`` section would replace
            # the first whole, without a word
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise InputError(f"key {key!r} appears twice in one mapping (lines "
                                     f"{seen[key] + 1} and {key_node.start_mark.line + 1}): "
                                     "merge them into one", source)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    NoAliases.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=NoAliases)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise InputError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}",
                         source) from None


def build_tree(cls, path: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()):
    """A config dataclass ``cls`` from its defaults, the YAML file ``path`` (if any) and each
    ``--set section.key=value`` in order, every key and value checked (not yet cross-checked)."""
    tree: dict = {}
    source = "--set"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise InputError("config file not found", path)
        tree = _yaml(path.read_text(), str(path)) or {}
    for assignment in sets:
        _set(tree, assignment)
    return _build(cls, tree, "", source)


def load_config(path: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML file ``path`` (if any), then each ``--set`` in order; validated."""
    source = "--set" if path is None else str(path)
    cfg = build_tree(RunConfig, path, sets)
    from megabase.model import get_preset

    get_preset(cfg.model.preset, **cfg.model.overrides)  # unknown preset / model key: clear error
    try:
        cfg.eval.check()
    except InputError as exc:  # its options are this section's keys
        raise InputError(exc.named(lambda name: f"eval.{name}"), source) from None
    _check_parallel(cfg, source)
    _check_curriculum(cfg, source)
    _check_init(cfg, source)
    _check_bounds(cfg, source)
    return cfg


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MIN_WINDOW, MAX_WINDOW = 64, 1 << 24  # a window of a few k-mers; 16M tokens, past any GPU's memory
MAX_TOKENS_PER_STEP = 1 << 26  # batch_size * window_length: 64M tokens
MAX_STEPS = 10**9


def _check_bounds(cfg: RunConfig, source: str) -> None:
    """Values that parse but cannot work: refused now, in a line, not after gigabytes."""
    t, d = cfg.train, cfg.data
    if not NAME.fullmatch(cfg.name) or cfg.name in (".", ".."):
        raise InputError(f"name {_short(cfg.name)} must be a plain name (letters, digits, '.', '_', "
                         "'-'; at most 100; no '/'): it names the folder WORKDIR/runs/NAME", source)
    if not MIN_WINDOW <= d.window_length <= MAX_WINDOW:
        raise InputError(f"data.window_length must be within {MIN_WINDOW:,}-{MAX_WINDOW:,} bases, "
                         f"got {d.window_length:,}", source)
    if d.stride is not None and d.stride < 1:
        raise InputError(f"data.stride must be at least 1, got {d.stride}", source)
    if t.batch_size * d.window_length > MAX_TOKENS_PER_STEP:
        raise InputError(f"train.batch_size * data.window_length = {t.batch_size * d.window_length:,} "
                         f"tokens a step is over {MAX_TOKENS_PER_STEP:,}; use train.grad_accum for "
                         "larger batches", source)
    if t.steps > MAX_STEPS:
        raise InputError(f"train.steps must be at most {MAX_STEPS:,}, got {t.steps:,}", source)
    for name, lo, hi, closed in (("lr", 0.0, 1.0, False), ("beta1", 0.0, 1.0, False),
                                 ("beta2", 0.0, 1.0, False), ("min_lr_ratio", 0.0, 1.0, True),
                                 ("weight_decay", 0.0, 10.0, True), ("grad_clip", 0.0, 1e6, True)):
        value = getattr(t, name)
        low_ok = value > lo if name == "lr" else value >= lo
        if not (low_ok and (value <= hi if closed else value < hi)):
            interval = f"{'(' if name == 'lr' else '['}{lo:g}, {hi:g}{']' if closed else ')'}"
            raise InputError(f"train.{name} must be within {interval}, got {value}", source)
    if t.warmup_steps < 0:
        raise InputError(f"train.warmup_steps must be >= 0, got {t.warmup_steps}", source)
    if t.segment is not None and t.segment < MIN_SEGMENT:
        raise InputError(f"train.segment must be at least {MIN_SEGMENT:,} tokens (or null: the "
                         f"whole window at once), got {t.segment:,}", source)
    if t.segment_from < 0:
        raise InputError(f"train.segment_from must be >= 0 tokens, got {t.segment_from:,}", source)
    for name in ("max_n_frac", "rc_prob"):
        if not 0.0 <= getattr(d, name) <= 1.0:
            raise InputError(f"data.{name} must be within [0, 1], got {getattr(d, name)}", source)


def _check_curriculum(cfg: RunConfig, source: str) -> None:
    d, t = cfg.data, cfg.train
    for name in ("repeat_frac", "repeat_frac_first"):
        value = getattr(d, name)
        if value is not None and not 0.0 <= value < 1.0:
            raise InputError(f"data.{name} must be within [0, 1), got {value}", source)
    if d.repeat_first_steps < 0:
        raise InputError(f"data.repeat_first_steps must be >= 0, got {d.repeat_first_steps}", source)
    if len(d.repeat_length) != 2 or not 1 <= d.repeat_length[0] <= d.repeat_length[1]:
        raise InputError(f"data.repeat_length must be [min, max] with 1 <= min <= max, got "
                         f"{d.repeat_length}", source)
    if not 0.0 <= d.repeat_divergence <= 1.0:
        raise InputError(f"data.repeat_divergence must be within [0, 1], got "
                         f"{d.repeat_divergence}", source)
    if t.indexer_warmup_steps < 0:
        raise InputError(f"train.indexer_warmup_steps must be >= 0, got {t.indexer_warmup_steps}",
                         source)
    if t.indexer_warmup_steps and t.context_parallel > 1:
        raise InputError("train.indexer_warmup_steps needs whole sequences (dense attention); "
                         "it cannot run with train.context_parallel > 1", source)


def _check_init(cfg: RunConfig, source: str) -> None:
    """The overrides leave ``train.init_from``'s parameters as they are. Whether it is a checkpoint
    is asked when training starts (:func:`check_init_from`): a config may name one that a run
    before it will make."""
    from megabase.model.config import NEUTRAL_FIELDS, RUNTIME_FIELDS, STAGE_FIELDS

    if cfg.train.init_from is None:
        return
    if not str(cfg.train.init_from).strip():
        raise InputError("train.init_from must name a checkpoint or a run folder", source)
    changed = sorted(set(cfg.model.overrides) - set(RUNTIME_FIELDS) - set(STAGE_FIELDS)
                     - set(NEUTRAL_FIELDS))
    if changed:
        raise InputError(f"model.overrides.{changed[0]} would change the model that "
                         "train.init_from holds; with init_from only kernels, chunk sizes, the "
                         "DSA candidate stage (dsa_stage) and options that start as the identity "
                         f"({', '.join(NEUTRAL_FIELDS)}) may be set", source)


def check_init_from(cfg: RunConfig) -> None:
    """Before a stage writes anything: ``train.init_from`` is a checkpoint (one line if not)."""
    from megabase.model import read_checkpoint_config

    from megabase.model.checkpoint import resolve_checkpoint

    if cfg.train.init_from is not None:
        read_checkpoint_config(resolve_checkpoint(cfg.train.init_from))


def _check_parallel(cfg: RunConfig, source: str) -> None:
    t = cfg.train
    world, cp = t.devices * t.num_nodes, t.context_parallel
    if world % cp:
        raise InputError(f"train.context_parallel = {cp} does not divide the {world} ranks "
                         f"(train.devices * train.num_nodes)", source)
    if t.batch_size % (world // cp):
        raise InputError(f"train.batch_size = {t.batch_size} (the global batch) does not split over "
                         f"{world // cp} data-parallel replicas", source)
    lengths = [cfg.data.window_length] + ([t.seq_warmup_start] if t.seq_warmup else [])
    for length in lengths:
        if length % cp:
            raise InputError(f"window length {length} does not split into {cp} equal "
                             "context-parallel shards", source)


def repeat_frac_at(step: int, data: DataConfig) -> float:
    """The synthetic-repeat fraction at optimizer step ``step`` (0-based)."""
    if data.repeat_frac_first is not None and step < data.repeat_first_steps:
        return data.repeat_frac_first
    return data.repeat_frac


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what a run saves beside its checkpoints)."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# What a resumed run may set otherwise than it was started with: where its workdir now is
# (moved to other storage), how long it runs, on how many ranks (batch_size is the global batch:
# the same data at any world size), with which memory knobs, how it is evaluated and tracked.
# Anything else changes the model or the data it is fed.
RESUMABLE = {"workdir", "train.steps", "train.max_minutes", "train.checkpoint_every",
             "train.num_workers", "train.recompute", "train.segment", "train.segment_from",
             "train.offload",
             "train.trim_heap",
             "train.devices", "train.num_nodes", "train.context_parallel", "tracking.experiment",
             "tracking.run_name"}


def resume_differences(saved: dict, cfg: RunConfig) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: ``key: old -> new`` lines where ``cfg`` differs from a run's saved
    ``config.yaml`` (``saved``, as loaded). Keys a run saved before they existed are not compared;
    ``eval.*`` and :data:`RESUMABLE` may change, and so may kernel choices in model.overrides."""
    from megabase.model.config import RUNTIME_FIELDS

    refused, allowed = [], []

    def walk(prefix: str, old, new) -> None:
        if prefix == "model.overrides":
            old, new = dict(old or {}), dict(new or {})
            for key in RUNTIME_FIELDS:
                old.pop(key, None), new.pop(key, None)
            if old != new:
                refused.append(f"{prefix}: {old} -> {new}")
            return
        if isinstance(old, dict) and isinstance(new, dict):
            for key in old:
                if key in new:
                    walk(f"{prefix}.{key}" if prefix else key, old[key], new[key])
            return
        if old != new:
            line = f"{prefix}: {old!r} -> {new!r}"
            (allowed if prefix in RESUMABLE or prefix.startswith("eval.") else refused).append(line)

    walk("", saved, cfg.to_dict())
    return refused, allowed


def model_config(cfg: RunConfig):
    """The run's ModelConfig: its preset and overrides, or with ``train.init_from`` the model that
    checkpoint holds (and the overrides, which may only choose kernels and the DSA stage)."""
    from megabase.model import ModelConfig, get_preset, read_checkpoint_config
    from megabase.model.config import RUNTIME_FIELDS

    from megabase.model.checkpoint import resolve_checkpoint

    if cfg.train.init_from is None:
        return get_preset(cfg.model.preset, **cfg.model.overrides)
    saved = read_checkpoint_config(resolve_checkpoint(cfg.train.init_from))["model"]
    fields = {k: v for k, v in saved.items() if k not in RUNTIME_FIELDS}
    return ModelConfig.from_dict(fields, cfg.model.overrides)


def flat_params(cfg: RunConfig) -> dict[str, str]:
    """``section.key -> value`` strings for MLflow params (the model as the run builds it)."""
    out: dict[str, str] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(node)[:500]

    walk("", cfg.to_dict())
    walk("model.config", model_config(cfg).to_dict())  # the stage as model.config.dsa_stage.start, ...
    return out
