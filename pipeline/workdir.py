"""The run's folder layout, in one place: where a config's store, windows and runs live under its
``workdir``, and the stages that make the first two. ``megabase run`` (:mod:`.stages`) and
``megabase train`` (:mod:`.train`) both read it."""

from __future__ import annotations

from pathlib import Path

from megabase.core.errors import InputError

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


def relocate_artifacts(root: Path) -> int:
    """Point a moved workdir's MLflow store at its own ``mlartifacts``; returns the rows changed.

    MLflow stores absolute artifact locations, so a workdir moved to other storage would log a
    resumed run's artifacts to the old folder, re-created. A location is rewritten only where it
    ends in ``/mlartifacts`` (megabase's layout, beside the database) and that old folder is gone:
    a store other runs still share elsewhere is left as it is.
    """
    import sqlite3
    from contextlib import closing
    from urllib.parse import unquote, urlparse

    db, new = root / "mlflow.db", (root / "mlartifacts").resolve().as_uri()
    if not db.is_file():
        return 0
    changed = 0
    with closing(sqlite3.connect(db, timeout=120)) as con:
        try:
            locations = [loc for (loc,) in con.execute("SELECT artifact_location FROM experiments")]
        except sqlite3.DatabaseError:  # not an MLflow store of ours: nothing to rewrite
            return 0
        olds = {loc[: loc.index("/mlartifacts") + len("/mlartifacts")] for loc in locations
                if loc and loc.startswith("file://") and "/mlartifacts" in loc}
        for old in sorted(olds - {new}):
            if Path(unquote(urlparse(old).path)).exists():
                continue
            for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
                changed += con.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608
                    f"WHERE substr({column}, 1, ?) = ?",
                    (new, len(old) + 1, len(old), old)).rowcount
        con.commit()
    return changed
