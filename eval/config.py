"""What an evaluation scores and reports: one dataclass, the only home of its defaults.

``megabase evaluate``'s flags are made from its fields (``probe_windows`` -> ``--probe-windows``,
a bool -> ``--probe`` / ``--no-probe``), a run config's ``eval`` section is read into it, and
:func:`megabase.eval.evaluate.evaluate` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megabase.core.errors import InputError


def _help(text: str) -> dict:
    return {"help": text}


def check_controls(controls) -> list[int]:
    """The truncation controls' context limits: positive integers (a limit of 0 leaves no
    context to score with), else an InputError naming ``{controls}``."""
    for c in controls:
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise InputError(f"{{controls}} must be positive context lengths, got {c}",
                             options=("controls",))
    return list(controls)


@dataclass
class EvalConfig:
    """Options of an evaluation (defaults are those of ``megabase run`` and ``megabase evaluate``)."""

    enabled: bool = field(default=True, metadata=_help(
        "megabase run: evaluate after training"))
    regions: list[str] = field(default_factory=list, metadata=_help(
        "records/regions to tile and score; empty: the held-out regions the checkpoint's run "
        "recorded (a run: data.eval)"))
    length: int | None = field(default=None, metadata=_help(
        "window length; empty: the checkpoint's"))
    edges: list[int] | None = field(default=None, metadata=_help(
        "context bin edges, e.g. 0,1000,4000,16000,65536 (stopping short of the window: one more "
        "bin up to its length); empty: powers of 4 up to the window"))
    controls: list[int] = field(default_factory=lambda: [1000], metadata=_help(
        "context limits of the truncation control"))
    probe: bool = field(default=True, metadata=_help("the in-context recall probe"))
    probe_windows: int = field(default=32, metadata=_help("recall-probe windows per distance"))
    probe_pairs: int = field(default=1, metadata=_help(
        "copies per recall-probe window (more: fewer long windows to score for as many copies)"))
    probe_distances: list[int] = field(default_factory=list, metadata=_help(
        "recall-probe distances, e.g. 65536,262144,1000000; empty: 1k, 4k, 16k, ... up to the "
        "window length"))
    baselines: list[int] = field(default_factory=lambda: [0, 4], metadata=_help(
        "Markov orders scored on the same windows (fitted on the training regions)"))
    train: list[str] = field(default_factory=list, metadata=_help(
        "records/regions the Markov baselines are fitted on; empty: the checkpoint's run's "
        "(a run: data.train)"))
    copy: bool = field(default=True, metadata=_help(
        "the copy-model reference (Markov chains mixed with copy models of the window) on the "
        "same windows and under the same context limits as the controls"))
    copy_orders: list[int] = field(default_factory=lambda: [2, 4, 8, 12], metadata=_help(
        "Markov orders the copy-model reference mixes (fitted on the training regions)"))
    copy_seeds: list[int] = field(default_factory=lambda: [12, 16, 20], metadata=_help(
        "seed lengths of its copy models (each forward and reverse complement)"))
    rebalance: list[str] = field(default_factory=list, metadata=_help(
        "records/regions whose bases (never their losses) re-fit every MoE layer's selection "
        "bias before scoring, to measure what held-out routing imbalance costs; must not overlap "
        "the scored regions; empty: the trained biases"))
    rebalance_rounds: int = field(default=3, metadata=_help(
        "passes over the rebalance regions, each followed by one bias update"))
    ablations: list[str] = field(default_factory=list, metadata=_help(
        "score the model again with one kind of layer's far context cut, paired with its own "
        "curve: kda_reset (KDA memory emptied every ablation_limit bases), dsa_near (DSA keys "
        "older than ablation_limit to twice that dropped); see megabase.eval.ablate"))
    ablation_limit: int | None = field(default=None, metadata=_help(
        "the ablations' limit in bases, a multiple of 1024; empty: the first control's"))
    bootstrap: int = field(default=1000, metadata=_help("bootstrap resamples of every CI"))
    ci_block: int | None = field(default=None, metadata=_help(
        "CIs resample stretches of this many bases of each window instead of whole windows "
        "(for a few long windows, e.g. 65536 for ten of a megabase: each bin then resamples the "
        "stretches that scored a base in it); empty: whole windows"))
    dsa_stage: str | None = field(default=None, metadata=_help(
        "the DSA indexer's candidate stage to score with: exact (every earlier key), max or "
        "mean; empty: the checkpoint's"))
    segment: int = field(default=16384, metadata=_help(
        "windows longer than this many bases are streamed in pieces of it"))
    seed: int = field(default=0, metadata=_help("seed of the bootstrap and the probe"))


    def check(self) -> EvalConfig:
        """Values that parse but cannot work, refused before any scoring. Errors name the
        option as ``{name}``: the CLI shows its flag, a run its config key."""
        from .bins import check_edges
        from .markov import MAX_ORDER

        if self.edges:
            try:
                check_edges(self.edges)
            except (TypeError, ValueError):
                raise InputError(f"{{edges}} must be integers that start at 0 and increase "
                                 f"strictly, got {list(self.edges)[:12]}", options=("edges",)) from None
        check_controls(self.controls)
        for k in self.baselines:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_ORDER:
                raise InputError(f"{{baselines}} must be Markov orders 0..{MAX_ORDER}, got {k}",
                                 options=("baselines",))
        if self.copy:
            self.copy_spec()
        from megabase.model.config import STAGES

        if self.dsa_stage is not None and self.dsa_stage not in STAGES:
            raise InputError(f"{{dsa_stage}} must be one of {', '.join(STAGES)}, got "
                             f"{self.dsa_stage!r}", options=("dsa_stage",))
        for d in self.probe_distances:
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise InputError(f"{{probe_distances}} must be positive distances, got {d}",
                                 options=("probe_distances",))
        if self.ablations:
            from .ablate import check_ablation

            for name in self.ablations:
                try:
                    check_ablation(name)
                except ValueError as err:
                    raise InputError(f"{{ablations}}: {err}", options=("ablations",)) from None
            limit = self.limit_of_ablations()
            try:
                if limit is None:
                    raise ValueError("no control to take it from: set it")
                check_ablation(self.ablations[0], limit)
            except ValueError as err:
                raise InputError(f"{{ablation_limit}}: {err}", options=("ablation_limit",)) from None
        for name in ("probe_windows", "probe_pairs", "bootstrap", "segment", "length",
                     "rebalance_rounds", "ci_block", "ablation_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise InputError(f"{{{name}}} must be a positive integer, got {value}",
                                 options=(name,))
        return self

    def limit_of_ablations(self) -> int | None:
        """``ablation_limit``, or the first control's limit."""
        return self.ablation_limit or (self.controls[0] if self.controls else None)

    def copy_spec(self):
        """The copy-model reference's :class:`~megabase.eval.copymodel.CopySpec`."""
        from .copymodel import CopySpec

        for name in ("copy_orders", "copy_seeds"):
            if any(not isinstance(v, int) or isinstance(v, bool) for v in getattr(self, name)):
                raise InputError(f"{{{name}}} must be integers, got {getattr(self, name)}",
                                 options=(name,))
        try:
            return CopySpec(orders=tuple(self.copy_orders), seeds=tuple(self.copy_seeds)).check()
        except ValueError as err:
            name = "copy_orders" if "order" in str(err) else "copy_seeds"
            raise InputError(f"{{{name}}}: {err}", options=(name,)) from None
