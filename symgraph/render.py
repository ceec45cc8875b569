"""Human renderings of a :class:`~symgraph.report.Report`: Markdown, and one self-contained HTML page.

Both renderings are built from the same list of sections (title, paragraphs, bullet items, one table), so they
always carry the same content; the HTML page adds a picture of the symmetry graph (groups and the parameters
they act on), drawn with networkx and matplotlib's SVG backend and inlined, with no external resources.

Examples
--------
>>> import symgraph, torch
>>> from symgraph.render import render
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> report = symgraph.analyze(mlp, inputs=(torch.randn(2, 4),))
>>> render(report, "md").splitlines()[0]
'# Symmetry report: Sequential'
"""
from __future__ import annotations

import html
import io
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Union

from .errors import SymgraphError
from .groups import MOTIFS, Group, Member, PinnedSpace
from .report import Report, solver_for

__all__ = ["render", "to_html", "to_markdown"]

MAX_MEMBERS = 16  # members listed per group before "+N more"
MAX_PINNED_PARAMS = 4  # parameter names listed per pinned space before "+N more"
MAX_PARAM_NODES = 200  # above this, the picture shows one node per layer prefix instead of one per parameter
MAX_GROUP_NODES = 300  # above this, the picture collapses groups by (layer prefix, motif, kind), then (motif, kind)
MAX_SPRING_NODES = 500  # networkx's spring layout turns slow from here; bigger pictures use two columns

Cell = Union[str, tuple[str, ...]]  # a tuple is a list of lines inside one cell


@dataclass(frozen=True)
class _Table:
    header: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    code_columns: tuple[int, ...] = ()  # columns whose text is code (ids, parameter names)


@dataclass(frozen=True)
class _Section:
    title: str
    level: int = 2
    paragraphs: tuple[str, ...] = ()
    items: tuple[str, ...] = ()
    table: _Table | None = None


# ----------------------------------------------------------------------------------------------------------------
# public face


def to_markdown(report: Report) -> str:
    """Render a report as Markdown for people.

    Parameters
    ----------
    report : Report
        The analysis result.

    Returns
    -------
    str
        A title, a summary table, one table of groups per layer, the pinned spaces and the report's notes.

    Examples
    --------
    >>> import symgraph, torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> "| groups | 1 |" in to_markdown(symgraph.analyze(mlp, inputs=(torch.randn(2, 4),)))
    True
    """
    blocks = [f"# {_title(report)}"] + [_section_md(s) for s in _sections(report)]
    return "\n\n".join(blocks) + "\n"


def to_html(report: Report) -> str:
    """Render a report as one self-contained HTML page (inline CSS and SVG, no external resources).

    Parameters
    ----------
    report : Report
        The analysis result.

    Returns
    -------
    str
        The Markdown content as HTML tables, plus a picture of the symmetry graph: groups joined to the
        parameters they act on, coloured by motif, shaped by kind.

    Examples
    --------
    >>> import symgraph, torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> "<svg" in to_html(symgraph.analyze(mlp, inputs=(torch.randn(2, 4),)))
    True
    """
    sections = _sections(report)
    body = [f"<h1>{_esc(_title(report))}</h1>", _section_html(sections[0]), _figure_html(report)]
    body += [_section_html(s) for s in sections[1:]]
    return _PAGE.format(title=_esc(_title(report)), css=_CSS, body="\n".join(body))


def render(report: Report, fmt: str) -> str:
    """Render a report in one of the formats ``json``, ``md`` or ``html``.

    Parameters
    ----------
    report : Report
        The analysis result.
    fmt : str
        ``"json"`` (the documented schema, :meth:`Report.dumps`), ``"md"`` or ``"html"``.

    Returns
    -------
    str
        The rendered report.

    Raises
    ------
    SymgraphError
        If ``fmt`` is not a known format; the message lists the valid ones.

    Examples
    --------
    >>> import symgraph, torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> render(symgraph.analyze(mlp, inputs=(torch.randn(2, 4),)), "json").startswith("{")
    True
    """
    renderer = _RENDERERS.get(fmt)
    if renderer is None:
        raise SymgraphError(f"Unknown report format {fmt!r}.",
                            hint=f"use one of the valid formats: {', '.join(_RENDERERS)}.")
    return renderer(report)


