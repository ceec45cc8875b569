"""specs/: validated once, unknown keys refused, every op name real, and packaged with the library."""
from __future__ import annotations

import pytest
import torch
import yaml

from symgraph import spec as spec_module
from symgraph.errors import SpecError
from symgraph.pattern import Pattern
from symgraph.spec import RULES, load_specs

from test_moe_layouts import EXPERT_WEIGHTS, RowStackedExperts


def test_specs_load_and_cover_the_rules_the_engine_has():
    specs = load_specs()
    assert len(specs.ops) > 80
    assert {op.rule for op in specs.ops.values()} == set(RULES)  # every rule is used by some op


def test_every_op_name_is_a_real_aten_overload():
    for name in load_specs().ops:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op)
        assert overload in packet.overloads(), name


def test_every_rule_has_a_handler():
    from symgraph.analysis import rules

    assert {name.removeprefix("rule_") for name in dir(rules) if name.startswith("rule_")} == set(RULES)


def _load_ops(monkeypatch, ops: dict):
    """load_specs() over an ops.yaml holding only ``ops`` (and the real motifs)."""
    real = spec_module._load_yaml
    monkeypatch.setattr(spec_module, "_load_yaml", lambda name: {"ops": ops} if name == "ops.yaml" else real(name))
    spec_module.load_specs.cache_clear()
    try:
        return load_specs()
    finally:
        spec_module.load_specs.cache_clear()


@pytest.mark.parametrize("entry, field, message", [
    ({"rule": "contract", "pattern": "ab,,->->"}, "pattern", "exactly one '->'"),
    ({"rule": "contract", "pattern": "ab,,b->a"}, "pattern", "operand 2 has no letters"),
    ({"rule": "contract", "pattern": "a1,b->a"}, "pattern", "characters other than letters"),
    ({"rule": "contract", "pattern": "...i...,oi->o"}, "pattern", "more than one '...'"),
    ({"rule": "contract", "pattern": "...i,oi->...z"}, "pattern", "output letters z appear in no operand"),
    ({"rule": "contract", "pattern": "...i,oi->oo"}, "pattern", "repeats a letter"),
    ({"rule": "activation", "group": "permutation", "colour": "blue"}, "colour", "Extra inputs"),
    ({"rule": "activation", "pattern": "i,i->i", "group": "permutation"}, "pattern", "Extra inputs"),
    ({"rule": "activation"}, "group", "Field required"),
    ({"rule": "activation", "group": "rotation"}, "group", "'permutation'"),
    ({"rule": "movement", "negates": True}, "negates", "Extra inputs"),
    ({"rule": "movement", "replay_as": "aten.nothing.default"}, "replay_as", "not an ATen op overload"),
])
def test_a_malformed_entry_fails_to_load_naming_the_op_and_the_field(monkeypatch, entry, field, message):
    with pytest.raises(SpecError) as info:
        _load_ops(monkeypatch, {"aten.linear.default": entry})
    text = str(info.value)
    assert "aten.linear.default" in text and f"field '{field}'" in text and message in text, text


def test_an_unknown_rule_fails_to_load_listing_the_rules(monkeypatch):
    with pytest.raises(SpecError, match="aten.relu.default.*not-a-rule.*'movement'"):
        _load_ops(monkeypatch, {"aten.relu.default": {"rule": "not-a-rule"}})


@pytest.mark.parametrize("name, entry, message", [
    ("aten.linear.default", {"rule": "contract", "pattern": "...i,oi->...o"}, "has 2 operands but the op passes 3"),
    ("aten.addmm.default", {"rule": "contract", "pattern": "...i,io,o->...o", "operands": ["mat1", "bias"]},
     "names argument(s) bias"),
    ("aten.masked_fill.Scalar", {"rule": "where"}, "names argument(s) condition, other"),
    ("aten.relu.nonexistent", {"rule": "activation", "group": "permutation"}, "not an ATen op overload"),
])
def test_an_entry_that_does_not_fit_the_op_schema_fails_to_load(monkeypatch, name, entry, message):
    with pytest.raises(SpecError, match=name.replace(".", r"\.")) as info:
        _load_ops(monkeypatch, {name: entry})
    assert message in str(info.value)


def test_patterns_are_parsed_once_at_load():
    linear = load_specs().op("aten.linear.default")
    assert linear.recipe == Pattern(("...i", "oi", "o"), "...o")
    assert load_specs().op("aten.matmul.default").recipe is None  # built per call from the operand ranks


