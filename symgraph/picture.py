"""The HTML report's picture: the model drawn as its layer structure, with each group over the axes it acts on.

Parameters are rows, grouped into sections along the model: what comes before the repeated blocks, each distinct
block drawn once with its repeats counted (``model.layers.*`` x 4), then what comes after. A row shows the
parameter's name and shape and, for each of its first two axes, a lane as long as the axis; every group acting
on that axis is a coloured span over the coordinates it moves (colour: motif; fill: the action, see
:data:`ACTION_STYLES`), cut at the boundaries of its copies (heads). A parameter with pinned coordinates
says why under its shape. Layers whose rows would be drawn the same are one section, so the picture's size follows
the number of distinct blocks, not the depth.

Examples
--------
>>> import symgraph, torch
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> svg = to_svg(symgraph.analyze(mlp, inputs=(torch.randn(2, 4),)))
>>> svg.startswith("<svg") and "ffn permutation 8" in svg
True
"""
from __future__ import annotations

import dataclasses
import html
import re
from dataclasses import dataclass

import numpy as np

from .groups import Group, Member, TensorMember
from .spec import motif_order
from .report import Report

__all__ = ["ACTION_STYLES", "MOTIF_COLOURS", "to_svg"]

MOTIF_COLOURS = {"qk": "#4477aa", "vo": "#ee6677", "heads": "#aa3377", "ffn": "#228833", "experts": "#ccbb44",
                 "residual": "#66ccee", "scale_free": "#777777"}  # other motifs: grey
ACTION_STYLES = {  # how a span is filled: the legend shows the same three swatches
    "primal": "solid: the slice transforms like the activation (rows of a linear layer, its bias)",
    "dual": "hatched: the slice is contracted with the activation (columns of a linear layer)",
    "permute": "dashed outline: an elementwise weight (a norm's) that only the permutation part moves",
    "swap": "upright stripes: a whole tensor that moves to another slot (a ModuleList expert's)",
}
MAX_RECTS = 128  # rectangles per span; beyond this, one rectangle per copy
WIDTH, NAME_W, LANE_W, LANE_GAP = 1360, 400, 440, 40
SPAN_H, ROW_PAD, HEADER_H = 16, 10, 30
_DIGITS = re.compile(r"(?<![^.:+])\d+(?=$|[.:+])")  # a path component that is a number (a layer or expert index)


@dataclass(frozen=True)
class Span:
    """One group acting on one axis of one parameter."""

    group: str  # the group's id with layer numbers as ``*``
    motif: str
    kind: str
    action: str
    axis: int
    rects: tuple[tuple[int, int], ...]  # [start, stop) coordinates along the axis, one per drawn piece
    label: str
    title: str


@dataclass(frozen=True)
class Row:
    name: str  # relative to the section's block prefix, numbers inside a block as ``*``
    shape: tuple[int, ...]
    spans: tuple[Span, ...]
    pinned: tuple[str, ...] = ()  # why coordinates of this parameter are pinned (report.pinned reasons)
    repeats: int = 1  # rows folded into this one (experts of an MoE block)


@dataclass(frozen=True)
class Section:
    title: str
    rows: tuple[Row, ...]


# ----------------------------------------------------------------------------------------------------------------
# from the report to sections of rows


def sections(report: Report) -> list[Section]:
    """The picture's sections, in the order their parameters appear in the model."""
    marks = _Marks(_spans_by_param(report.groups, report.parameters), _pins_by_param(report))
    pieces: list[tuple[str, int | None, str]] = []  # (block prefix, block number or None, parameter)
    for param in report.parameters:
        prefix, number = _block_of(param)
        pieces.append((prefix, number, param))
    out: list[Section] = []
    runs = _runs(pieces)
    for i, (prefix, numbers, params) in enumerate(runs):
        if numbers is None:
            out.append(Section(_outside_title(i, len(runs)), _fold(params, "", report, marks)))
            continue
        out += _block_sections(prefix, numbers, params, report, marks)
    return out