_RENDERERS: dict[str, Callable[[Report], str]] = {"json": Report.dumps, "md": to_markdown, "html": to_html}


# ----------------------------------------------------------------------------------------------------------------
# content shared by both renderings


def _title(report: Report) -> str:
    return f"Symmetry report: {report.model}"


def _sections(report: Report) -> list[_Section]:
    sections = [_summary_section(report)]
    sections += [_layer_section(layer, groups) for layer, groups in _groups_by_layer(report.groups)]
    sections.append(_pinned_section(report.pinned))
    if report.notes:
        sections.append(_Section("Notes", items=tuple(report.notes)))
    return sections


def _summary_section(report: Report) -> _Section:
    s = report.summary()
    rows: list[tuple[Cell, ...]] = [("groups", str(s["groups"]))]
    rows += [(f"groups: {key}", str(n)) for key, n in s["by_motif_kind"].items()]
    rows += [
        ("continuous degrees of freedom", f"{s['continuous_dof']:,}"),
        ("parameters covered", f"{s['parameters_in_some_group']} of {s['parameters']} tensors"),
        ("parameter count", f"{s['parameter_count']:,}"),
        ("pinned spaces", str(s["pinned_spaces"])),
        ("unknown ops", _unknown_ops(s["unknown_ops"])),
    ]
    return _Section("Summary", table=_Table(("quantity", "value"), tuple(rows)))


def _unknown_ops(ops: dict[str, int]) -> str:
    if not ops:
        return "none"
    return ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))


def _groups_by_layer(groups: tuple[Group, ...]) -> list[tuple[str, list[Group]]]:
    by_layer: dict[str, list[Group]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, []).append(g)
    return sorted(by_layer.items(), key=lambda item: _natural_key(item[0]))


def _natural_key(text: str) -> list:
    """Sort key that orders ``layer.2`` before ``layer.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


_GROUP_HEADER = ("id", "motif", "kind", "size x copies", "dof", "solver", "members", "notes")


def _layer_section(layer: str, groups: list[Group]) -> _Section:
    title = f"Layer `{layer}`" if layer else "Model-wide groups"
    text = (f"Member names are relative to `{layer}`.",) if layer else ()
    rows = tuple(_group_row(g, layer) for g in groups)
    return _Section(title, paragraphs=text, table=_Table(_GROUP_HEADER, rows, code_columns=(0, 6)))


def _group_row(g: Group, layer: str) -> tuple[Cell, ...]:
    members = tuple(_member_text(m, layer) for m in g.members[:MAX_MEMBERS]) + _more(len(g.members), MAX_MEMBERS)
    return (g.id, g.motif, _kind_text(g), f"{g.size} x {g.copies}", f"{g.dof:,}", solver_for(g), members,
            tuple(g.notes) + tuple(f"linked: {link}" for link in g.links))


def _kind_text(g: Group) -> Cell:
    tags = []
    if g.scale:
        tags.append(g.scale if g.kind == "scale" else f"+ {g.scale} scale")
    if g.global_sign:
        tags.append("global sign")
    if g.full_group:
        tags.append(f"full group: {g.full_group}")
    head = f"{g.kind} ({', '.join(tags)})" if tags else g.kind
    if g.kind != "rotary":
        return head
    return (head, f"pairs: {_pairs_text(g.rotary_pairs)}", f"passthrough: {_ranges_text(g.passthrough)}")


def _member_text(m: Member, layer: str) -> str:
    name = m.param[len(layer) + 1:] if layer and m.param.startswith(layer + ".") else m.param
    text = f"{name}[{m.axis}] {m.action}"
    if m.exponent != 1:
        text += f" ^{m.exponent}"
    block = m.index.shape[2]
    return text + (f" (block {block})" if block > 1 else "")


def _pairs_text(pairs: tuple[tuple[int, int], ...]) -> str:
    """``(0, 16), (1, 17), ..., (15, 31) [16 pairs]``: first two and last pair, and the count."""
    shown = [f"({a}, {b})" for a, b in pairs]
    if len(shown) > 4:
        shown = shown[:2] + ["...", shown[-1]]
    return f"{', '.join(shown) or 'none'} [{len(pairs)} pairs]"


def _ranges_text(values: tuple[int, ...]) -> str:
    """``0..3, 8, 10..11``: consecutive runs collapsed."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs) or "none"


