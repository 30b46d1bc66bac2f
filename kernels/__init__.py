"""megabase.kernels: one folder per op, a pure-PyTorch reference beside each fast kernel (DESIGN.md, Model).

This folder sits at the repository root, and a Python started there (a shell, a notebook, ``python
-m pytest``) has the root first on ``sys.path``: ``import kernels`` would find this folder instead
of Hugging Face's ``kernels`` package, which ``transformers`` requires and imports (loading an
exported model at the root failed with ``cannot import name 'CUDAProperties' from 'kernels'``).
Imported under that top-level name, this module hands the import to the installed package, looked
up on ``sys.path`` without the repository root; as ``megabase.kernels`` it does nothing. Where no
such package is installed it stays itself, as before (``transformers`` then finds no version and
treats ``kernels`` as absent).
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if (_spec is not None and _spec.loader is not None and _spec.origin is not None
            and _os.path.realpath(_spec.origin) != _os.path.realpath(__file__)):
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # the import system returns what sys.modules holds
        _spec.loader.exec_module(_module)
