"""pyproject.toml builds without setuptools warnings: every data folder is a listed package, the license an SPDX
string (a table is deprecated and warns on every build)."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_importable_folder_under_the_package_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    folders = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "symgraph").rglob("*")
               if p.is_dir() and p.name != "__pycache__" and not p.is_symlink()}
    importable = {name for name in folders | {"symgraph"} if all(part.isidentifier() for part in name.split("."))}
    assert importable - listed == set(), "setuptools warns 'Package would be ignored' for each of these"
    assert listed - importable == {"symgraph.specs"}  # mapped from the top-level specs/ folder


def test_license_is_an_spdx_expression_and_setuptools_understands_it():
    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    assert any(r.startswith("setuptools>=77") for r in project["build-system"]["requires"])
