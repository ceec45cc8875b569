"""Analysis that does not grow with depth: analyse a shallower copy of a model whose blocks repeat, then replicate.

A decoder of ``L`` identical blocks has the same groups in every block. When a Hugging Face model's block stack
(the ``ModuleList`` of length ``config.num_hidden_layers``) repeats with a period ``p`` (1 for LLaMA; 2 for
alternating sliding-window layers), the model is rebuilt on the meta device with ``k = 3p + L mod p`` blocks: a
first period (it reads the embeddings), a middle period and a last one (it feeds the head); ``4p + L mod p`` when
the first period differs from the others (T5's relative bias lives in block 0). That copy is captured and
analysed, and each of its blocks' groups and pinned spaces is replicated onto every block of the full model that
it stands for. Models shallower than ``_MIN_DEPTH`` are analysed at full depth, as before.

What makes two blocks "the same" is checked, never assumed from the config alone: module classes, every non-tensor
attribute (an int equal to the block's own index in every block, such as ``layer_idx``, counts as the index),
parameter names, shapes and dtypes, which vector parameters hold one number (the analysis reads that of a folded
norm weight; the shallow copy's vectors are given such values), buffer values, and the block's entries in per-layer
config lists (``layer_types``). The shallow copy must match the full model on all of that block for block, and
outside the stack on parameters (and their ties), buffer values, module attributes and config fields. Alike is not
enough: a forward may decide by the block's index (``if self.layer_idx >= config.sorted_from``), so the full model
is rebuilt on the meta device and captured too (a trace of 32 LLaMA blocks takes 2.7 s where their analysis takes
39 s), and its graph must be the shallow graph unrolled, op for op (:mod:`symgraph.depth_check`). Graph node
names in the notes become the full graph's names of the same ops. Whatever cannot be replicated exactly (forward
hooks, an unknown op, a group whose name would change at full depth, a note naming a node of another block, a copy
torch.export cannot trace on the meta device) sends the model back to the full-depth analysis. The report is the
one the full-depth analysis gives (``tests/test_depth.py`` compares them on every zoo family).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from .analysis import Analysis, assemble_capture
from .analysis.walk import uniform_value
from .capture import capture
from .depth_check import NotReplicable, Unrolled, tensor_key
from .errors import CaptureError
from .groups import TensorMember

log = logging.getLogger(__name__)

_NOTE_NODE = re.compile(r"\(([A-Za-z_]\w*)\)(?= at |$)")  # "limited by: <why> (<node>)[ at <source line>]"
# config fields the shallow copy may differ in: its depth, and the dtype it was built in (parameter dtypes are
# compared one by one instead)
_NOT_COMPARED = ("num_hidden_layers", "dtype", "torch_dtype")
_MIN_DEPTH = 5  # a period-1 stack keeps 3 blocks: shallower models gain too little to be worth a second build


@dataclass(frozen=True)
class DepthPlan:
    """Which block of the shallow copy stands for each block of the full stack."""

    stack: str  # module path of the block list, e.g. "model.layers"
    depth: int  # L
    period: int  # p
    reduced: int  # k
    first_repeats: bool  # the first period equals the middle ones (else the copy keeps two middle periods)
    source: tuple[int, ...]  # full block j -> shallow block source[j]

    def shallow_to_full(self, s: int) -> int:
        """Where shallow block (or segment) ``s`` sits in the full stack when it stands for one block only."""
        return s if s < self.reduced - self.period else s + self.depth - self.reduced

    def copies_of(self, s: int) -> list[int]:
        return [j for j, r in enumerate(self.source) if r == s]


def analyse_by_repeats(subject) -> Analysis | None:
    """The full-depth :class:`~symgraph.analysis.Analysis` of ``subject`` from a shallow copy, or ``None`` when the
    model's blocks do not repeat (or the copy cannot be made or replicated exactly)."""
    try:
        shallow, plan = shallow_copy(subject.model, getattr(subject, "config", None))
    except NotReplicable as exc:
        log.info("analysing the full depth: %s", exc)
        return None
    try:
        cap = capture(shallow, subject.args, subject.kwargs)
        if not getattr(subject, "config_only", False):
            _check_constants_have_values(cap)
            _give_uniform_vectors(cap, subject.model, plan)
        analysis, assembler = assemble_capture(cap, free_outputs=getattr(subject, "free_outputs", False))
        if analysis.unknown_ops:  # refused before the full-depth capture, which would be spent for nothing
            raise NotReplicable(f"unknown ops {sorted(analysis.unknown_ops)} (their pins are not replicated)")
        return replicate(analysis, assembler.pinned_sizes, _unrolled(subject, cap, plan), subject.model)
    except CaptureError as exc:  # some models trace only with real weights; the full model is captured as given
        log.info("analysing the full depth: the shallow meta-device copy could not be captured (%s)", exc)
        return None
    except NotReplicable as exc:
        log.info("analysing the full depth: %s", exc)
        return None


