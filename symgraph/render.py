"""Human renderings of a :class:`~symgraph.report.Report`: Markdown, and one self-contained HTML page.

Both renderings are built from the same list of sections (title, paragraphs, bullet items, one table), so they
always carry the same content; the HTML page adds a picture of the model's layer structure with every group
drawn over the axes it acts on (:mod:`symgraph.picture`), as inline SVG, with no external resources.

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
import re
from dataclasses import dataclass
from typing import Callable, Union

from .errors import SymgraphError
from .groups import Group, Member, PinnedSpace, TensorMember
from .spec import motif_order
from .report import Report, solver_for

__all__ = ["render", "to_html", "to_markdown"]

MAX_MEMBERS = 16  # members listed per group before "+N more"
MAX_PINNED_PARAMS = 4  # parameter names listed per pinned space before "+N more"

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
        A title, a summary table, how to read the report (actions, kinds, motifs), one table of groups per
        layer, the pinned spaces and the report's notes.

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
        The Markdown content as HTML tables, plus a picture of the model's layer structure: one row per
        parameter, repeated blocks drawn once and counted, each group a span over the axes it acts on, coloured
        by motif, filled by action.

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
    sections = [_summary_section(report), _reading_section()]
    sections += [_layer_section(layer, groups) for layer, groups in _groups_by_layer(report.groups)]
    sections.append(_pinned_section(report.pinned))
    if report.unmoved:
        sections.append(_unmoved_section(report.unmoved))
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
    if report.unmoved:
        rows.insert(-3, ("in no group and not pinned", f"{len(report.unmoved)} tensors (section 'In no group')"))
    return _Section("Summary", table=_Table(("quantity", "value"), tuple(rows)))


ACTION_TEXT = {
    "primal": "the slice transforms like the activation it makes, X -> T X along its axis (a linear layer's "
              "output rows and its bias).",
    "dual": "the slice is contracted with that activation, X -> T^-T X (a linear layer's input columns), so "
            "the product is unchanged.",
    "permute": "a vector multiplied elementwise into the activation (a norm's weight): only the permutation part "
               "of T moves it; signs and scales pass through to the activation.",
    "swap": "whole tensors (one per expert of an nn.ModuleList) that the permutation moves between slots: slot j "
            "receives the tensor of the slot T maps to it.",
}
KIND_TEXT = {
    "general_linear": "GL(n): any invertible n x n matrix per copy.",
    "orthogonal": "O(n): rotations and reflections (T^T T = I) per copy.",
    "rotary": "what RoPE allows: per frequency pair a 2-D rotation times a positive scale; GL on the dimensions "
              "RoPE leaves alone.",
    "permutation": "reorders the n coordinates (hidden units, heads); '+ positive scale' adds one positive factor "
                   "per coordinate.",
    "signed_permutation": "a permutation with a sign flip per coordinate ('global sign': one sign for all).",
    "scale": "one factor per coordinate (positive, nonzero or a sign, as noted).",
}
MOTIF_TEXT = {
    "qk": "query and key of each head: q . k is unchanged.",
    "vo": "value and output projection of each head.",
    "heads": "which head is which: whole heads swap places.",
    "experts": "which expert is which: whole experts swap places, with the router rows that choose them.",
    "ffn": "the hidden units of a feed-forward layer.",
    "residual": "the residual stream that every block reads and writes.",
    "scale_free": "a scale that a normalisation divides out again.",
    "other": "a space no named motif covers.",
}


def _reading_section() -> _Section:
    items = (tuple(f"{name} (action): {text}" for name, text in ACTION_TEXT.items())
             + tuple(f"{name} (kind): {text}" for name, text in KIND_TEXT.items())
             + tuple(f"{name} (motif): {text}" for name, text in MOTIF_TEXT.items()))
    text = ("A group acts on 'copies' independent blocks of 'size' coordinates (one block per attention head or "
            "KV group); each member is a parameter axis it moves, with an action. Any element T of the group, "
            "applied to every member, leaves the model's function unchanged.",)
    return _Section("How to read this report", paragraphs=text, items=items)


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


def _member_text(m: Member | TensorMember, layer: str) -> str:
    if isinstance(m, TensorMember):
        name = m.role[len(layer) + 1:] if layer and m.role.startswith(layer + ".") else m.role
        return f"{name} (whole tensors, {len(m.slots[0])} slots) {m.action}"
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
    from .picture import number_ranges

    return number_ranges(values, dash="..") or "none"


def _pinned_section(pinned: tuple[PinnedSpace, ...]) -> _Section:
    if not pinned:
        return _Section("Pinned", paragraphs=("No coordinates are pinned.",))
    rows = tuple((p.reason, _node_text(p), _params_text(p.params), str(p.size)) for p in pinned)
    text = ("Coordinates no transformation may touch, and why.",)
    return _Section("Pinned", paragraphs=text, table=_Table(("reason", "node", "params", "size"), rows, (1, 2)))


def _unmoved_section(unmoved) -> _Section:
    rows = tuple((u.param, u.reason) for u in unmoved)
    text = ("Parameters that no group moves and no pinned space names, with the reason the analysis found.",)
    return _Section("In no group", paragraphs=text, table=_Table(("param", "reason"), rows, (0,)))


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

_CSS = """body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 88em;
  padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top;
  overflow-wrap: break-word; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.95em; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; margin-top: 0.4em; }
