"""Small C kernels for the CPU, compiled on first use with the system C compiler and cached.

A kernel is one C file next to its Python wrapper. :func:`load` builds it with
``cc -O3 -march=native -fopenmp -shared`` (or fewer flags, see :data:`VARIANTS`) into
``$MEGABASE_CACHE/native`` (default ``~/.cache/megabase/native``) under a name hashing the source, the flags, the compiler's version
and the CPU's feature flags, so a cache shared by several machines never runs code built for
another CPU. Builds write a temporary file and rename it: processes that build at once (ranks of
one job) do not see half a library. No compiler or a failed build: :func:`load` returns None after
one warning and the callers keep their PyTorch path. ``MEGABASE_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC")
# tried in order: the CPU's own vector units and threads, then without OpenMP (a compiler without
# its runtime: one thread), then without -march=native (a compiler that cannot target the host)
VARIANTS = (("-march=native", "-fopenmp"), ("-march=native",), ())


def enabled() -> bool:
    return os.environ.get("MEGABASE_NATIVE", "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("MEGABASE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megabase")
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# lets the compiler vectorise sums (their order then differs from the written loop's, and is fixed
# at build time); for kernels that neither rely on signed zeros nor on a strict order of sums
REASSOCIATE = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


@functools.lru_cache(maxsize=None)
def load(source: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from the C file ``source`` (a path) with the ``extra`` compiler
    flags, or None if it cannot be had."""
    if not enabled():
        return None
    src = Path(source)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return _give_up(src, "no C compiler on PATH (set CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return _give_up(src, f"{cc} --version failed: {err}")
    last = "no build variant tried"
    for variant in VARIANTS:
        flags = FLAGS + tuple(extra) + variant
        key = hashlib.sha256("\0".join([src.read_text(), *flags, version, _cpu_flags()]).encode())
        out = cache_dir() / f"{src.stem}-{key.hexdigest()[:16]}.so"
        if not out.exists():
            error = _build(cc, src, flags, out)
            if error:
                last = error
                continue
        try:
            return ctypes.CDLL(str(out))
        except OSError as err:
            last = str(err)
    return _give_up(src, last)


def bind(source: str, signatures: dict[str, list], extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """:func:`load`, with the argument types of each of its ``signatures`` (function name -> ctypes
    argument types; every function returns a C ``int``) set once."""
    lib = load(source, extra)
    if lib is not None and not hasattr(lib, "_megabase_typed"):
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = ctypes.c_int
        lib._megabase_typed = True
    return lib


def _build(cc: str, src: Path, flags: tuple[str, ...], out: Path) -> str | None:
    """Compile ``src`` to ``out`` atomically; the compiler's last error line on failure."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as err:
        return f"cannot write to {out.parent}: {err}"
    try:
        done = subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            return lines[-1] if lines else f"{cc} exited with {done.returncode}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _give_up(src: Path, reason: str) -> None:
    warnings.warn(f"megabase: the native kernel {src.name} is unavailable ({reason}); "
                  "using the PyTorch path", RuntimeWarning, stacklevel=3)
    return None
