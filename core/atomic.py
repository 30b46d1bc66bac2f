"""Atomic writes: a file or a directory appears whole or not at all (temp + rename)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_TEMP = re.compile(r"\.tmp-(\d+)-[^/]*$")


def temp_prefix(path: Path) -> str:
    """Prefix of the temporary sibling of ``path``: ``.<name>.tmp-<pid>-``. The pid lets a later
    process tell a temp left by a killed writer from one being written now."""
    return f".{path.name}.tmp-{os.getpid()}-"


def remove_stale_temps(parent: Path, name: str = "*") -> list[Path]:
    """Remove the temporary siblings (files or folders ``.<name>.tmp-<pid>-*`` in ``parent``,
    ``name`` a glob) whose writer is gone: a SIGKILL or a power cut. Temps of live processes and
    everything else stay. Returns what was removed."""
    removed = []
    for tmp in Path(parent).glob(f".{name}.tmp-*-*"):
        m = _TEMP.search(tmp.name)
        if not m or tmp.is_symlink():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
        except (PermissionError, OverflowError):  # alive, another user's; or no such pid at all
            pass
    return removed


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling renamed into place."""
    with writing(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextmanager
def writing(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write by name (for a library that opens the file itself),
    renamed to ``path`` when the block ends, removed if it raises; it follows the user's umask.
    An OSError on the way names ``path``, never the temporary (:func:`naming`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        fd, made = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
        os.close(fd)
        tmp = path.parent / Path(made).name  # as the caller wrote path (mkstemp's is absolute)
        try:
            yield Path(tmp)
            os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; follow the umask
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# numpy's short write to a full disk: OSError('100000 requested and 2484 written'), no errno
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised in the block names ``path``, so its one line says what could not be
    written: an error without a file name (a write to an open file on a full disk, past a
    file-size limit) gets ``path``; one naming a temporary of ``path`` (``.<name>.tmp-<pid>-*``
    of :func:`writing` and :func:`building_dir`, or a file inside one) names ``path`` (or the
    file inside it) instead, a name the user knows."""
    try:
        yield
    except OSError as exc:
        retarget(exc, Path(path))
        raise


def retarget(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` as :func:`naming` describes (changed in place, and returned)."""
    if exc.errno is None and exc.strerror is None and exc.args:
        # an OSError of one message prints "[Errno None] None" once it has a file name: keep the
        # message as its reason
        reason = str(exc.args[0])
        if _SHORT_WRITE.fullmatch(reason):
            reason = f"short write ({reason}): the disk is full or a file-size limit was reached"
        exc.strerror = reason
    if exc.filename is None:
        exc.filename = str(path)
    for attr in ("filename", "filename2"):
        name = getattr(exc, attr)
        if name is not None:
            setattr(exc, attr, _untemp(os.fsdecode(name), path))
    return exc


def _untemp(name: str, path: Path) -> str:
    """``name`` with a temporary of ``path`` in it written as ``path``: ``dir/.<name>.tmp-1-x/f``
    (:func:`writing`, :func:`building_dir`) as ``dir/<name>/f``, ``dir/.<name>.old-x/previous``
    (:func:`replace_dir`) and the lock ``dir/.<name>.lock`` (``core.locks``) as ``dir/<name>``;
    any other name as it is."""
    parts = Path(name).parts
    for i, part in enumerate(parts):
        if part.startswith(f".{path.name}.tmp-"):
            return str(Path(*parts[:i], path.name, *parts[i + 1:]))
        if part.startswith(f".{path.name}.old-") or part == f".{path.name}.lock":
            return str(Path(*parts[:i], path.name))
    return name


def current_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` to ``out``, replacing what was there."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / "previous")
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def building_dir(out: Path, install: Callable[[Path, Path], None] = replace_dir,
                 mode: int | None = None) -> Iterator[Path]:
    """A temporary sibling of ``out`` to build a directory in; when the block ends normally,
    ``install(tmp, out)`` moves it into place (default: replace ``out`` whole). On any error,
    Ctrl-C or SIGTERM the temporary is removed and ``out`` is as it was. ``mode``: the folder's
    permissions (default: the umask's, where ``mkdtemp`` gives 0700). An OSError names ``out``
    or the file in it being written, not the temporary (:func:`naming`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with naming(out):
        tmp = out.parent / Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent)).name
        try:
            tmp.chmod(0o777 & ~current_umask() if mode is None else mode)
            yield tmp
            install(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, hex."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