def _pinned_section(pinned: tuple[PinnedSpace, ...]) -> _Section:
    if not pinned:
        return _Section("Pinned", paragraphs=("No coordinates are pinned.",))
    rows = tuple((p.reason, _node_text(p), _params_text(p.params), str(p.size)) for p in pinned)
    text = ("Coordinates no transformation may touch, and why.",)
    return _Section("Pinned", paragraphs=text, table=_Table(("reason", "node", "params", "size"), rows, (1, 2)))


def _node_text(p: PinnedSpace) -> str:
    return f"{p.node} ({p.source})" if p.source else p.node


def _params_text(params: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(params[:MAX_PINNED_PARAMS]) + _more(len(params), MAX_PINNED_PARAMS)


class _Plain(str):
    """Cell text that is never formatted as code (``+3 more``)."""


def _more(total: int, shown: int) -> tuple[str, ...]:
    return (_Plain(f"+{total - shown} more"),) if total > shown else ()


# ----------------------------------------------------------------------------------------------------------------
# Markdown


def _section_md(s: _Section) -> str:
    parts = [f"{'#' * s.level} {s.title}"]
    parts += list(s.paragraphs)
    if s.items:
        parts.append("\n".join(f"- {_md_text(item)}" for item in s.items))
    if s.table is not None:
        parts.append(_table_md(s.table))
    return "\n\n".join(parts)


def _table_md(t: _Table) -> str:
    lines = ["| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
    for row in t.rows:
        cells = [_cell_md(c, i in t.code_columns) for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell_md(cell: Cell, code: bool) -> str:
    lines = (cell,) if isinstance(cell, str) else cell
    return "<br>".join(_md_code(line) if code and not isinstance(line, _Plain) else _md_text(line)
                       for line in lines)


def _md_text(text: str) -> str:
    return _md_escape(text).replace("<", "&lt;")


def _md_code(text: str) -> str:
    return f"`{_md_escape(text)}`" if text else ""


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------------------------------------------
# HTML


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
{body}
</body>
</html>
"""

_CSS = """body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 90em;
  padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.95em; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.9em; }"""


def _section_html(s: _Section) -> str:
    parts = [f"<section>\n<h{s.level}>{_inline_code(s.title)}</h{s.level}>"]
    parts += [f"<p>{_inline_code(p)}</p>" for p in s.paragraphs]
    if s.items:
        parts.append("<ul>" + "".join(f"<li>{_esc(item)}</li>" for item in s.items) + "</ul>")
    if s.table is not None:
        parts.append(_table_html(s.table))
    return "\n".join(parts) + "\n</section>"


def _table_html(t: _Table) -> str:
    head = "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in t.header) + "</tr>"
    rows = ["<tr>" + "".join(_cell_html(c, i in t.code_columns) for i, c in enumerate(row)) + "</tr>"
            for row in t.rows]
    return "<table>\n<thead>" + head + "</thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"


def _cell_html(cell: Cell, code: bool) -> str:
    lines = (cell,) if isinstance(cell, str) else cell
    return "<td>" + "<br>".join(f"<code>{_esc(line)}</code>" if code and not isinstance(line, _Plain) else _esc(line)
                                for line in lines) + "</td>"


def _inline_code(text: str) -> str:
    """Escape text and turn Markdown backtick spans into ``<code>`` elements."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", _esc(text))


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _figure_html(report: Report) -> str:
    if not report.groups:
        return "<p>No symmetry groups, so no graph to draw.</p>"
    graph, caption = _symmetry_graph(report)
    return (f"<section>\n<h2>Symmetry graph</h2>\n<figure>\n{_draw_svg(graph)}\n"
            f"<figcaption>{_esc(caption)}</figcaption>\n</figure>\n</section>")


# ----------------------------------------------------------------------------------------------------------------
# the symmetry graph: groups joined to the parameters they act on


def _symmetry_graph(report: Report):
    """A bipartite networkx graph of group nodes and parameter nodes, and a caption saying how it was collapsed.

    Each side keeps one node per group / parameter while there are few enough of them, and otherwise collapses
    them by layer prefix (and further, see ``_GROUP_TIERS`` and ``_PARAM_TIERS``), so the picture stays legible.
    """
    import networkx as nx

    group_tier, group_key = _tier(_GROUP_TIERS, report.groups, MAX_GROUP_NODES)
    params = [m.param for g in report.groups for m in g.members]
    param_tier, param_key = _tier(_PARAM_TIERS, params, MAX_PARAM_NODES)
    graph = nx.Graph()
    for g in report.groups:
        gnode = _add_node(graph, ("g", group_key(g)), g.id, kind=g.kind, motif=g.motif, weight=g.size * g.copies)
        for param in {m.param for m in g.members}:
            pnode = _add_node(graph, ("p", param_key(param)), param, kind="parameter")
            graph.add_edge(gnode, pnode, motif=g.motif)
    return graph, _caption(graph, group_tier, param_tier)


_GROUP_TIERS: tuple[tuple[str, Callable[[Group], str]], ...] = (
    ("one node per group", lambda g: g.id),
    ("one node per layer prefix, motif and kind", lambda g: f"{g.motif}/{g.kind} in {_layer_prefix(g.layer)}"),
    ("one node per motif and kind", lambda g: f"{g.motif}/{g.kind}"),
)
_PARAM_TIERS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("one node per parameter", lambda p: p),
    ("one node per layer prefix", lambda p: _layer_prefix(p)),
    ("one node per top-level module", lambda p: p.split(".")[0]),
)


