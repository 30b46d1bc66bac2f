"""The run's folder layout, in one place: where a config's store, windows and runs live under its
``workdir``, and the stages that make the first two. ``megabase run`` (:mod:`.stages`) and
``megabase train`` (:mod:`.train`) both read it."""

from __future__ import annotations

from pathlib import Path

from megabase.data.errors import InputError

from .config import RunConfig


def run_dir(cfg: RunConfig) -> Path:
    """``WORKDIR/runs/NAME``: the run's config, train log, checkpoints and evaluation."""
    return cfg.path("runs") / cfg.name


def windows_path(cfg: RunConfig) -> Path:
    """``WORKDIR/windows-L.bed``: the train and eval windows of length ``L``."""
    return cfg.path(f"windows-{cfg.data.window_length}.bed")


def open_store(cfg: RunConfig):
    """The prepared token store of ``cfg`` (an InputError if there is none)."""
    from megabase.data import TokenStore

    path = cfg.path(cfg.data.store)
    if not path.exists():
        raise InputError("no token store here; run `megabase prepare` (or `megabase run`) first",
                         path)
    return TokenStore(path)


def ensure_store(cfg: RunConfig, progress: bool = True):
    """The token store of ``cfg``: prepared unless an up-to-date one is there. Returns
    ``(TokenStore, PrepareResult)``."""
    from megabase.data import TokenStore, default_genome, prepare

    fasta = Path(cfg.data.fasta) if cfg.data.fasta else Path(str(default_genome()))
    result = prepare(fasta, cfg.path(cfg.data.store), chroms=cfg.data.chroms or None,
                     progress=progress)
    return TokenStore(cfg.path(cfg.data.store)), result


def ensure_windows(cfg: RunConfig, store) -> Path:
    """``WORKDIR/windows-L.bed`` for the config's splits, rewritten only if its parameters changed."""
    from megabase.data import make_windows, windows_comment, write_bed

    d = cfg.data
    path = windows_path(cfg)
    splits = {"train": list(d.train), "eval": list(d.eval)}
    comment = windows_comment(store.path, d.window_length, d.stride, d.max_n_frac, splits)
    if path.is_file() and path.read_text().partition("\n")[0] == f"# {comment}":
        return path
    windows, _ = make_windows(store, splits, d.window_length, stride=d.stride,
                              max_n_frac=d.max_n_frac)
    if not any(w.split == "train" for w in windows):
        raise InputError(f"no training windows of {d.window_length:,} bases in "
                         f"{','.join(d.train)}", store.path)
    return write_bed(path, windows, comment)
