"""The naive references of flash-linear-attention, loaded as test oracles.

The files are loaded by path, so neither ``fla/__init__`` (12 s, needs Triton and a GPU) nor any
kernel is imported. Tests that use them skip when ``fla-core`` is not installed.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import pytest


@cache
def _load(relative: str):
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location(f"_fla_oracle_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def fla_naive(name: str):
    """``"kda"`` or ``"dsa"``: the naive module of that op, or skip the test."""
    module = _load(f"ops/{name}/naive.py")
    if module is None:
        pytest.skip("fla-core is not installed (pip install 'megabase[test]')")
    return module