def _block_of(param: str) -> tuple[str, int | None]:
    """``model.layers.3.mlp.w`` -> (``model.layers``, 3); a name without a number -> (``""``, None)."""
    parts = param.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return "", None


def _runs(pieces):
    """Consecutive parameters of one block family (``model.layers``) or of no block, as runs."""
    runs: list[tuple[str, list[int] | None, list[str]]] = []
    for prefix, number, param in pieces:
        key_numbered = number is not None
        if runs and runs[-1][0] == prefix and (runs[-1][1] is not None) == key_numbered:
            runs[-1][2].append(param)
            if number is not None and number not in runs[-1][1]:
                runs[-1][1].append(number)
        else:
            runs.append((prefix, [number] if key_numbered else None, [param]))
    return runs


def _outside_title(position: int, runs: int) -> str:
    if runs == 1:
        return "Parameters (no repeated blocks)"
    return "Before the repeated blocks" if position == 0 else \
        "After the repeated blocks" if position == runs - 1 else "Between repeated blocks"


def _block_sections(prefix: str, numbers: list[int], params: list[str], report: Report,
                    marks: _Marks) -> list[Section]:
    """One section per distinct block; blocks whose rows are equal share it and are counted."""
    by_number: dict[int, list[str]] = {}
    for param in params:
        by_number.setdefault(_block_of(param)[1], []).append(param)
    variants: dict[tuple[Row, ...], list[int]] = {}
    for number in numbers:
        rows = _fold(by_number[number], f"{prefix}.{number}." if prefix else f"{number}.", report, marks)
        variants.setdefault(rows, []).append(number)
    return [Section(_block_title(prefix, which, len(numbers)), rows) for rows, which in variants.items()]


def _block_title(prefix: str, which: list[int], total: int) -> str:
    share = "" if len(which) == total else f" of {total}"
    return f"{prefix + '.' if prefix else ''}*   x {len(which)}{share}   (blocks {number_ranges(which)})"


def number_ranges(numbers, dash: str = "-") -> str:
    """``0-3, 8, 10-11``: consecutive runs collapsed (``dash`` joins a run's ends)."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}{dash}{b}" for a, b in runs)


@dataclass(frozen=True)
class _Marks:
    """What is drawn on each parameter: the spans of the groups acting on it, the reasons it is pinned."""

    spans: dict[str, tuple[Span, ...]]
    pins: dict[str, tuple[str, ...]]


def _fold(params: list[str], strip: str, report: Report, marks: _Marks) -> tuple[Row, ...]:
    """Rows of ``params`` named relative to ``strip``; rows equal but for an inner number (experts) fold."""
    rows: dict[Row, Row] = {}
    for param in params:
        name = _DIGITS.sub("*", param[len(strip):]) if strip else param
        row = Row(name, tuple(report.parameters[param]), marks.spans.get(param, ()), marks.pins.get(param, ()))
        rows[row] = dataclasses.replace(rows[row], repeats=rows[row].repeats + 1) if row in rows else row
    return tuple(rows.values())


def _pins_by_param(report: Report) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for pin in report.pinned:
        for param in pin.params:
            if pin.reason not in out.setdefault(param, []):
                out[param].append(pin.reason)
    return {param: tuple(reasons) for param, reasons in out.items()}


def _spans_by_param(groups: tuple[Group, ...], shapes: dict) -> dict[str, tuple[Span, ...]]:
    out: dict[str, list[Span]] = {}
    for g in groups:
        for m in g.members:
            if isinstance(m, TensorMember):  # each tensor moves whole: a span over its first axis
                for param in m.params:
                    out.setdefault(param, []).append(_whole_span(g, m, shapes[param]))
            else:
                out.setdefault(m.param, []).append(_span(g, m))
    return {param: tuple(sorted(s, key=lambda span: (span.axis, _motif_order(span.motif), span.group)))
            for param, s in out.items()}


def _span(g: Group, m: Member) -> Span:
    template = _DIGITS.sub("*", g.id)
    label = f"{g.motif} {g.kind} {g.size}" + (f" x{g.copies}" if g.copies > 1 else "")
    if g.scale and g.kind != "scale":
        label += f" +{g.scale} scale"
    if g.global_sign:
        label += " +global sign"
    title = (f"{template}: {g.motif} / {g.kind}, {g.size} x {g.copies} copies, {m.action} on axis {m.axis}"
             + (f" (blocks of {m.index.shape[2]})" if m.index.shape[2] > 1 else ""))
    return Span(template, g.motif, g.kind, m.action, m.axis, _rects(m.index), label, title)


def _whole_span(g: Group, m: TensorMember, shape: tuple[int, ...]) -> Span:
    template = _DIGITS.sub("*", g.id)
    title = f"{template}: {g.motif} / {g.kind}, {g.size} slots: the whole tensor moves with its slot ({m.role})"
    return Span(template, g.motif, g.kind, m.action, 0, ((0, shape[0] if shape else 1),),
                f"{g.motif} {g.kind} {g.size} (whole)", title)


def _rects(index: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, stop) pieces of each copy (each coordinate, when coordinates are blocks of positions)."""
    copies, size, block = index.shape
    units = index.reshape(copies * size, block) if block > 1 else index.reshape(copies, size)
    rects = [piece for unit in units for piece in _contiguous(np.sort(unit))]
    if len(rects) > MAX_RECTS:
        rects = [(int(c.min()), int(c.max()) + 1) for c in index.reshape(copies, -1)]
    return tuple(rects[:MAX_RECTS])


