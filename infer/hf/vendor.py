"""megabase's model code, carried inside an exported model folder so that it runs with no megabase
installed.

:func:`sources` gathers the modules the model needs (the layers, the kernels' dispatch with their
PyTorch forms and C files, the vocabulary) and renames the package: ``megabase.x.y`` becomes
``<package>.x.y``, a name unique to this code (a hash of it), so an installed megabase of another
version never mixes in. Package ``__init__`` files that would import the whole of megabase
(``megabase.data``, ``megabase.model``) are replaced by empty ones. The exported folder's
``megabase_sources.py`` holds the result as one ``repr`` string per file (no line of it starts with
``import``, which transformers would take for a dependency); ``modeling_megabase.py`` writes it out
once under ``$MEGABASE_CACHE/hf`` and imports it from there, C files included, so the C kernels
build as megabase's do (and the PyTorch forms run where there is no compiler).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
from pathlib import Path

# what the wrapper imports (modeling_megabase.py, tokenization_megabase.py); everything they import
# from megabase, at any depth, is found by reading their import statements (:func:`modules`)
ROOTS = ("megabase.model.lm", "megabase.model.config", "megabase.model.stream",
         "megabase.core.vocab")
# packages whose own __init__ would pull in the rest of megabase
EMPTY_PACKAGES = ("megabase", "megabase.core", "megabase.data", "megabase.model")

_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)megabase(?=[.\s])", re.MULTILINE)


def _file_of(module: str) -> Path:
    return Path(importlib.import_module(module).__file__)


def _relative(module: str, is_package: bool) -> str:
    parts = module.split(".")[1:]
    return "/".join([*parts, "__init__.py"]) if is_package else "/".join(parts) + ".py"


def _imported(module: str, path: Path) -> set[str]:
    """The megabase modules ``module`` (its source at ``path``) imports anywhere in its text,
    function bodies included (lazy imports are imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megabase.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base != "megabase" and not base.startswith("megabase."):
                continue
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names  # ``from package import submodule``
                      if _is_module(f"{base}.{a.name}")}
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def modules() -> list[str]:
    """Every megabase module the wrapper's :data:`ROOTS` need, with the packages holding them
    (those of :data:`EMPTY_PACKAGES` excepted: they are replaced by empty ones)."""
    todo, seen = list(ROOTS), set()
    while todo:
        module = todo.pop()
        if module in seen or module in EMPTY_PACKAGES:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # its packages
        todo += sorted(_imported(module, _file_of(module)))
    return sorted(seen)


def sources() -> tuple[str, dict[str, str]]:
    """``(package, {path inside the package: text})``: the model's code under its new name."""
    files: dict[str, str] = {}
    for module in modules():
        path = _file_of(module)
        is_package = path.name == "__init__.py"
        rel = _relative(module, is_package)
        files[rel] = path.read_text()
        folder = rel.rpartition("/")[0]
        for c_file in path.parent.glob("*.c"):  # the C kernels beside their wrappers
            files[f"{folder}/{c_file.name}"] = c_file.read_text()
    for package in EMPTY_PACKAGES:
        files[_relative(package, True)] = f'"""{package}, as much of it as an exported model needs."""\n'
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode())
    package = f"megabase_export_{digest.hexdigest()[:12]}"
    renamed = {k: _IMPORT.sub(lambda m: m.group(1) + package, v) for k, v in files.items()}
    return package, dict(sorted(renamed.items()))


def sources_module(package: str, files: dict[str, str]) -> str:
    """The text of ``megabase_sources.py``."""
    lines = ['"""megabase\'s model code for this exported model (written out and imported by',
             'modeling_megabase.py; see megabase.infer.hf.vendor)."""', "",
             f"PACKAGE = {package!r}", "", "SOURCES = {"]
    lines += [f"    {path!r}: {text!r}," for path, text in files.items()]
    lines += ["}", ""]
    return "\n".join(lines)
