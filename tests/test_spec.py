"""specs/: validated once, unknown keys refused, every op name real, and packaged with the library."""
from __future__ import annotations

import pytest
import torch
import yaml

from symgraph import spec as spec_module
from symgraph.errors import SpecError
from symgraph.spec import OpSpec, Specs, load_specs


def test_specs_load_and_cover_the_rules_the_engine_has():
    from symgraph.analysis import rules

    specs = load_specs()
    assert len(specs.ops) > 80
    for name, op in specs.ops.items():
        assert hasattr(rules, f"rule_{op.rule}"), f"{name}: rule {op.rule} has no handler"


def test_every_op_name_is_a_real_aten_overload():
    for name in load_specs().ops:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op)
        assert overload in packet.overloads(), name


def test_unknown_keys_are_refused():
    with pytest.raises(Exception):
        OpSpec(rule="activation", group="permutation", colour="blue")
    with pytest.raises(Exception):
        Specs(ops={"aten.relu.default": {"rule": "not-a-rule"}}, motifs={})


def test_a_broken_spec_file_gives_a_spec_error(monkeypatch):
    monkeypatch.setattr(spec_module, "_load_yaml",
                        lambda name: {"ops": {"aten.relu.default": {"rule": "activation", "bogus": 1}}}
                        if name == "ops.yaml" else yaml.safe_load("motifs: {}"))
    spec_module.load_specs.cache_clear()
    try:
        with pytest.raises(SpecError, match="aten.relu.default"):
            load_specs()
    finally:
        spec_module.load_specs.cache_clear()


def test_an_op_missing_from_the_specs_pins_its_axes():
    import symgraph

    class Cumulative(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.cumsum(self.a(x), dim=-1))  # aten.cumsum is not in specs/ops.yaml

    report = symgraph.analyze(Cumulative(), inputs=(torch.randn(3, 4),))
    assert report.groups == ()
    assert any("no spec describes" in p.reason for p in report.pinned)
    assert report.unknown_ops


def test_every_subpackage_is_installed_by_pyproject():
    """A subpackage missing from [tool.setuptools] packages works in an editable install and vanishes from a
    real one; keep the list complete."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "symgraph").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