def _tier(tiers, items, limit: int):
    """The first (description, key) of ``tiers`` giving at most ``limit`` distinct keys, else the coarsest."""
    for description, key in tiers:
        if len({key(item) for item in items}) <= limit:
            return description, key
    return tiers[-1]


def _add_node(graph, node: tuple, name: str, *, kind: str, motif: str = "", weight: int = 1) -> tuple:
    """Add ``node`` standing for ``name``, or merge ``name`` into it (``count`` and ``weight`` accumulate)."""
    if node not in graph:
        graph.add_node(node, kind=kind, motif=motif, names=set(), weight=0)
    data = graph.nodes[node]
    if name not in data["names"]:
        data["names"].add(name)
        data["weight"] += weight
    data["count"] = len(data["names"])
    return node


def _layer_prefix(name: str) -> str:
    """``a.layers.3.mlp.w`` -> ``a.layers.3``; without a layer number, the first two module levels."""
    if not name:
        return "(model)"
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[: max(1, min(2, len(parts) - 1))])


def _node_label(node: tuple, data: dict) -> str:
    noun = "parameters" if data["kind"] == "parameter" else "groups"
    return node[1] if data["count"] == 1 else f"{node[1]} ({data['count']} {noun})"


def _caption(graph, group_tier: str, param_tier: str) -> str:
    kinds = Counter(kind == "parameter" for _, kind in graph.nodes(data="kind"))
    return (f"Groups (coloured by motif, shaped by kind) joined to the parameters they act on: "
            f"{kinds[False]} group nodes ({group_tier}), {kinds[True]} parameter nodes ({param_tier}), "
            f"{graph.number_of_edges()} edges. Hover a node for its name.")


_MOTIF_COLOURS = dict(zip(MOTIFS, ("#4477aa", "#ee6677", "#aa3377", "#228833", "#ccbb44", "#66ccee", "#777777")))
_KIND_MARKERS = {"general_linear": "s", "orthogonal": "o", "rotary": "h", "permutation": "^",
                 "signed_permutation": "v", "scale": "D", "parameter": "."}


