"""Markdown / HTML / JSON renderings of real and synthetic reports."""
from __future__ import annotations

import html
import json
import re
import sys
import time
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import symgraph
from symgraph.errors import SymgraphError
from symgraph.groups import Group, Member, PinnedSpace
from symgraph.render import render, to_html, to_markdown
from symgraph.report import Report

transformers = pytest.importorskip("transformers")

NAMESPACES = ('xmlns="http://www.w3.org/2000/svg"', 'xmlns:xlink="http://www.w3.org/1999/xlink"')
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def mlp_report() -> Report:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return symgraph.analyze(mlp, inputs=(torch.randn(2, 4),))


@pytest.fixture(scope="module")
def bert_report() -> Report:
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=50)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # norm weights of exactly 1 would give the folded model's orthogonal residual group
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return symgraph.analyze(model, inputs={"input_ids": torch.randint(0, 50, (2, 7))})


@pytest.fixture(scope="module", params=["mlp", "bert"])
def report(request, mlp_report, bert_report) -> Report:
    return {"mlp": mlp_report, "bert": bert_report}[request.param]


@pytest.fixture(scope="module")
def rendered(report) -> tuple[str, str]:
    return to_markdown(report), to_html(report)


def _member(param: str, size: int = 8, copies: int = 1, block: int = 1, action: str = "primal") -> Member:
    return Member(param, 0, np.arange(copies * size * block).reshape(copies, size, block), action)


def _group(gid: str, layer: str, params: list[str], kind: str = "permutation", motif: str = "ffn", **kw) -> Group:
    return Group(gid, motif, kind, 8, 1, tuple(_member(p) for p in params), layer=layer, **kw)


def _synthetic(n_layers: int, per_layer: int, params_per_layer: int = 6) -> Report:
    kinds = ("orthogonal", "permutation", "scale", "signed_permutation", "general_linear")
    motifs = ("qk", "vo", "heads", "ffn", "residual", "scale_free", "other")
    groups, params = [], {}
    for layer in range(n_layers):
        names = [f"model.layers.{layer}.m{j}.weight" for j in range(params_per_layer)]
        params.update({n: (8, 8) for n in names})
        for k in range(per_layer):
            members = [names[(k + i) % params_per_layer] for i in range(3)]
            groups.append(_group(f"g{layer}-{k}", f"model.layers.{layer}", members, kind=kinds[k % len(kinds)],
                                 motif=motifs[k % len(motifs)]))
    pinned = (PinnedSpace(tuple(params)[:10], 8, "synthetic pin", node="linear_7"),)
    return Report("synthetic", tuple(groups), pinned, params, {"aten.mystery.default": 2}, ("a synthetic note",))