def _contiguous(positions: np.ndarray) -> list[tuple[int, int]]:
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(positions, breaks)]


def _motif_order(motif: str) -> int:
    return motif_order(motif)


# ----------------------------------------------------------------------------------------------------------------
# drawing: hand-written SVG, so text stays text at any zoom


def to_svg(report: Report) -> str:
    """The picture as one inline ``<svg>`` element (no external resources)."""
    parts, y = [], 28
    parts.append(_column_headers())
    for section in sections(report):
        parts.append(_section_header(section.title, y))
        y += HEADER_H
        for row in section.rows:
            drawn, height = _row(row, y)
            parts.append(drawn)
            y += height
        y += 10
    defs = "".join(_hatch(motif, colour) + _hatch(motif, colour, "stripes", 0) for motif, colour in MOTIF_COLOURS.items())
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {y}" width="{WIDTH}" height="{y}" '
            f'class="layers" role="img" aria-label="Symmetry groups over the model\'s layer structure">'
            f'<defs>{defs}</defs>{"".join(parts)}</svg>')


def _lane_x(axis: int) -> int:
    return NAME_W + min(axis, 1) * (LANE_W + LANE_GAP)


def _column_headers() -> str:
    return (f'<text x="8" y="18" class="colhead">parameter (shape)</text>'
            f'<text x="{_lane_x(0)}" y="18" class="colhead">axis 0: rows (a linear layer\'s outputs)</text>'
            f'<text x="{_lane_x(1)}" y="18" class="colhead">axis 1: columns (a linear layer\'s inputs)</text>')


def _section_header(title: str, y: int) -> str:
    return (f'<rect x="0" y="{y}" width="{WIDTH}" height="{HEADER_H - 6}" class="sechead"/>'
            f'<text x="8" y="{y + 17}" class="sectitle">{_esc(title)}</text>')