def _unrolled(subject, shallow_cap, plan: DepthPlan) -> Unrolled:
    """The full model, rebuilt on the meta device and captured, checked to be the shallow graph unrolled
    (:mod:`symgraph.depth_check`): blocks that look alike may still run differently by index."""
    full_plan = dataclasses.replace(plan, reduced=plan.depth, source=tuple(range(plan.depth)))
    full = _build_shallow(subject.model, getattr(subject, "config", None), full_plan)
    # on the shallow copy's inputs, optional ones it added included: the two graphs are compared node by node
    return Unrolled(capture(full, shallow_cap.args, shallow_cap.kwargs, add_optional=False), shallow_cap, plan)


def _give_uniform_vectors(cap, model: nn.Module, plan: DepthPlan) -> None:
    """What the analysis reads of vector parameters' values (:func:`uniform_value`: a folded norm weight), which
    the meta-device copy does not hold: a shallow vector gets a real uniform tensor where the full vectors it
    stands for are uniform (the plan pairs blocks whose uniform vectors are the same; the values may differ, only
    being uniform matters), else stays meta."""
    full = dict(model.named_parameters(remove_duplicate=False))
    state = cap.program.state_dict
    for name in cap.params.values():
        if state[name].dim() != 1:
            continue
        values = [uniform_value(full.get(n)) for n in _full_names(name, plan)]
        if values and all(v is not None for v in values):
            state[name] = torch.full(state[name].shape, values[0], dtype=state[name].dtype)


def _uniform_vectors(block: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in block.named_parameters() if uniform_value(p) is not None)


def _full_names(name: str, plan: DepthPlan) -> list[str]:
    """The full model's names of the parameter the shallow copy calls ``name``."""
    inside = plan.stack + "."
    if not name.startswith(inside):
        return [name]
    block, _, rest = name[len(inside):].partition(".")
    return [f"{inside}{j}.{rest}" for j in plan.copies_of(int(block))]


def _check_constants_have_values(cap) -> None:
    """Raise :class:`NotReplicable` when the trace made tensor constants on the meta device (an index list such as
    Falcon's ``fused_qkv[..., [-2], :]`` before transformers 5.25 becomes a tensor on its operand's device): their
    values are lost there, so the shallow copy would pin what the model with weights selects by them."""
    lost = sorted(name for name in cap.buffers.values()
                  if getattr(cap.program.constants.get(name), "device", None) == torch.device("meta"))
    if lost:
        raise NotReplicable(f"tensor constants made while tracing the meta-device copy have no values "
                            f"({', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''})")


# -- the plan and the shallow copy --------------------------------------------------------------------------------
def shallow_copy(model: nn.Module, config) -> tuple[nn.Module, DepthPlan]:
    """A meta-device copy of ``model`` with fewer repeated blocks, and the plan that maps blocks back."""
    depth = getattr(config, "num_hidden_layers", None) if config is not None else None
    if not isinstance(depth, int) or depth < _MIN_DEPTH:
        raise NotReplicable(f"no Hugging Face config with num_hidden_layers >= {_MIN_DEPTH}")
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        raise NotReplicable("the model has forward hooks, which a rebuilt copy would not have")
    stacks = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    why = f"no block list of length num_hidden_layers={depth}"
    for stack in stacks:
        blocks = model.get_submodule(stack)
        prints = fingerprints(blocks, config)
        # blocks repeat only where the same vectors hold one number: the analysis reads that (a folded norm
        # weight), and the shallow copy gets it from the blocks it stands for (_give_uniform_vectors)
        plan = _periodic_plan(stack, [(p, _uniform_vectors(b)) for p, b in zip(prints, blocks)])
        if plan is None:
            why = f"the blocks of {stack} do not repeat with a period short enough to save work"
            continue
        try:
            shallow = _build_shallow(model, config, plan)
            _check_shallow(model, shallow, config, plan, prints)
        except NotReplicable as exc:  # another list of the same length may be the one the config shortens
            why = str(exc)
            continue
        return shallow, plan
    raise NotReplicable(why)