def _draw_svg(graph) -> str:
    """Draw the graph with matplotlib's SVG backend (no pyplot, no global state) and return inline SVG."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    fig, titles = _figure(graph)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "symgraph", "svg.fonttype": "none"}):
        FigureCanvasSVG(fig).print_figure(buf, format="svg", bbox_inches="tight",
                                          metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    return _add_titles(_strip_xml_header(buf.getvalue()), titles)


def _figure(graph):
    """Lay the graph out with networkx and draw it on a fresh ``Figure``; returns it and node id -> title."""
    from matplotlib.figure import Figure

    n = max(graph.number_of_nodes(), 1)
    pos = _layout(graph)
    side = min(16.0, 6.0 + 0.4 * math.sqrt(n))
    fig = Figure(figsize=(side + 2.5, side * 0.75))
    ax = fig.add_subplot()
    ax.set_axis_off()
    titles = _draw_nodes(ax, graph, pos)
    _draw_edges(ax, graph, pos)
    _draw_labels(ax, graph, pos)
    _draw_legend(ax, graph)
    return fig, titles


def _layout(graph) -> dict:
    """Spring layout (seeded, so the picture is reproducible); two columns when too big for it to be quick."""
    import networkx as nx

    n = graph.number_of_nodes()
    if n < MAX_SPRING_NODES:
        return nx.spring_layout(graph, seed=0, iterations=50, k=1.5 / math.sqrt(max(n, 1)))
    params = [node for node, kind in graph.nodes(data="kind") if kind == "parameter"]
    return nx.bipartite_layout(graph, params)


def _draw_edges(ax, graph, pos) -> None:
    from matplotlib.collections import LineCollection

    segments = [(pos[a], pos[b]) for a, b in graph.edges()]
    colours = [_MOTIF_COLOURS.get(motif, "#999999") for _, _, motif in graph.edges(data="motif")]
    ax.add_collection(LineCollection(segments, colors=colours, linewidths=0.5, alpha=0.35, zorder=1))


def _draw_nodes(ax, graph, pos) -> dict[str, str]:
    """One marker per node, each with an SVG id so it can carry a hover title; returns id -> title."""
    titles = {}
    for i, (node, data) in enumerate(graph.nodes(data=True)):
        gid = f"sgnode{i}"
        x, y = pos[node]
        ax.plot([x], [y], linestyle="none", gid=gid, zorder=2 if data["kind"] == "parameter" else 3,
                **_node_style(data))
        titles[gid] = _node_label(node, data)
    return titles


def _node_style(data: dict) -> dict:
    if data["kind"] == "parameter":
        size = 3.0 + 1.5 * math.log2(data["count"])
        return {"marker": "o", "markersize": size, "color": "#bbbbbb", "markeredgecolor": "#888888",
                "markeredgewidth": 0.3}
    size = 4.0 + 1.2 * math.log2(max(data["weight"], 1))
    return {"marker": _KIND_MARKERS.get(data["kind"], "o"), "markersize": min(size, 18.0),
            "color": _MOTIF_COLOURS.get(data["motif"], "#999999"), "markeredgecolor": "#333333",
            "markeredgewidth": 0.4}


def _draw_labels(ax, graph, pos) -> None:
    """Name parameter nodes when there are few enough of them to stay legible."""
    params = [n for n, kind in graph.nodes(data="kind") if kind == "parameter"]
    if len(params) > 60:
        return
    for node in params:
        x, y = pos[node]
        short = node[1] if graph.nodes[node]["count"] > 1 else ".".join(node[1].split(".")[-3:])
        ax.annotate(short, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=6,
                    color="#444444", zorder=4)


def _draw_legend(ax, graph) -> None:
    from matplotlib.lines import Line2D

    motifs = sorted({m for _, m in graph.nodes(data="motif") if m}, key=_motif_order)
    kinds = [k for k in _KIND_MARKERS if k in {kind for _, kind in graph.nodes(data="kind")}]
    handles = [Line2D([], [], linestyle="none", marker="o", color=_MOTIF_COLOURS.get(m, "#999999"), label=m)
               for m in motifs]
    handles += [Line2D([], [], linestyle="none", marker=_KIND_MARKERS[k], color="#bbbbbb" if k == "parameter"
                       else "#555555", label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _motif_order(motif: str) -> int:
    return MOTIFS.index(motif) if motif in MOTIFS else len(MOTIFS)


def _strip_xml_header(svg: str) -> str:
    """Drop the XML declaration and DOCTYPE, which are invalid inside an HTML page."""
    return svg[svg.index("<svg"):].strip()


def _add_titles(svg: str, titles: dict[str, str]) -> str:
    """Give every node's ``<g id=...>`` a ``<title>`` child, which browsers show on hover."""
    def add(match: re.Match) -> str:
        title = titles.get(match.group(1))
        return match.group(0) if title is None else f"{match.group(0)}<title>{_esc(title)}</title>"

    return re.sub(r'<g id="(sgnode\d+)">', add, svg)