def _row(row: Row, y: int) -> tuple[str, int]:
    lanes = {0: [s for s in row.spans if s.axis == 0], 1: [s for s in row.spans if s.axis >= 1]}
    height = max(2, len(lanes[0]), len(lanes[1])) * (SPAN_H + 3) + ROW_PAD  # two lines: name and shape
    name = row.name if len(row.name) <= 46 else "..." + row.name[-43:]
    repeats = f"  x{row.repeats}" if row.repeats > 1 else ""
    parts = [f'<line x1="0" x2="{WIDTH}" y1="{y + height - 4}" y2="{y + height - 4}" class="rowline"/>',
             f'<text x="8" y="{y + 14}" class="pname"><title>{_esc(row.name)}</title>{_esc(name)}{repeats}</text>',
             _shape_line(row, y + 28)]
    for column, spans in lanes.items():
        shown = spans[0].axis if spans else column  # the second lane shows axis 2 or 3 when a group acts there
        if shown < len(row.shape):
            parts.append(_axis_bar(row.shape[shown], column, y, empty=not spans))
        for lane, span in enumerate(spans):
            length = row.shape[span.axis] if span.axis < len(row.shape) else 1
            parts.append(_span_svg(span, length, y + 2 + lane * (SPAN_H + 3)))
    return "".join(parts), height


def _shape_line(row: Row, y: int) -> str:
    """The shape, and why coordinates are pinned when they are (full reasons on hover)."""
    shape = " x ".join(map(str, row.shape)) or "scalar"
    if not row.pinned:
        return f'<text x="8" y="{y}" class="pshape">{_esc(shape)}</text>'
    note = f"{shape} · pinned: {'; '.join(row.pinned)}"
    short = note if len(note) <= 62 else note[:59] + "..."
    return (f'<text x="8" y="{y}" class="pshape"><title>{_esc(note)}</title>{_esc(shape)} · '
            f'<tspan class="pinned">{_esc(short[len(shape) + 3:])}</tspan></text>')


def _axis_bar(length: int, axis: int, y: int, *, empty: bool) -> str:
    x = _lane_x(axis)
    note = f'<text x="{x + 6}" y="{y + 14}" class="alen">no group moves this axis</text>' if empty else ""
    return (f'<rect x="{x}" y="{y + 2}" width="{LANE_W}" height="{SPAN_H}" class="axis"/>{note}'
            f'<text x="{x + LANE_W + 4}" y="{y + 14}" class="alen">{length}</text>')


def _span_svg(span: Span, length: int, y: int) -> str:
    x0, colour = _lane_x(span.axis), MOTIF_COLOURS.get(span.motif, "#999999")
    fill = {"primal": colour, "dual": f"url(#hatch-{span.motif})",
            "swap": f"url(#stripes-{span.motif})"}.get(span.action, "#ffffff")
    dash = ' stroke-dasharray="3 2"' if span.action == "permute" else ""
    edge = "#ffffff" if span.action == "primal" else colour  # white edges show where copies (heads) meet
    rects = "".join(
        f'<rect x="{x0 + LANE_W * a / length:.1f}" y="{y}" width="{max(LANE_W * (b - a) / length, 1.0):.1f}" '
        f'height="{SPAN_H}" fill="{fill}" stroke="{edge}"{dash} class="piece"/>' for a, b in span.rects)
    start = min(a for a, _ in span.rects) if span.rects else 0
    axis = f"axis {span.axis}: " if span.axis > 1 else ""
    text = f'<text x="{x0 + LANE_W * start / length + 4:.1f}" y="{y + 12}" class="slabel">{_esc(axis + span.label)}</text>'
    return f'<g class="span"><title>{_esc(span.title)}</title>{rects}{text}</g>'


def _hatch(motif: str, colour: str, name: str = "hatch", angle: int = 45) -> str:
    return (f'<pattern id="{name}-{motif}" patternUnits="userSpaceOnUse" width="6" height="6" '
            f'patternTransform="rotate({angle})"><rect width="6" height="6" fill="#ffffff"/>'
            f'<rect width="3" height="6" fill="{colour}" opacity="0.55"/></pattern>')


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)
