"""Activation-based alignment costs: match each group on the activations that carry its coordinates.

The analysis labels every graph value with the coordinate ids it carries (:mod:`symgraph.analysis.labels`); ids
tied by the graph form classes (here without product ties: the factors of ``x * w`` share a permutation, not a
scale), and a group's coordinates are classes. A value whose features carry the classes of a group's coordinates
moves under that group as a parameter slice does: ``x -> T x`` (primal) or ``x -> T^{-T} x`` (dual), since the
model's function is unchanged. It is then a *site* of the group: a member whose "parameter" is the value,
features on axis 0 and the recorded positions (examples x tokens) on axis 1. A value is used only if every group
reaching its classes can say where its coordinates sit in it; otherwise a group would move it unseen.

Recording runs the exported program (made to return the sites' values) on a few batches of data, once with
each model's weights. The sites then stand in for the weights: :func:`symgraph.alignment.align_states` solves the
*site groups* (same ids, kinds and sizes, members = sites) with the weight-matching solvers on the centred
activations (every site scaled to unit norm): Hungarian on cross-covariances for permutations, Procrustes on
them for orthogonal and rotary maps. The elements found are elements of the real groups and are applied to the
weights, so the result is an exact reparametrisation of the source whatever the data. Groups with no site, and
scales, are then solved on weight costs.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import fx

from .capture import Capture, capture
from .datasets import Batch
from .errors import CaptureError, DataError, SymgraphError
from .groups import Group, Member, TensorMember

DATA_MODE = "full+data"  # the alignment mode barrier and merge name for full mode with activation costs
SKIPPED_RULES = ("movement", "identity")  # their values repeat their input's (layout, dtype, sign): no new evidence
SITE_PREFIX = "@"  # site keys are graph node names behind this prefix: they can never clash with parameter names
# examples per recorded forward pass, and so in the graph whose sites are sought: some graphs label every position
# apart, and seeking the sites of lara_mini's at 64 tokens took 12 s for one example, 102 s for 8, 362 s for 32
# (two, not one: a size of one can trace a different graph)
RUN_EXAMPLES = 2


@dataclass
class Recording:
    """Centred activations of both models at every site, features first: ``(features, positions)`` float64."""

    sites: dict[str, list[Member]]  # group id -> its sites (members keyed by SITE_PREFIX + node name)
    source: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]

    def site_groups(self, groups) -> list[Group]:
        """The groups that have sites, with the sites as members (ids unchanged)."""
        return [replace(g, members=tuple(self.sites[g.id])) for g in groups if self.sites.get(g.id)]


def record(source, anchor, groups, data, *, batches: int = 4, max_positions: int = 4096,
           use=None, max_nodes: int | None = None) -> Recording:
    """Run ``batches`` batches of ``data`` (a :class:`symgraph.datasets.Dataset`) through ``source`` and
    ``anchor`` (Subjects of one architecture) and keep the activations at the sites of ``groups`` (only of the
    groups whose ids are in ``use``, when given; all groups still decide which values are sites).

    Batches run :data:`RUN_EXAMPLES` examples at a time where every input leads with the examples' axis (a batch
    whole otherwise), and runs of one input shape share a capture; at most ``max_positions`` positions per site
    are kept (evenly spaced over those recorded), and a site with fewer features than positions is stored in a
    basis of its rows (:func:`_compressed`: the same costs, less memory). A capture of more than ``max_nodes``
    graph nodes is refused before its sites are sought: a recurrence traced step by step grows with the input's
    length, and finding the sites of its graph at 128 tokens took RecurrentGemma 197 s against 0.4 s for the
    alignment."""
    if batches < 1 or max_positions < 2:
        raise SymgraphError(f"Activation costs need at least one batch and two positions per site (got {batches} "
                            f"batches, {max_positions} positions).", hint="pass --data-batches 1 or more.")
    by_shape: dict[tuple, list] = defaultdict(list)
    for batch in data.batches[:batches]:
        for run in _runs(batch, RUN_EXAMPLES):
            by_shape[_signature(run)].append(run)
    rows = {"source": defaultdict(list), "anchor": defaultdict(list)}
    sites: dict[str, list[Member]] | None = None
    anchor_state = anchor.state_dict()
    for same in by_shape.values():
        cap = _capture_on(source, same[0], data)
        if max_nodes is not None and len(cap.graph.nodes) > max_nodes:
            raise SymgraphError(f"Activations of '{data.name}' are not recorded: at its input shape the graph of "
                                f"{type(source.model).__name__} has {len(cap.graph.nodes)} nodes, more than "
                                f"{max_nodes} (it grows with the input's length: a recurrence traced step by step).",
                                hint="record on shorter examples, or align on weights.")
        found, views = group_sites(cap, groups)
        if use is not None:
            found = {gid: members for gid, members in found.items() if gid in use}
            keys = {m.param for members in found.values() for m in members}
            views = {key: view for key, view in views.items() if key in keys}
        sites = found if sites is None else sites
        if _site_layout(found) != _site_layout(sites):  # another input shape traced differently: not comparable
            continue
        recorder = _recorder(cap, views)
        for batch in same:
            for who, state in (("source", None), ("anchor", anchor_state)):
                for node, x in _run(cap, recorder, batch, state, views, data, f"the {who}").items():
                    rows[who][node].append(x)
    src, anc = _finish(rows["source"], max_positions), _finish(rows["anchor"], max_positions)
    for key, x in anc.items():  # every site weighs the same (the stream's norm grows with depth): one scalar
        scale = 1.0 / max(float(x.norm()), 1e-300)   # for both models, so the groups act on them alike
        src[key], anc[key] = _compressed(src[key] * scale, x * scale)
    return Recording(sites or {}, src, anc)


def _compressed(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x Q, y Q)`` for an orthonormal basis ``Q`` of the span of both row sets: every cost the solvers read
    (``X Y^T``, ``X X^T``, norms) is unchanged, and group elements act on rows, so they commute with it. Made from
    the rows' Gram matrix ``G = U S^2 U^T``: with ``Q`` the right singular vectors, the rows in it are ``U S``
    (half the time of a QR of the positions: 2 x 256 rows of 4096 positions, one thread, 0.196 -> 0.093 s)."""
    if x.shape[1] <= 2 * x.shape[0]:
        return x, y
    rows = torch.cat([x, y])
    # rows of unit norm first: each inner product then keeps its own relative precision (features' scales differ
    # by orders of magnitude), not one relative to the largest
    norms = rows.norm(dim=1, keepdim=True).clamp(min=torch.finfo(rows.dtype).tiny)
    unit = rows / norms
    values, vectors = torch.linalg.eigh(unit @ unit.T)
    in_basis = norms * vectors * values.clamp(min=0).sqrt()  # rounding can leave a null direction a little below 0
    return in_basis[:len(x)], in_basis[len(x):]