class _StrictParser(HTMLParser):
    """Fails on end tags that do not close the innermost open element, and on elements left open."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} at {self.getpos()}")
        else:
            self.stack.pop()

    def check(self, text: str) -> list[str]:
        self.feed(text)
        self.close()
        return self.errors + ([f"unclosed: {self.stack}"] if self.stack else [])


def _summary_value(markdown: str, key: str) -> str:
    match = re.search(rf"^\| {re.escape(key)} \| (.*?) \|$", markdown, flags=re.M)
    assert match, f"no summary row {key!r}"
    return match.group(1)


def _table_cells(line: str) -> int:
    return len(re.split(r"(?<!\\)\|", line.strip())) - 2


# ------------------------------------------------------------------------------------------------ real reports


def test_every_group_id_appears(report, rendered):
    markdown, page = rendered
    assert report.groups
    for g in report.groups:
        assert f"`{g.id}`" in markdown
        assert f"<code>{html.escape(g.id)}</code>" in page


def test_markdown_summary_counts_match_report(report, rendered):
    markdown, _ = rendered
    assert int(_summary_value(markdown, "groups")) == len(report.groups)
    by_kind = re.findall(r"^\| groups: (\w+)/(\w+) \| (\d+) \|$", markdown, flags=re.M)
    assert sum(int(n) for *_, n in by_kind) == len(report.groups)
    assert int(_summary_value(markdown, "pinned spaces")) == len(report.pinned)
    dof = int(_summary_value(markdown, "continuous degrees of freedom").replace(",", ""))
    assert dof == sum(g.dof for g in report.groups)


def test_markdown_title_and_tables_are_well_formed(report, rendered):
    markdown, _ = rendered
    assert markdown.startswith(f"# Symmetry report: {report.model}\n")
    for block in re.split(r"\n\n+", markdown):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({_table_cells(r) for r in rows}) <= 1, block


def test_pinned_reasons_appear(report, rendered):
    markdown, page = rendered
    assert report.pinned
    assert "## Pinned" in markdown
    for p in report.pinned:
        assert p.reason in markdown
        assert html.escape(p.reason) in page


def test_html_is_self_contained_with_svg(rendered):
    _, page = rendered
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 1 and "<?xml" not in page and "<!DOCTYPE svg" not in page
    stripped = page
    for ns in NAMESPACES:
        stripped = stripped.replace(ns, "")
    assert not re.search(r"https?://", stripped)
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert "@import" not in page and "url(http" not in page


def test_html_parses_strictly(rendered):
    _, page = rendered
    assert _StrictParser().check(page) == []


def test_html_nodes_carry_hover_titles(report, rendered):
    _, page = rendered
    titles = re.findall(r'<g id="sgnode\d+"><title>(.*?)</title>', page)
    for g in report.groups:
        assert html.escape(g.id) in titles


def test_layer_sections_and_member_details(bert_report):
    markdown = to_markdown(bert_report)
    headings = re.findall(r"^## Layer `(.*)`$", markdown, flags=re.M)
    assert headings.index("bert.encoder.layer.0") < headings.index("bert.encoder.layer.1")
    assert set(headings) == {g.layer for g in bert_report.groups if g.layer}
    heads = next(g for g in bert_report.groups if g.motif == "heads")
    assert f"(block {heads.members[0].index.shape[2]})" in markdown
    qk = next(g for g in bert_report.groups if g.motif == "qk" and g.kind == "orthogonal")
    assert "full group: general_linear" in markdown and qk.full_group == "general_linear"
    residual = next(g for g in bert_report.groups if g.motif == "residual")
    assert residual.global_sign and "global sign" in markdown
    if len(residual.members) > 16:
        assert f"+{len(residual.members) - 16} more" in markdown


def test_render_dispatch(mlp_report):
    assert json.loads(render(mlp_report, "json")) == json.loads(mlp_report.dumps())
    assert render(mlp_report, "md") == to_markdown(mlp_report)
    assert render(mlp_report, "html") == to_html(mlp_report)  # deterministic: seeded layout, salted SVG ids


@pytest.mark.parametrize("fmt", ["xml", "", "MD", "markdown"])
def test_bad_format_names_the_valid_ones(mlp_report, fmt):
    with pytest.raises(SymgraphError) as info:
        render(mlp_report, fmt)
    message = str(info.value)
    assert repr(fmt) in message
    for valid in ("json", "md", "html"):
        assert valid in message


def test_html_leaves_matplotlib_state_alone(mlp_report):
    import matplotlib

    had_pyplot = "matplotlib.pyplot" in sys.modules
    before = matplotlib.rcParams.copy()  # copy(), unlike dict(), does not resolve (and import) the backend
    to_html(mlp_report)
    assert matplotlib.rcParams.copy() == before
    if not had_pyplot:
        assert "matplotlib.pyplot" not in sys.modules


# ------------------------------------------------------------------------------------------------ synthetic reports


def test_natural_layer_order_and_model_wide_section():
    groups = tuple(_group(f"g-{layer or 'model'}", layer, ["a.weight"]) for layer in ("l.10", "l.2", "", "l.1"))
    report = Report("toy", groups, (), {"a.weight": (8, 8)})
    markdown = to_markdown(report)
    order = [markdown.index(f"`{g}`") for g in ("g-model", "g-l.1", "g-l.2", "g-l.10")]
    assert order == sorted(order)
    assert "## Model-wide groups" in markdown
    assert "| pinned spaces | 0 |" in markdown and "No coordinates are pinned." in markdown


def test_rotary_pairs_scale_and_escaping():
    pairs = tuple((i, i + 16) for i in range(16))
    rotary = _group("rot|0", "l.0", ["l.0.q.weight"], kind="rotary", motif="qk", rotary_pairs=pairs,
                    passthrough=(32, 33, 34, 40))
    scaled = _group("ffn<0>", "l.0", ["l.0.up.weight"], scale="positive")
    report = Report("toy", (rotary, scaled), (), {"l.0.q.weight": (8, 8), "l.0.up.weight": (8, 8)})
    markdown, page = to_markdown(report), to_html(report)
    assert "(0, 16), (1, 17), ..., (15, 31) [16 pairs]" in markdown
    assert "passthrough: 32..34, 40" in markdown
    assert "+ positive scale" in markdown
    assert "`rot\\|0`" in markdown and "`q.weight[0] primal`" in markdown
    assert "ffn&lt;0&gt;" in page and "ffn<0>" not in page
    assert _StrictParser().check(page) == []


def test_pinned_params_are_truncated_and_notes_listed():
    report = _synthetic(n_layers=2, per_layer=2)
    markdown, page = to_markdown(report), to_html(report)
    assert "synthetic pin" in markdown and "+6 more" in markdown and "`linear_7`" in markdown
    assert "## Notes" in markdown and "- a synthetic note" in markdown and "a synthetic note" in page
    assert _summary_value(markdown, "unknown ops") == "aten.mystery.default x2"


def test_big_report_renders_quickly_and_collapses():
    report = _synthetic(n_layers=100, per_layer=10)
    assert len(report.groups) == 1000 and len(report.parameters) == 600
    start = time.perf_counter()
    markdown, page = to_markdown(report), to_html(report)
    assert time.perf_counter() - start < 10
    assert int(_summary_value(markdown, "groups")) == 1000
    caption = re.search(r"<figcaption>(.*?)</figcaption>", page).group(1)
    assert "one node per layer prefix" in caption and "one node per motif and kind" in caption
    assert page.count('<g id="sgnode') < 200
    assert _StrictParser().check(page) == []


def test_empty_report():
    report = Report("empty", (), (), {})
    markdown, page = to_markdown(report), to_html(report)
    assert "| groups | 0 |" in markdown
    assert "<svg" not in page and _StrictParser().check(page) == []
