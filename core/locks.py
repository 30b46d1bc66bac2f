"""Advisory locks between megabase processes: a run folder has one writer, a store one builder.

A lock is ``fcntl.flock`` on a small file beside what it guards (``.<name>.lock``) that holds the
holder's pid and command, so the one refused can say who holds it. The kernel drops the lock when
its holder exits, however it exits (a SIGKILL or a crash leaves no stale lock, only a file that
the next holder takes over); a holder that ends normally removes the file. Locks are reentrant
within a process: a holder may call code that takes the same lock.

Readers take shared holds instead (:func:`hold_reading`): ``evaluate`` holds the checkpoint it
reads, and checkpoint rotation (:func:`remove_unless_read`) skips a folder any reader holds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .atomic import temp_prefix
from .errors import InputError

_held: dict[str, tuple[int, int]] = {}  # lock path -> (fd, depth) held by this process


def lock_path(path: str | Path) -> Path:
    """``parent/.<name>.lock``: the lock file of ``path`` (which need not exist yet)."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"


def _holder(lock: Path) -> str:
    try:
        text = lock.read_text().strip()
    except OSError:
        text = ""
    pid, _, command = text.partition(" ")
    return f"process {pid} ({command})" if pid.isdigit() else "another process"


@contextmanager
def holding(path: str | Path, what: str, wait: bool = False,
            poll_s: float = 0.5, instead: str = "choose another name") -> Iterator[Path]:
    """Hold the lock of ``path`` for the block.

    Args:
        path: what is guarded (a run folder, a store); its lock file is :func:`lock_path`.
        what: how the error names it, e.g. ``"run 'demo'"``.
        wait: wait for the holder to finish (a store build: the second one then finds the store
            up to date) instead of refusing at once (a run: two writers would interleave steps).
        poll_s: seconds between tries while waiting.
        instead: what the refusal tells the user to do besides waiting.

    Raises:
        InputError: without ``wait``, when another process holds the lock; it names the holder.
    """
    lock = lock_path(path)
    key = str(lock.resolve()) if lock.parent.exists() else str(lock.absolute())
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield lock
        finally:
            fd, depth = _held[key]
            _held[key] = (fd, depth - 1)
        return
    made = _missing(lock.parent)
    try:
        fd = _acquire(lock, what, path, wait, poll_s, instead)
    except OSError as exc:
        if not wait or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        yield lock  # read-only storage: nothing can be built there for a lock to guard
        return
    except BaseException:
        _remove_empty(made)
        raise
    _held[key] = (fd, 1)
    try:
        yield lock
    finally:
        del _held[key]
        lock.unlink(missing_ok=True)  # before the release: a waiter then finds its file gone
        os.close(fd)  # closing the descriptor releases the lock
        _remove_empty(made)


def _missing(folder: Path) -> list[Path]:
    """The folders from ``folder`` up that do not exist yet, deepest first: what taking a lock
    in ``folder`` creates."""
    made = []
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    return made


def _remove_empty(made: list[Path]) -> None:
    """Remove the folders a lock created, deepest first, where they are still empty (a refused
    run leaves no empty ``runs/`` behind; a run's folder, or another's lock, keeps them)."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def _acquire(lock: Path, what: str, path, wait: bool, poll_s: float, instead: str) -> int:
    """A descriptor of ``lock`` holding its flock, with this process written in it. The file
    is removed on release, so a lock is only good on the file still at that path: a waiter
    that wins on a removed file opens the new one and tries again."""
    told = False
    while True:
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # its folder, empty, was just removed by a releasing holder
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if not wait:
                raise InputError(f"{what} is in use by {_holder(lock)}; wait for it to end or "
                                 f"{instead}", path) from None
            if not told:
                print(f"{path}: waiting for {_holder(lock)}, which holds {what}", file=sys.stderr)
                told = True
            time.sleep(poll_s)
            continue
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {' '.join(['megabase', *sys.argv[1:2]])}\n".encode())
            return fd
        os.close(fd)


READERS = ".readers.lock"  # inside a folder being read: a shared flock per reader


def hold_reading(folder: str | Path) -> int | None:
    """Take a shared hold on ``folder`` (e.g. a checkpoint being evaluated): until
    :func:`release_reading` of the descriptor returned, :func:`remove_unless_read` leaves the
    folder alone. Any number of readers hold it at once.

    Returns the descriptor, or None for a folder this process cannot write in (read-only
    storage: no hold file can be made there). Raises FileNotFoundError when ``folder`` is gone,
    or was removed while this waited for a remover that had already begun."""
    pin = Path(folder) / READERS
    try:
        fd = os.open(pin, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a remover, which holds it while removing
        if os.stat(pin).st_ino != os.fstat(fd).st_ino:  # held a file whose folder was removed
            raise FileNotFoundError(errno.ENOENT, "removed while waiting for its hold", str(folder))
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_reading(fd: int | None) -> None:
    """Give back a hold from :func:`hold_reading`."""
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def remove_unless_read(folder: str | Path) -> bool:
    """Remove ``folder`` unless a reader holds it (:func:`hold_reading`); True when it is gone.

    The folder is first renamed to a temporary sibling (``.<name>.tmp-<pid>-*``, which
    ``core.atomic.remove_stale_temps`` clears if this process dies midway), under an exclusive
    hold, so a reader either holds it before (and it stays) or finds it gone; never a half-removed
    folder, nor one re-created around a new hold file."""
    folder = Path(folder)
    try:
        fd = os.open(folder / READERS, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return not folder.exists()
    except OSError:
        fd = None  # no hold file can be made there, so no reader holds it either
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        grave = None
        try:
            grave = Path(tempfile.mkdtemp(prefix=temp_prefix(folder), dir=folder.parent))
            os.replace(folder, grave / folder.name)
        except OSError:  # a parent it cannot write in: the folder stays as it is
            return False
        finally:
            if grave is not None:
                shutil.rmtree(grave, ignore_errors=True)
        return True
    finally:
        if fd is not None:
            os.close(fd)