.scroll { overflow-x: auto; } svg.layers { max-width: 100%; height: auto; }
svg.layers text { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; }
svg.layers .colhead { font-size: 13px; font-weight: 600; fill: #444; }
svg.layers .sechead { fill: #eef1f5; } svg.layers .sectitle { font-size: 14px; font-weight: 600; fill: #223; }
svg.layers .pname { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; fill: #222; }
svg.layers .pshape { font-size: 11px; fill: #777; } svg.layers .pinned { fill: #b04a00; } svg.layers .alen { font-size: 11px; fill: #888; }
svg.layers .axis { fill: #f6f6f6; stroke: #ddd; } svg.layers .rowline { stroke: #eee; }
svg.layers .piece { stroke-width: 1; } svg.layers .span:hover .piece { stroke-width: 2.5; }
svg.layers .slabel { font-size: 11px; font-weight: 600; fill: #111; paint-order: stroke; stroke: #fff;
  stroke-width: 3px; stroke-linejoin: round; pointer-events: none; }
.legend { display: flex; flex-wrap: wrap; gap: 0.5em 3em; font-size: 0.9em; margin: 0.5em 0 1em; line-height: 1.7; }
.chip, .swatch { display: inline-block; width: 2.2em; height: 0.9em; margin-right: 0.5em; vertical-align: -0.1em;
  border: 1px solid #555; }
.swatch.primal { background: #555; }
.swatch.dual { background: repeating-linear-gradient(45deg, #555 0 3px, #fff 3px 6px); }
.swatch.permute { background: #fff; border-style: dashed; }
.swatch.swap { background: repeating-linear-gradient(90deg, #555 0 4px, #fff 4px 8px); }"""


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
    return "<td>" + "<br>".join(f"<code>{_breakable(line)}</code>" if code and not isinstance(line, _Plain)
                                else _esc(line) for line in lines) + "</td>"


def _breakable(text: str) -> str:
    """Escaped code with a line-break opportunity after each separator, so long ids wrap inside their column."""
    return re.sub(r"([.:+_/,])", r"\1<wbr>", _esc(text))


def _inline_code(text: str) -> str:
    """Escape text and turn Markdown backtick spans into ``<code>`` elements."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", _esc(text))


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _figure_html(report: Report) -> str:
    from .picture import to_svg

    if not report.groups:
        return "<p>No symmetry groups, so no picture to draw.</p>"
    return (f"<section>\n<h2>The model and its symmetry groups</h2>\n<figure>\n{_legend_html(report)}\n"
            f"<div class=\"scroll\">{to_svg(report)}</div>\n<figcaption>{_esc(_CAPTION)}</figcaption>\n"
            f"</figure>\n</section>")


_CAPTION = ("One row per parameter, in model order; repeated blocks are drawn once and counted (x N). Each lane "
            "is one axis of the parameter, as long as the axis; a coloured span marks the coordinates a group "
            "moves, cut where its copies (heads) meet. Hover a span for the group's id.")


def _legend_html(report: Report) -> str:
    from .picture import ACTION_STYLES, MOTIF_COLOURS

    motifs = sorted({g.motif for g in report.groups}, key=motif_order)
    chips = "".join(f'<span class="chip" style="background:{MOTIF_COLOURS.get(m, "#999999")}"></span>'
                    f"<b>{_esc(m)}</b> {_esc(MOTIF_TEXT.get(m, ''))}<br>" for m in motifs)
    actions = "".join(f'<span class="swatch {a}"></span><b>{a}</b>: {_esc(text)}<br>'
                      for a, text in ACTION_STYLES.items())
    return f'<div class="legend"><div>{chips}</div><div>{actions}</div></div>'
