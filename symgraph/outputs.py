"""Free outputs: model outputs whose basis may move with the residual stream (``--free-outputs``).

A base model or sentence encoder returns hidden states, so by default the output pins the residual stream and
nothing can align it. With free outputs, an output that is exactly a residual read (one channel, varying along one
axis, every element one coordinate of the stream: hidden states, or a final norm of them) is not pinned; the
analysis instead ties it to a *virtual* vector, as if a bias-like parameter sat at the output, and restricts its
coordinates to isometries (no per-coordinate scale survives, so cosine similarities of embeddings are kept). The
group that then reaches the virtual vector is the transformation ``T`` of that output: the model's output becomes
``T y``. Only the residual-stream group may reach an output; any other (a pooler's units behind a ``tanh``, a
vocabulary axis of logits) makes the analysis pin that output again, as without the option.

The virtual members are taken out of the groups (no state dict holds them) and kept as :class:`FreeOutput`
records; verification applies the same elements to an identity matrix along the virtual member and undoes ``T``
on the model's output before comparing, so every check stays exact.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .groups import FreeOutput

VIRTUAL = "<output>"  # prefix of the virtual parameters tied to free outputs; no state dict key starts with it


def output_names(cap) -> list[str]:
    """A name per flattened output of the captured program (``last_hidden_state``, ``hidden_states.2``, ``0``)."""
    spec = cap.program.call_spec.out_spec
    if spec is None:
        return []
    return _path_names(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))


def _path_names(tree) -> list[str]:
    """A name per leaf of ``tree``: its path's keys joined by dots, or its position where the path is empty."""
    return [".".join(str(_key(k)) for k in path) or str(i)
            for i, (path, _) in enumerate(pytree.tree_flatten_with_path(tree)[0])]


def _key(entry):
    """A path entry's plain name: a mapping key, a sequence index or an attribute name."""
    for field in ("key", "idx", "name"):
        if hasattr(entry, field):
            return getattr(entry, field)
    return entry


def virtual_name(output: str) -> str:
    return f"{VIRTUAL}{output}"


def is_virtual(param: str) -> bool:
    return param.startswith(VIRTUAL)


def output_transforms(free: tuple[FreeOutput, ...], elements) -> dict[int, torch.Tensor]:
    """Output index -> the matrix ``T`` (float64) that ``elements``, applied in order, multiply that output by."""
    from .elements import Element, apply

    out = {}
    for f in free:
        acting = [Element(dataclasses.replace(e.group, members=(f.member,)), e.matrices, e.perm, e.diag)
                  for e in elements if e.group.id == f.group]
        if acting:
            size = int(f.member.index.size)
            eye = {f.member.param: torch.eye(size, dtype=torch.float64)}
            out[f.index] = apply(eye, acting)[f.member.param]
    return out


def leaf_names(out, leaves: int) -> list[str] | None:
    """A name per flattened leaf of a model's output at run time, as :func:`output_names` names the captured
    program's (None where the two flattenings disagree in length)."""
    names = _path_names(out)
    return names if len(names) == leaves else None


def undo(leaves: list, free: tuple[FreeOutput, ...], transforms: dict[int, torch.Tensor],
         names: list[str] | None = None) -> list:
    """``leaves`` with ``T^{-1}`` applied to each free output along its axis (the outputs of the original model,
    if the transformed one is sound). ``names`` (:func:`leaf_names`) find each free output by its name: where an
    output holds a list per image (Llava's ``pooler_output``), another batch size moves the leaves after it."""
    out = list(leaves)
    for f in free:
        t = transforms.get(f.index)
        if t is None:
            continue
        if names is not None and f.name not in names:
            continue  # not output at this input (one image fewer)
        at = f.index if names is None else names.index(f.name)
        y = out[at].to(torch.float64).movedim(f.axis, -1)
        out[at] = torch.linalg.solve(t, y.unsqueeze(-1)).squeeze(-1).movedim(-1, f.axis)
    return out


def describe(free: tuple[FreeOutput, ...], groups) -> list[dict]:
    """The report's ``free_outputs`` entries: which output, along which axis, under which group."""
    kinds = {g.id: g for g in groups}
    return [{"output": f.name, "index": f.index, "axis": f.axis, "group": f.group,
             "kind": kinds[f.group].kind if f.group in kinds else None,
             "size": int(np.asarray(f.member.index).size)} for f in free]