def _with_motifs(monkeypatch, edit):
    """load_specs() with specs/motifs.yaml changed by ``edit`` (a function of its parsed YAML)."""
    real = spec_module._load_yaml
    motifs = edit(real("motifs.yaml"))
    monkeypatch.setattr(spec_module, "_load_yaml", lambda name: motifs if name == "motifs.yaml" else real(name))
    spec_module.load_specs.cache_clear()


@pytest.fixture
def motif_edit(monkeypatch):
    yield lambda edit: _with_motifs(monkeypatch, edit)
    spec_module.load_specs.cache_clear()


def _encoder_layer_census() -> dict[str, int]:
    import symgraph
    from symgraph import zoo

    from group_checks import census

    model = zoo.build("torch-encoder-layer")
    return census(symgraph.load(model, zoo.example_inputs_for("torch-encoder-layer", model)))


@pytest.mark.slow
def test_motifs_name_and_shape_the_groups_from_the_spec(motif_edit):
    assert _encoder_layer_census() == {"qk scale/nonzero 1x4": 1, "qk orthogonal 8x4": 1, "vo orthogonal 8x4": 1,
                                       "heads permutation 4x1": 1, "ffn permutation/positive 64x1": 1}

    def edit(yaml_data):  # a new motif for activation units, and QK without the orthogonal subgroup or rescale
        yaml_data["motifs"]["hidden"] = {"description": "units behind an activation", "tag": "activation"}
        yaml_data["motifs"]["qk"] = {"description": "query/key pair", "tag": "qk"}
        yaml_data["classify"]["coordinates"] = ["hidden", "qk", "vo", "residual", "other"]
        return yaml_data

    motif_edit(edit)
    assert _encoder_layer_census() == {"qk general_linear 8x4": 1, "vo orthogonal 8x4": 1,
                                       "heads permutation 4x1": 1, "hidden permutation/positive 64x1": 1}


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["classify"].update(coordinates=["qk", "nowhere"]) or m, "unknown: ['nowhere']"),
    (lambda m: m["classify"].update(scales=["scale_free", "ffn"]) or m, "scale_free have no tag"),
    (lambda m: m["motifs"]["vo"].update(rescale={"note": "x"}, subgroup=None) or m, "'rescale' needs a 'subgroup'"),
    (lambda m: m["motifs"]["qk"]["subgroup"].update(emit="rotation") or m, "'orthogonal'"),
    (lambda m: m["motifs"]["qk"].update(emit="orthogonal") or m, "Extra inputs"),
])
def test_a_malformed_motif_file_fails_to_load(motif_edit, edit, message):
    motif_edit(edit)
    with pytest.raises(SpecError, match="motifs.yaml") as info:
        load_specs()
    assert message in str(info.value)


@pytest.mark.slow
def test_every_tag_the_rules_attach_names_a_motif():
    """A tag no motif reads would be knowledge that drives nothing."""
    from symgraph import zoo
    from symgraph.analysis.walk import Walker
    from symgraph.capture import capture

    specs = load_specs()
    motif_tags = {t for m in specs.motifs.values() for t in (m.tag, m.unless)} - {None}
    derived = specs.derived_tags  # read through the tags they are computed from
    motif_tags = motif_tags - set(derived) | {t for d in derived.values() for t in (*d.all, *d.none)}
    seen = set()
    for family in ("torch-encoder-layer", "mixtral"):
        model = zoo.build(family)
        args, kwargs = zoo.example_inputs_for(family, model)
        seen |= set(Walker(capture(model, args, kwargs)).run().c.tags)
    # experts stacked in one parameter's rows (DBRX), weighed by a router: their units are tagged expert_units
    experts = RowStackedExperts(EXPERT_WEIGHTS["router"][0])
    seen |= set(Walker(capture(experts, (torch.randn(2, 7, 8),), {})).run().c.tags)
    assert seen == motif_tags


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
            return self.b(torch.cumprod(self.a(x), dim=-1))  # aten.cumprod is not in specs/ops.yaml

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


@pytest.mark.parametrize("weights", [dict(gate="w1", up="v1", gate_up="wv"), dict(gate="w1"), dict()],
                         ids=["both", "gate-alone", "neither"])
def test_an_experts_layout_names_gate_and_up_or_gate_up(weights):
    with pytest.raises(ValueError, match="either `gate` and `up`"):
        spec_module.ExpertsLayout(experts="n", down="w2", down_rows="units", activation="act", **weights)
    fused = spec_module.ExpertsLayout(experts="n", gate_up="wv", down="w2", down_rows="hidden", activation="act")
    assert fused.gate is fused.up is None and fused.identity_experts is None