def group_sites(cap: Capture, groups) -> tuple[dict[str, list[Member]], dict[str, tuple[str, tuple[int, ...]]]]:
    """Group id -> the graph values that carry its coordinates, as members keyed ``@node.axes`` (see the module
    docstring); and per key, the node and its feature axes (those its labels vary along, in member order)."""
    from .analysis.partition import parity_classes
    from .analysis.walk import walk

    walker = walk(cap)  # the analysis's own walk: parameters it read as data carry no coordinates here either
    # without product ties: the factors of an elementwise product share a coordinate's permutation but not its
    # scale (x * w moves with w's scale too), so a product is a site only through its own ids
    cls, parity, _ = parity_classes(walker.ids.next, walker.c.ties, keep=lambda product: not product)
    by_class: dict[int, list[_Layout]] = defaultdict(list)
    for layout in filter(None, (_Layout.of(g, walker.param_ids, cls, parity) for g in groups)):
        for k in layout.classes:
            by_class[k].append(layout)
    sites: dict[str, list[Member]] = defaultdict(list)
    views: dict[str, tuple[str, tuple[int, ...]]] = {}
    for node in cap.graph.nodes:
        for ids, axes in _feature_ids(walker, node):
            key = f"{SITE_PREFIX}{node.name}" + "".join(f".{a}" for a in axes)
            feature_cls = cls[ids]
            layouts = {id(x): x for k in np.unique(feature_cls) for x in by_class.get(int(k), ())}
            members = {layout.group.id: layout.site(key, ids, feature_cls, parity) for layout in layouts.values()}
            if members and None not in members.values():  # a group moving it unseen would corrupt the others' costs
                for gid, member in members.items():
                    sites[gid].append(member)
                views[key] = (node.name, axes)
    return dict(sites), views