def _periodic_plan(stack: str, prints: list) -> DepthPlan | None:
    depth = len(prints)
    for period in range(1, depth // 3 + 1):
        first_repeats = prints[:period] == prints[period:2 * period]
        reduced = (3 if first_repeats else 4) * period + depth % period
        if reduced >= depth:
            continue
        source = tuple(j if j < reduced - period else
                       j - depth + reduced if j >= depth - period else
                       period + (j - period) % period for j in range(depth))
        if all(prints[j] == prints[source[j]] for j in range(depth)):
            return DepthPlan(stack, depth, period, reduced, first_repeats, source)
    return None


def fingerprints(blocks: nn.ModuleList, config) -> list[tuple]:
    """One hashable description per block: everything about it that could make its graph differ.

    An integer attribute that equals the block's own index in every block (``layer_idx``) counts as the index.
    """
    per_layer = _per_layer_fields(config, len(blocks))
    raw = [_block_attributes(block) for block in blocks]
    index_keys = set.intersection(*({key for key, v in attrs.items() if _is_int(v) and v == i}
                                    for i, attrs in enumerate(raw)))
    return [tuple(part for part in _fingerprint(block, {k: "<index>" if k in index_keys else _attribute_key(v)
                                                        for k, v in attrs.items()}))
            + (tuple((k, repr(v[i])) for k, v in per_layer.items()),)
            for i, (block, attrs) in enumerate(zip(blocks, raw))]


def _block_attributes(block: nn.Module) -> dict:
    return {(name, k): v for name, module in block.named_modules() for k, v in _attributes(module)}


def _attributes(module: nn.Module):
    return ((k, v) for k, v in vars(module).items() if not k.startswith("_") and k != "training")


def _fingerprint(block: nn.Module, attrs: dict) -> tuple:
    parts = []
    for name, module in block.named_modules():
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module.named_parameters(recurse=False))
        buffers = tuple((n, tensor_key(b)) for n, b in module.named_buffers(recurse=False))
        parts.append((name, type(module).__module__, type(module).__qualname__, params, buffers))
    return tuple(parts) + (tuple(sorted((k, v) for k, v in attrs.items())),)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _attribute_key(value):
    from transformers import PretrainedConfig

    if isinstance(value, PretrainedConfig):
        return "<config>"  # shared by every block; its per-layer lists enter the fingerprint separately
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)  # objects without a value repr show their address: blocks then differ (conservative)


def _per_layer_fields(config, depth: int) -> dict[str, list]:
    return {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == depth}


def _build_shallow(model: nn.Module, config, plan: DepthPlan) -> nn.Module:
    from .io import _parameters_on_meta

    small = copy.deepcopy(config)
    small.num_hidden_layers = plan.reduced
    for key, value in _per_layer_fields(config, plan.depth).items():
        setattr(small, key, type(value)(value[:plan.reduced]))
    dtype = next((p.dtype for p in model.parameters()), None)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        with _parameters_on_meta():
            shallow = type(model)._from_config(small, **kwargs)
    except Exception as exc:  # any failure to rebuild just means: analyse the full depth
        raise NotReplicable(f"could not rebuild {type(model).__name__} with {plan.reduced} blocks: {exc}") from exc
    _tie_like(shallow, model, plan.stack)
    return shallow.eval()


def _tie_like(shallow: nn.Module, model: nn.Module, stack: str) -> None:
    """Tie the copy's parameters as the model's are tied (a meta-device build leaves the LM head untied)."""
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied_to = first_name.setdefault(id(param), name)
        if tied_to == name:
            continue
        if name.startswith(stack + ".") or tied_to.startswith(stack + "."):
            raise NotReplicable(f"{name} is tied to {tied_to} across the block list")
        owner, _, leaf = name.rpartition(".")
        setattr(shallow.get_submodule(owner), leaf, shallow.get_parameter(tied_to))


def _check_shallow(model, shallow, config, plan: DepthPlan, full_prints: list) -> None:
    """The shallow copy must be the full model with blocks left out, and nothing else changed."""
    try:
        blocks = shallow.get_submodule(plan.stack)
    except AttributeError as exc:
        raise NotReplicable(f"the shallow copy has no {plan.stack}") from exc
    if len(blocks) != plan.reduced:
        raise NotReplicable(f"the shallow copy has {len(blocks)} blocks in {plan.stack}, not {plan.reduced}")
    small_prints = fingerprints(blocks, shallow.config)
    if any(full_prints[j] != small_prints[s] for j, s in enumerate(plan.source)):
        raise NotReplicable("the shallow copy's blocks differ from the blocks they stand for")
    if _outside(model, plan.stack) != _outside(shallow, plan.stack) or \
            not _same_modules_outside(model, shallow, plan):
        raise NotReplicable("the shallow copy differs outside the block list")
    for key, value in vars(config).items():
        depth_field = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
        if key not in _per_layer_fields(config, plan.depth) and key not in _NOT_COMPARED + (depth_field,) \
                and not _same_setting(value, vars(shallow.config).get(key)):
            raise NotReplicable(f"config field {key!r} differs in the shallow copy")


