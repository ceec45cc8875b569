"""Markdown / HTML / JSON renderings of real and synthetic reports."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import symgraph
from symgraph.errors import SymgraphError
from symgraph.groups import Group, Member, PinnedSpace
from symgraph.picture import LANE_W, sections, to_svg
from symgraph.render import ACTION_TEXT, KIND_TEXT, MOTIF_TEXT, render, to_html, to_markdown
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
    with torch.no_grad():  # as if trained: norm weights of exactly 1 would read as folded (an orthogonal stream)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
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
            groups.append(_group(f"g{k}:model.layers.{layer}", f"model.layers.{layer}", members, kind=kinds[k % len(kinds)],
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
        assert f"<code>{html.escape(g.id)}</code>" in page.replace("<wbr>", "")


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


class _ScaledNorm(torch.nn.Module):
    """Gemma's norm: multiplies by 1 + w, which limits the stream's group (w cannot take a scale)."""

    def __init__(self, d):
        super().__init__()
        self.w, self.up, self.down = torch.nn.Parameter(torch.randn(d)), torch.nn.Linear(d, d), torch.nn.Linear(d, 2)

    def forward(self, x):
        h = self.up(x) * (1 + self.w)
        return self.down(h)


def test_a_limit_on_a_group_names_the_model_line_that_sets_it():
    torch.manual_seed(0)
    report = symgraph.analyze(_ScaledNorm(6), inputs=(torch.randn(2, 6),))
    notes = [n for g in report.groups for n in g.notes if n.startswith("limited by")]
    assert any("in forward: h = self.up(x) * (1 + self.w)" in n and "test_render.py:" in n for n in notes), notes
    assert any(n in to_markdown(report) for n in notes)


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


def test_every_group_is_drawn_with_a_hover_title(report, rendered):
    _, page = rendered
    titles = re.findall(r'<g class="span"><title>(.*?)</title>', page)
    for g in report.groups:
        template = html.escape(re.sub(r"(?<![^.:+])\d+(?=$|[.:+])", "*", g.id))
        assert any(t.startswith(template + ":") for t in titles), g.id


def test_page_explains_actions_kinds_and_motifs(rendered):
    markdown, page = rendered
    for name, table in (("action", ACTION_TEXT), ("kind", KIND_TEXT), ("motif", MOTIF_TEXT)):
        for key, text in table.items():
            assert f"{key} ({name}): {text}" in markdown
            assert html.escape(f"{key} ({name}): {text}") in page


def test_long_ids_can_wrap_inside_their_table_column(bert_report):
    page = to_html(bert_report)
    qk = next(g for g in bert_report.groups if g.motif == "qk")
    assert f"<code>{html.escape(qk.id)}</code>" not in page  # one unbreakable word would widen the table
    assert html.escape(qk.id).replace(".", ".<wbr>").replace(":", ":<wbr>").replace("+", "+<wbr>") \
        .replace("_", "_<wbr>") in page


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="needs a headless Chromium (Debian: apt-get install chromium)")
def test_report_fits_a_1400px_browser_window(tmp_path):
    """Runs examples/screenshot_reports.py: Chromium renders the page, screenshots it, and measures its width."""
    script = Path(__file__).resolve().parent.parent / "examples" / "screenshot_reports.py"
    folder = Path(__file__).resolve().parent.parent / "symgraph" / "data" / "models" / "bert-topics-a"
    done = subprocess.run([sys.executable, str(script), str(folder), "--out", str(tmp_path / "shots")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fits"] and result["scroll_width"] == 1400
    png = Path(result["png"]).read_bytes()
    assert png.startswith(b"\x89PNG") and int.from_bytes(png[16:20], "big") == 1400  # IHDR width


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


def test_big_report_draws_each_distinct_block_once():
    # its render time is a benchmark's (examples/bench_report_depth.py), not a unit test's
    report = _synthetic(n_layers=100, per_layer=10)
    assert len(report.groups) == 1000 and len(report.parameters) == 600
    markdown, page = to_markdown(report), to_html(report)
    assert int(_summary_value(markdown, "groups")) == 1000
    first, second, rest = sections(report)  # the synthetic pin covers the 10 parameters of blocks 0 and 1
    assert [s.title for s in (first, second)] == ["model.layers.*   x 1 of 100   (blocks 0)",
                                                   "model.layers.*   x 1 of 100   (blocks 1)"]
    assert rest.title == "model.layers.*   x 98 of 100   (blocks 2-99)"
    assert [row.name for row in rest.rows] == [f"m{j}.weight" for j in range(6)]
    assert [bool(row.pinned) for row in second.rows] == [True] * 4 + [False] * 2
    assert page.count('class="pname"') == 18  # three distinct blocks drawn once each, not 100 blocks
    assert _StrictParser().check(page) == []


def test_a_block_that_differs_gets_its_own_section():
    groups = [_group(f"ffn:l.{i}", f"l.{i}", [f"l.{i}.up.weight"]) for i in range(5)]
    groups[3] = _group("ffn:l.3", "l.3", ["l.3.up.weight"], kind="signed_permutation")
    params = {f"l.{i}.up.weight": (8, 4) for i in range(5)} | {"head.weight": (3, 8)}
    titles = [s.title for s in sections(Report("toy", tuple(groups), (), params))]
    assert titles == ["l.*   x 4 of 5   (blocks 0-2, 4)", "l.*   x 1 of 5   (blocks 3)",
                      "After the repeated blocks"]


def test_spans_cover_the_member_coordinates_cut_at_copies():
    heads = Member("l.0.q.weight", 0, np.arange(32).reshape(4, 8, 1))  # 4 heads of 8 rows
    whole_heads = Member("l.0.o.weight", 1, np.arange(32).reshape(1, 4, 8), "dual")  # heads moved as blocks
    scattered = Member("l.0.q.weight", 1, np.array([[[0], [2], [3], [7]]]))
    group = Group("qk:l.0", "qk", "orthogonal", 8, 4, (heads,), layer="l.0")
    perm = Group("heads:l.0", "heads", "permutation", 4, 1, (whole_heads,), layer="l.0")
    other = Group("other:l.0", "other", "permutation", 4, 1, (scattered,), layer="l.0")
    report = Report("toy", (group, perm, other), (), {"l.0.q.weight": (32, 8), "l.0.o.weight": (8, 32)})
    rows = {row.name: row for row in sections(report)[0].rows}
    assert rows["q.weight"].spans[0].rects == ((0, 8), (8, 16), (16, 24), (24, 32))
    assert rows["o.weight"].spans[0].rects == ((0, 8), (8, 16), (16, 24), (24, 32))
    assert rows["o.weight"].spans[0].action == "dual" and rows["q.weight"].spans[1].rects == ((0, 1), (2, 4), (7, 8))
    svg = to_svg(report)
    widths = re.findall(r'<rect x="[\d.]+" y="\d+" width="([\d.]+)" height="16" fill="#4477aa"', svg)
    assert [float(w) for w in widths] == [LANE_W / 4] * 4  # each head a quarter of the 32-row axis


def test_pinned_parameters_say_why_under_their_shape():
    groups = tuple(_group(f"ffn:l.{i}", f"l.{i}", [f"l.{i}.up.weight"]) for i in range(2))
    params = {"embed.weight": (50, 8)} | {f"l.{i}.up.weight": (8, 8) for i in range(2)}
    pin = PinnedSpace(("embed.weight",), 50, "embedding rows are selected by input ids", node="embedding")
    report = Report("toy", groups, (pin,), params)
    before, block = sections(report)
    assert before.rows[0].pinned == (pin.reason,) and block.rows[0].pinned == ()
    svg = to_svg(report)
    assert f"<title>50 x 8 · pinned: {pin.reason}</title>" in svg and 'class="pinned"' in svg


def test_inner_repeats_fold_into_one_row():
    params = {f"l.{i}.experts.{e}.w": (4, 4) for i in range(2) for e in range(3)}
    groups = tuple(_group(f"ffn:l.{i}.experts.{e}", f"l.{i}", [f"l.{i}.experts.{e}.w"])
                   for i in range(2) for e in range(3))
    [section] = sections(Report("moe", groups, (), params))
    assert [(row.name, row.repeats) for row in section.rows] == [("experts.*.w", 3)]
    assert "x 2" in section.title


def test_empty_report():
    report = Report("empty", (), (), {})
    markdown, page = to_markdown(report), to_html(report)
    assert "| groups | 0 |" in markdown
    assert "<svg" not in page and _StrictParser().check(page) == []