# -- which coordinates a value carries -------------------------------------------------------------------------------
@dataclass
class _Layout:
    """Where a group's coordinates sit: id or class -> (copy, coordinate, slot), and each class's orientation.

    An id names one parameter coordinate exactly (a linear's output carries its weight's row ids); a class is
    used for ids no member owns, when it names one coordinate of the group only (the query heads of one KV
    group share their classes, since each contracts with the same key coordinates)."""

    group: Group
    by_id: dict[int, tuple[int, int, int]]
    by_class: dict[int, tuple[int, int, int]]
    flip: dict[int, int]

    @classmethod
    def of(cls_, g: Group, param_ids, cls, parity) -> "_Layout | None":
        by_id, by_class, flip, owners = {}, {}, {}, defaultdict(set)
        for m in g.members:
            if isinstance(m, TensorMember) or m.action == "permute" or m.axis not in param_ids.get(m.param, {}):
                continue  # whole tensors have no coordinates an activation could carry
            ids = param_ids[m.param][m.axis].numpy()[m.index]  # (copies, size, block)
            code = 1 if m.action == "dual" else 0
            for (c, j, b), i in np.ndenumerate(ids):
                k = int(cls[i])
                by_id.setdefault(int(i), (c, j, b))
                by_class.setdefault(k, (c, j, b))
                owners[k].add((c, j))
                flip.setdefault(k, int(parity[i]) ^ code)
        by_class = {k: v for k, v in by_class.items() if len(owners[k]) == 1}
        return cls_(g, by_id, by_class, flip) if by_id else None

    @property
    def classes(self):
        """Every class a member reaches, one coordinate's or several's: a value carrying any of them may move."""
        return self.flip.keys()

    def site(self, key: str, ids: np.ndarray, feature_cls: np.ndarray, parity) -> Member | None:
        """The member for one value's features (``ids``: one per feature), or None when the value does not carry
        every coordinate of the group the same number of times with one orientation."""
        g = self.group
        where = []
        for f, (i, k) in enumerate(zip(ids.tolist(), feature_cls.tolist())):
            slot = self.by_id.get(i) or self.by_class.get(k)
            if slot is not None:
                where.append((slot, f))
        actions = {int(parity[ids[f]]) ^ self.flip[int(feature_cls[f])] for _, f in where}
        if not where or len(actions) != 1:
            return None
        per = defaultdict(list)
        for (c, j, b), f in sorted(where):
            per[(c, j)].append(f)
        counts = {len(v) for v in per.values()}
        if len(per) != g.copies * g.size or len(counts) != 1:
            return None
        index = np.array([[per[(c, j)] for j in range(g.size)] for c in range(g.copies)], dtype=np.int64)
        return Member(key, 0, index, "dual" if actions.pop() else "primal")