def _same_setting(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==: compare their reprs
        return repr(a) == repr(b)


def _outside(model: nn.Module, stack: str) -> tuple:
    """Parameters and buffers outside the stack, and which parameter each name is tied to (tied embeddings)."""
    inside = stack + "."
    first_name: dict[int, str] = {}
    params = []
    for n, p in model.named_parameters(remove_duplicate=False):
        tied_to = first_name.setdefault(id(p), n)
        if not n.startswith(inside) or not tied_to.startswith(inside) or tied_to != n:
            params.append((n, tuple(p.shape), str(p.dtype), tied_to))
    buffers = tuple((n, tensor_key(b)) for n, b in model.named_buffers(remove_duplicate=False)
                    if not n.startswith(inside))
    return tuple(params), buffers


def _same_modules_outside(model: nn.Module, shallow: nn.Module, plan: DepthPlan) -> bool:
    """Modules outside the stack have the same classes and attributes; one that holds the depth (DistilBERT's
    ``n_layers``) holds the copy's depth in the copy."""
    def modules(m):
        inside = plan.stack + "."
        return {n: (type(x), dict(_attributes(x))) for n, x in m.named_modules()
                if n != plan.stack and not n.startswith(inside)}

    full, small = modules(model), modules(shallow)
    if full.keys() != small.keys():
        return False
    for name, (cls, attrs) in full.items():
        small_cls, small_attrs = small[name]
        if cls is not small_cls or attrs.keys() != small_attrs.keys():
            return False
        for key, value in attrs.items():
            other = small_attrs[key]
            holds_depth = _is_int(value) and _is_int(other) and (value, other) == (plan.depth, plan.reduced)
            if not holds_depth and _attribute_key(value) != _attribute_key(other):
                return False
    return True


# -- replication --------------------------------------------------------------------------------------------------
def replicate(analysis: Analysis, pinned_sizes: dict, names: Unrolled, model: nn.Module) -> Analysis:
    """The shallow ``analysis`` carried onto every block of the full stack (see the module docstring);
    ``pinned_sizes`` counts each pinned space's coordinates per parameter; ``names`` gives the full graph's node
    names (the analysis has no unknown ops: their pins are not replicated)."""
    plan = names.plan
    rename = _Renamer(plan)
    groups = []
    for g in analysis.groups:
        blocks = {rename.block_of(p) for p in g.params}
        if len(blocks) == 1 and None not in blocks:
            (s,) = blocks
            groups += [_moved_group(g, s, j, rename, names) for j in plan.copies_of(s)]
        else:
            groups.append(_spread_group(g, rename, names))
    if len({g.id for g in groups}) != len(groups):
        raise NotReplicable("replicated groups would share ids (a block's group not named after its block)")
    pinned = _replicate_pins(analysis.pinned, pinned_sizes, rename, names)
    params = _full_parameters(analysis.params, model, rename, plan)
    # free outputs name spread groups (the residual stream), whose ids do not change
    return Analysis(groups, pinned, {}, params, analysis.free_outputs, analysis.fixed_outputs,
                    _replicate_why(analysis.why_unmoved, rename))


def _replicate_why(why_unmoved: dict[str, str], rename: _Renamer) -> dict[str, str]:
    """Each unmoved parameter of a repeated block's reason carried onto its copies (the reason names the shallow
    graph's nodes)."""
    out = {}
    for param, why in why_unmoved.items():
        s = rename.block_of(param)
        for j in [None] if s is None else rename.plan.copies_of(s):
            out[param if j is None else rename.move(param, s, j)] = why
    return out


class _Renamer:
    """Move parameter names, group ids and layers from one block of the stack to another."""

    def __init__(self, plan: DepthPlan):
        self.plan = plan
        self._block = re.compile(rf"^{re.escape(plan.stack)}\.(\d+)(?:\.|$)")

    def block_of(self, param: str) -> int | None:
        m = self._block.match(param)
        return int(m.group(1)) if m else None

    def move(self, text: str, s: int, j: int) -> str:
        pattern = rf"(?<![\w.]){re.escape(self.plan.stack)}\.{s}(?=$|[.:+])"
        return re.sub(pattern, f"{self.plan.stack}.{j}", text)

    def mentions_block(self, text: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(self.plan.stack)}\.\d+(?=$|[.:+])", text) is not None


def _renamed_notes(notes, rename_node) -> tuple[str, ...]:
    out = []
    for note in notes:
        m = _NOTE_NODE.search(note)
        out.append(note[:m.start(1)] + rename_node(m.group(1)) + note[m.end(1):] if m else note)
    return tuple(out)


def _moved_group(g, s: int, j: int, rename: _Renamer, names: Unrolled):
    if j == s:
        return g
    members = tuple(_moved_member(m, lambda name: rename.move(name, s, j)) for m in g.members)
    return dataclasses.replace(
        g, id=rename.move(g.id, s, j), layer=rename.move(g.layer, s, j), members=members,
        links=tuple(rename.move(link, s, j) for link in g.links),
        notes=_renamed_notes(g.notes, lambda node: names.full_name(node, s, j)))


def _moved_member(m, move):
    """``m`` with its tensor names moved by ``move``."""
    if isinstance(m, TensorMember):
        return dataclasses.replace(m, slots=tuple(tuple(move(p) for p in row) for row in m.slots))
    return dataclasses.replace(m, param=move(m.param))


def _spread_group(g, rename: _Renamer, names: Unrolled):
    """A group whose members lie in several blocks (the residual stream): every block's members, in every copy."""
    from .analysis.naming import common_prefix, short_members

    if rename.mentions_block(g.id) or any(rename.mentions_block(link) for link in g.links):
        raise NotReplicable(f"group {g.id} spans blocks but is named after one")
    if g.swaps_tensors:
        raise NotReplicable(f"group {g.id} moves whole tensors of several blocks")
    key = lambda m: (m.param, m.axis, m.action, m.exponent)  # noqa: E731  the order every emitter sorts by
    if list(g.members) != sorted(g.members, key=key):
        raise NotReplicable(f"group {g.id} lists its members in an order that cannot be extended")
    members = []
    for m in g.members:
        s = rename.block_of(m.param)
        targets = [None] if s is None else rename.plan.copies_of(s)
        members += [m if t is None or t == s else dataclasses.replace(m, param=rename.move(m.param, s, t))
                    for t in targets]
    members.sort(key=key)
    if common_prefix([m.param for m in members]) != g.layer:
        raise NotReplicable(f"group {g.id} would change its layer at full depth")
    if short_members(members) != short_members(g.members):  # a member named after its block (Doge's
        raise NotReplicable(f"group {g.id} would change its name at full depth")  # layers.0.input_residual)
    return dataclasses.replace(g, members=tuple(members), notes=_renamed_notes(g.notes, names.embedded))


def _replicate_pins(pinned, pinned_sizes: dict, rename: _Renamer, names: Unrolled) -> list:
    out = []
    for pin in pinned:
        blocks = {rename.block_of(p) for p in pin.params}
        if blocks == {None}:
            out.append(dataclasses.replace(pin, node=names.embedded(pin.node) if pin.node else pin.node))
        elif len(blocks) == 1:
            (s,) = blocks
            out += [pin if j == s else dataclasses.replace(
                pin, params=tuple(sorted(rename.move(p, s, j) for p in pin.params)),
                node=names.full_name(pin.node, s, j) if pin.node else pin.node) for j in rename.plan.copies_of(s)]
        else:
            out.append(_spread_pin(pin, pinned_sizes[(pin.reason, pin.node)], rename, names))
    return sorted(out, key=lambda p: (p.reason, p.node))


def _spread_pin(pin, sizes: dict[str, int], rename: _Renamer, names: Unrolled):
    """A pinned space over several blocks (the residual stream of a model whose output is the hidden state)."""
    spread: dict[str, int] = {}
    for param, size in sizes.items():
        s = rename.block_of(param)
        for j in [None] if s is None else rename.plan.copies_of(s):
            spread[param if j is None else rename.move(param, s, j)] = size
    return dataclasses.replace(pin, params=tuple(sorted(spread)), size=sum(spread.values()),
                               node=names.embedded(pin.node) if pin.node else pin.node)


def _full_parameters(params: dict, model: nn.Module, rename: _Renamer, plan: DepthPlan) -> dict:
    """The full model's parameter shapes, in the order the shallow analysis lists parameters (block by block)."""
    out = {}
    for name, shape in params.items():
        s = rename.block_of(name)
        if s is None:
            out[name] = shape
            continue
        for j in plan.copies_of(s):
            out[rename.move(name, s, j)] = shape
    full = dict(model.named_parameters(remove_duplicate=False))
    if any(tuple(full[n].shape) != tuple(shape) for n, shape in out.items() if n in full):
        raise NotReplicable("replicated parameter shapes differ from the model's")
    order = {n: i for i, n in enumerate(full)}
    return dict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))
