"""Imports the megabase code carried in ``megabase_sources.py`` (written out once under
``$MEGABASE_CACHE/hf``, default ``~/.cache/megabase/hf``, C files included; a read-only home gets
a temporary copy per process, removed when it exits)."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .megabase_sources import PACKAGE, SOURCES


def megabase_module(name: str):
    """The carried module ``name`` (e.g. ``model.lm``, ``core.vocab``)."""
    if PACKAGE not in sys.modules:
        root = Path(os.environ.get("MEGABASE_CACHE") or Path.home() / ".cache" / "megabase") / "hf"
        home = root / PACKAGE
        if not (home / PACKAGE / "model" / "lm.py").is_file():
            try:
                root.mkdir(parents=True, exist_ok=True)
                home = _write(root, home)
            except OSError:
                scratch = Path(tempfile.mkdtemp(prefix="megabase-hf-"))
                atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # one process's copy
                home = _write(scratch, None)
        if str(home) not in sys.path:
            sys.path.append(str(home))
    return importlib.import_module(f"{PACKAGE}.{name}")


def _write(root: Path, home: Path | None) -> Path:
    """The sources under a temporary folder of ``root``, renamed into place as ``home`` (a
    process that wrote it first wins; None: keep the temporary folder)."""
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
    try:
        for rel, text in SOURCES.items():
            path = tmp / PACKAGE / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except OSError:  # a full or read-only cache: no half-written copy left in it
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if home is None:
        return tmp
    try:
        os.replace(tmp, home)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return home