def _feature_ids(walker, node: fx.Node) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """Per clean channel of a value: the coordinate ids of its features (the axes the labels vary along,
    flattened in order) and those axes. None for values that only repeat their input, parameter views, mixed
    (RoPE) or squared channels. A value may carry several (a token axis labelled by position embeddings)."""
    from .analysis.labels import Value, varying_axes

    value = walker.values.get(node.name)
    if node.op != "call_function" or not isinstance(value, Value) or value.invariant or not value.chans:
        return []
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not all(isinstance(n, int) for n in val.shape):
        return []  # a size known only at run time (the tokens routed to one expert): other positions in each model
    spec = walker.specs.op(str(node.target))
    if spec is not None and spec.rule in SKIPPED_RULES:
        return []
    out = []
    for chan in value.chans:
        if chan.mixed or chan.weight or chan.block or chan.degree != 1:
            continue
        axes = tuple(sorted(varying_axes(chan.ids)))
        if axes:
            first = tuple(slice(None) if a in axes else 0 for a in range(chan.ids.dim()))
            out.append((chan.ids[first].reshape(-1).numpy(), axes))
    return out


def _site_layout(sites: dict[str, list[Member]]) -> dict:
    return {gid: [(m.param, m.index.shape, m.action) for m in members] for gid, members in sites.items()}


# -- recording -------------------------------------------------------------------------------------------------------
def _runs(batch: Batch, examples: int) -> list[Batch]:
    """``batch``'s inputs cut into runs of ``examples`` examples, the last one ending at its last example (so it
    may repeat a few of the one before: every run has one shape); ``[batch]`` when it holds no more examples than
    that or not every input leads with the examples' axis (an image grid listed per image)."""
    sizes = {v.shape[0] if v.dim() else None for v in batch.inputs.values()}
    count = next(iter(sizes)) if len(sizes) == 1 else None
    if count is None or count <= examples:
        return [batch]
    return [Batch({k: v[start:start + examples] for k, v in batch.inputs.items()})
            for start in (min(first, count - examples) for first in range(0, count, examples))]


def _signature(batch) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.inputs.items()))


def _forward_kwargs(model, batch) -> dict:
    from .inputs import without_cache

    return {**batch.inputs, **without_cache(getattr(model, "config", None))}


def _capture_on(subject, batch, data) -> Capture:
    try:
        # the data's own inputs: the run feeds the graph these (the groups were found on the subject's capture)
        return capture(subject.model, (), _forward_kwargs(subject.model, batch), add_optional=False)
    except CaptureError as exc:
        raise DataError(f"Data '{data.name}' does not fit the source: its first examples "
                        f"({', '.join(f'{k} {tuple(v.shape)}' for k, v in batch.inputs.items())}) cannot run "
                        f"through the model ({exc.message})",
                        hint="use data made for this model (input names, shapes, token ids below the vocabulary "
                             "size).") from exc


