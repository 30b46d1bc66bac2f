"""The wheel holds every subpackage and C file: pyproject's package lists match the folders (an
editable install finds a folder pyproject forgot; a wheel does not)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_and_c_file_is_in_the_wheel():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]
    assert sorted(tool["packages"]) == sorted(dirs)
    for name, folder in dirs.items():
        for sub in (ROOT / folder).iterdir():
            if (sub / "__init__.py").is_file():
                child = f"{name}.{sub.name}"
                assert dirs.get(child) == f"{folder}/{sub.name}", f"{child} is not in pyproject"
        if any((ROOT / folder).glob("*.c")):
            assert "*.c" in tool["package-data"].get(name, []), f"{name}'s C files are not shipped"
