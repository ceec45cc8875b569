"""Every docstring example in the package runs and shows what it says (networkx tests its examples the same way).

A module's examples are found with :mod:`doctest` at collection, one test per docstring; a new example joins the
suite by being written.
"""
from __future__ import annotations

import doctest
import functools
import importlib
import pkgutil

import pytest

import symgraph

_SLOW = {"symgraph", "symgraph.connectivity.barrier"}  # several seconds each
_NOT_IMPORTED = {"symgraph.__main__"}  # importing it runs the command line


@functools.cache
def docstring_examples() -> dict[str, doctest.DocTest]:
    modules = ["symgraph"] + [m.name for m in pkgutil.walk_packages(symgraph.__path__, "symgraph.")
                              if m.name not in _NOT_IMPORTED]
    finder = doctest.DocTestFinder()
    return {test.name: test for name in modules for test in finder.find(importlib.import_module(name), name)
            if test.examples}


def test_the_package_has_docstring_examples():
    assert len(docstring_examples()) >= 40


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n
                                  for n in sorted(docstring_examples())])
def test_docstring_example_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    lines = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(docstring_examples()[name], out=lines.append)
    assert runner.failures == 0, "".join(lines)