def _recorder(cap: Capture, views: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[fx.GraphModule, list[str]]:
    """The captured graph made to return the values of the sites' nodes, and their names: generated code, where
    an fx Interpreter runs node by node in Python on every run of a few examples."""
    wanted = sorted({node for node, _ in views.values()})
    graph, copied = fx.Graph(), {}
    graph.graph_copy(cap.program.graph_module.graph, copied)  # every node but the output
    by_name = {node.name: new for node, new in copied.items()}
    graph.output(tuple(by_name[name] for name in wanted))
    return fx.GraphModule(cap.program.graph_module, graph), wanted


def _run(cap: Capture, recorder: tuple[fx.GraphModule, list[str]], batch, state,
         views: dict[str, tuple[str, tuple[int, ...]]], data, who: str) -> dict[str, torch.Tensor]:
    """Site key -> (features, positions) on ``batch`` (``views``: key -> node and feature axes; ``recorder``:
    :func:`_recorder` of them), with ``state``'s weights (None: the captured model's own)."""
    from .statistics import data_must_fit

    program = cap.program
    flat = list(program._graph_module_flat_inputs((), _forward_kwargs(cap.model, batch)))
    if state is not None:
        names = {**cap.params, **cap.buffers}
        placeholders = [n.name for n in cap.graph.nodes if n.op == "placeholder"]
        flat = [state[names[p]].to(x.dtype) if names.get(p) in state else x for p, x in zip(placeholders, flat)]
    module, wanted = recorder
    with torch.no_grad(), data_must_fit(data, who, "recording activations"):
        seen = dict(zip(wanted, module(*flat)))
    return {key: _by_features(seen[node], axes) for key, (node, axes) in views.items()}


def _by_features(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """``x`` as (features, positions): ``axes`` flattened in order, every other axis a position."""
    rest = [a for a in range(x.dim()) if a not in axes]
    features = int(np.prod([x.shape[a] for a in axes]))
    return x.permute(*axes, *rest).reshape(features, -1)  # in the model's dtype until thinned (memory)


def _finish(rows: dict[str, list[torch.Tensor]], max_positions: int) -> dict[str, torch.Tensor]:
    """Each site's batches joined, thinned to ``max_positions`` evenly spaced positions, and centred in float64."""
    out = {}
    for node, parts in rows.items():
        x = torch.cat(parts, 1)
        if x.shape[1] > max_positions:
            x = x[:, torch.linspace(0, x.shape[1] - 1, max_positions).round().long()]
        x = x.to(torch.float64)
        out[node] = x - x.mean(1, keepdim=True)
    return out


# -- alignment -------------------------------------------------------------------------------------------------------
DATA_GROUPS = {"residual": ("residual",), "all": None}  # which groups take activation costs: motifs (None: all)
# Scales are fitted on weights: activations show only their primal side (a unit's output, not the columns that
# read it), and a scale fitted to that alone drifts freely (independent llama pair, all groups: distance 13).
WEIGHT_ONLY_KINDS = ("scale",)


def data_cost_groups(groups, data_groups: str = "residual") -> list[Group]:
    """The groups ``data_groups`` lets take activation costs (those with sites will)."""
    if data_groups not in DATA_GROUPS:
        raise SymgraphError(f"Unknown data groups {data_groups!r}.", hint=f"choose one of {', '.join(DATA_GROUPS)}.")
    motifs = DATA_GROUPS[data_groups]
    return [g for g in groups if (motifs is None or g.motif in motifs) and g.kind not in WEIGHT_ONLY_KINDS]


def align_on_activations(groups, source: dict, anchor: dict, recording: Recording, *, data_groups: str = "residual",
                         **options):
    """Align ``source`` to ``anchor`` within ``groups``: first the groups ``data_groups`` names that have sites,
    on ``recording``'s activations; then the others on weight costs, with the first ones held where the
    activations put them (coarse first: the residual stream, then the groups inside each block given it).
    ``options`` go to :func:`symgraph.alignment.align_states` (mode, rescale, rounds, tolerance, progress,
    cost_excluded).

    ``residual`` (the default) takes only the residual stream from activations: on the shipped pairs that gave
    the lowest barriers (vit-digits 1.52 against 4.22 with every group, llama-chars 1.64 against 2.41);
    ``all`` takes every group with a site but scales. Returns an :class:`~symgraph.alignment.AlignResult` whose
    ``costs`` say which cost each group used."""
    from .alignment import align_states, relative_distance
    from .elements import apply

    observed = recording.site_groups(data_cost_groups(groups, data_groups))
    real = {g.id: g for g in groups}
    by_data = align_states(observed, recording.source, recording.anchor, **options)
    elements = [replace(e, group=real[e.group.id]) for e in by_data.elements]
    moved = apply(source, elements)
    seen = {g.id for g in observed}
    stats = [replace(s, stage=f"activations {s.stage}") for s in by_data.stats]
    timings = {f"activations_{k}": v for k, v in by_data.timings.items()}
    rest = [g for g in groups if g.id not in seen]
    if rest:
        by_weight = align_states(rest, moved, anchor, **options)
        moved, elements = by_weight.state, elements + by_weight.elements
        stats += by_weight.stats
        timings.update(by_weight.timings)
    costs = {g.id: "activations" if g.id in seen else "weights" for g in groups}
    return replace(by_data, state=moved, elements=elements, stats=stats, timings=timings, costs=costs,
                   distance_before=relative_distance(source, anchor), distance_after=relative_distance(moved, anchor))
