"""``megabase rl``'s configuration: small dataclasses read from YAML with ``--set`` overrides,
checked key by key as a run config is (:mod:`megabase.pipeline.config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megabase.core.errors import InputError

# BsaI and BsmBI, the Golden Gate type IIS enzymes: a design must not carry their sites
GOLDEN_GATE_SITES = ["GGTCTC", "CGTCTC"]


@dataclass
class PromptConfig:
    """Where prompts come from: windows of a token store's regions, or the records of a FASTA."""

    data: str | None = None  # a token store (megabase prepare); paths are relative to the cwd
    regions: list[str] = field(default_factory=list)  # store regions prompts are drawn from
    fasta: str | None = None  # or: every record of this FASTA is a prompt (cut to length)
    length: int = 256  # bases of a prompt (131,072 tried; each read once per group)
    max_n_frac: float = 0.0  # most of a prompt that may be N (drawn again otherwise)


@dataclass
class RewardConfig:
    """Motif hits minus synthesis-constraint violations (:mod:`megabase.rl.reward`)."""

    motifs: list[str] = field(default_factory=lambda: ["MA0139.2"])  # JASPAR matrix ids (CTCF)
    release: str = "JASPAR2026"  # the JASPAR release the matrices are read from (pyjaspar)
    threshold: float = 0.8  # a hit: relative PWM score (0 = worst, 1 = best word) at least this
    gc_window: int = 50
    gc_min: float = 0.3
    gc_max: float = 0.7
    max_homopolymer: int = 6  # longest run of one base allowed
    sites: list[str] = field(default_factory=lambda: list(GOLDEN_GATE_SITES))  # forbidden, both strands
    repeat_k: int = 12  # no word of this many bases twice (direct or inverted repeat); 0: off
    neighbourhood_k: int = 0  # no word of this many bases shared with the prompt, either strand; 0: off
    penalty: float = 1.0  # reward lost per violation (GC window out of band, long run, site, repeat)
    function: str | None = None  # instead: "module:function" or "file.py:function", sequences -> rewards
    # the held-out check the policy is not trained on: other matrices and a stricter threshold
    heldout_motifs: list[str] = field(default_factory=lambda: ["MA0139.1"])  # CTCF, older matrix
    heldout_threshold: float = 0.85


@dataclass
class RLConfig:
    """One RL job: the starting checkpoint, sampling, the loss, asynchrony, tracking."""

    name: str = "rl"
    checkpoint: str | None = None  # a checkpoint or a run folder of `megabase run`
    out: str = "work-rl"  # this job's folder
    prompt: PromptConfig = field(default_factory=PromptConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    steps: int = 100  # trainer steps
    max_minutes: float | None = None  # wall-clock cap on the whole job
    prompts_per_step: int = 2
    group_size: int = 8  # samples per prompt; advantages are reward - group mean
    sample_length: int = 200  # bases generated per sample
    temperature: float = 1.0  # within [0.01, 100]
    lr: float = 1e-4  # within (0, 1), as train.lr
    grad_clip: float = 1.0
    mask_ratio: float = 0.2  # tokens whose trainer / generator probability ratio leaves 1 +- this
    log_ratio_weight: float = 1e-3  # the small log^2(ratio) penalty (prime-rl's "kl")
    beta: float = 0.0  # KL to the starting model (k3 estimator), keeps designs DNA-like
    asynchronous: bool = True  # generator and trainer in two processes, the trainer a step behind
    async_level: int = 1  # versions a batch's starting weights may be behind the trainer's when it gets it
    max_off_policy_steps: int = 8  # groups with a base from an older policy than this are dropped
    # on new weights mid-sample: recompute the cache (each prompt read again once, then each
    # sample's bases so far), else keep it
    recompute_state: bool = False
    routing_replay: bool = True  # the trainer uses the generator's experts (R3)
    generator_dtype: str = "fp32"  # fp32 or bf16: the generator's numbers, as in practice, differ
    threads: int | None = None  # torch threads per process; None: the cores split between them
    target_reward: float | None = None  # report the wall time to a 5-step mean reward this high
    # the trainer reads a longer prompt in segments of this many bases: exact gradients, one
    # segment's activations alive at a time (a 131,072-base prompt whole needs ~45 GB)
    walk_segment: int = 16_384
    measure_both: bool = True  # each step also scores the batch with replay switched the other way
    seed: int = 0
    tracking_uri: str | None = None  # None: sqlite:///<out>/mlflow.db
    experiment: str = "megabase-rl"
    base: Path = field(default=Path("."), metadata={"internal": True})

    def path(self, rel: str | None) -> Path | None:
        """``rel`` against the folder the job started in (absolute paths stay), as a run
        config's paths are."""
        if rel is None:
            return None
        p = Path(rel)
        return p if p.is_absolute() else (self.base / p).resolve()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("base")
        return d


DTYPES = ("fp32", "bf16")
TEMPERATURE = (1e-2, 1e2)  # sampling temperatures accepted: near-greedy to near-uniform
MIN_SEGMENT = 64  # a walked segment must hold every layer's border rows (conv, k-mer)
POSITIVE = ("steps", "prompts_per_step", "group_size", "sample_length", "max_off_policy_steps")


def load_rl_config(path: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()) -> RLConfig:
    """Defaults, then the YAML file ``path``, then each ``--set``; every key and value checked."""
    from megabase.pipeline.config import build_tree

    cfg = build_tree(RLConfig, path, sets)
    cfg.base = Path.cwd()
    check(cfg, str(path) if path is not None else "--set")
    return cfg


def check(cfg: RLConfig, source: str) -> None:
    def bad(key: str, why: str):
        raise InputError(f"{key} {why}", source)

    for key in POSITIVE:
        if getattr(cfg, key) < 1:
            bad(key, f"must be at least 1, got {getattr(cfg, key)}")
    if cfg.group_size < 2:
        bad("group_size", f"must be at least 2 (advantages are against the group mean), got {cfg.group_size}")
    if cfg.async_level < 0:
        bad("async_level", f"must be 0 or more, got {cfg.async_level}")
    if not cfg.asynchronous and cfg.async_level:
        cfg.async_level = 0
    # lr as train.lr: 1e30 passed a "positive" check and turned 99% of the policy to NaN
    if not 0 < cfg.lr < 1:
        bad("lr", f"must be within (0, 1), got {cfg.lr}")
    # logits / temperature must stay finite in fp32: 1e-300 made the sampling probabilities NaN
    if not TEMPERATURE[0] <= cfg.temperature <= TEMPERATURE[1]:
        bad("temperature", f"must be within [{TEMPERATURE[0]:g}, {TEMPERATURE[1]:g}], got "
                           f"{cfg.temperature}")
    if not cfg.grad_clip > 0:
        bad("grad_clip", f"must be positive, got {cfg.grad_clip}")
    for key in ("beta", "log_ratio_weight"):
        if getattr(cfg, key) < 0:
            bad(key, f"must be 0 or more, got {getattr(cfg, key)}")
    if not 0 < cfg.mask_ratio:
        bad("mask_ratio", f"must be positive, got {cfg.mask_ratio}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        bad("max_minutes", f"must be a positive number of minutes, got {cfg.max_minutes}")
    if cfg.generator_dtype not in DTYPES:
        bad("generator_dtype", f"= {cfg.generator_dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.walk_segment < MIN_SEGMENT:
        bad("walk_segment", f"must be at least {MIN_SEGMENT} bases, got {cfg.walk_segment}")
    if cfg.threads is not None and cfg.threads < 1:
        bad("threads", f"must be at least 1, got {cfg.threads}")
    if cfg.checkpoint is None:
        bad("checkpoint", "is required: a checkpoint or run folder of `megabase run`")
    p, r = cfg.prompt, cfg.reward
    if (p.data is None) == (p.fasta is None):
        bad("prompt", "needs one source: prompt.data (a token store, with prompt.regions) or prompt.fasta")
    if p.data is not None and not p.regions:
        bad("prompt.regions", "must name at least one region of prompt.data, e.g. chr22:1-40,000,000")
    if p.length < 1:
        bad("prompt.length", f"must be at least 1, got {p.length}")
    if not 0 <= p.max_n_frac < 1:
        bad("prompt.max_n_frac", f"must be in [0, 1), got {p.max_n_frac}")
    if not 0 <= r.threshold <= 1 or not 0 <= r.heldout_threshold <= 1:
        bad("reward.threshold", "and reward.heldout_threshold must be in [0, 1]")
    if not 0 <= r.gc_min <= r.gc_max <= 1:
        bad("reward.gc_min", f"must be <= reward.gc_max, both in [0, 1] (got {r.gc_min}, {r.gc_max})")
    if r.penalty < 0:
        bad("reward.penalty", f"must be 0 or more (reward lost per violation), got {r.penalty}")
    for key in ("repeat_k", "neighbourhood_k"):
        if not 0 <= getattr(r, key) <= 31:  # a word's code is an int64
            bad(f"reward.{key}", f"must be 0 (off) to 31 bases, got {getattr(r, key)}")
    if r.gc_window < 1 or r.max_homopolymer < 1:
        bad("reward.gc_window", "and reward.max_homopolymer must be at least 1")
    for site in r.sites:
        if not site or set(site.upper()) - set("ACGT"):
            bad("reward.sites", f"holds {site!r}, not a word of A/C/G/T")
    if r.function is None and not r.motifs:
        bad("reward.motifs", "is empty and no reward.function is given: nothing to reward")
