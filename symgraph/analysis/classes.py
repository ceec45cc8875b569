"""Value classes: which positions of an invariant tensor are known to hold equal values.

A routing mask built per group of experts and broadcast to the experts (DeepSeek-V3's group-limited routing:
``mask.unsqueeze(-1).expand(..., n_group, per_group).reshape(..., n_experts)``) is invariant, but it still varies
along the expert axis. A ``where`` on it commutes with permutations that never move an expert to a position
holding another mask value: within the routing groups. The classes say where those positions are.

The classes of a value are an integer tensor of its shape: positions with equal entries hold equal values. They
start at a broadcast (every input position its own class, repeated along the broadcast axes) and pass through
movement ops (replayed on the class tensor) and elementwise maps of one tensor.
"""
from __future__ import annotations

import torch
from torch import fx

from ..spec import aten_op
from .labels import Value, collapse_pair, concrete_shape

_ELEMENTWISE_OF_ONE = frozenset({"identity", "activation"})  # output position i reads input position i only


def passed_classes(node: fx.Node, spec, inputs: list[Value]) -> torch.Tensor | None:
    """The classes of ``node``'s output, from its one tensor input; None when unknown."""
    if spec is None or len(node.all_input_nodes) != 1 or len(inputs) != 1 \
            or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    source = inputs[0]
    if spec.rule in _ELEMENTWISE_OF_ONE:
        return source.classes
    if spec.rule != "movement" or node.args[0] is not node.all_input_nodes[0]:
        return None
    classes = source.classes
    if classes is None and spec.broadcasts and source.shape is not None:
        shape = concrete_shape(source.shape)
        classes = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape)
    if classes is None:
        return None
    try:
        return node.target(classes, *node.args[1:], **node.kwargs)
    except RuntimeError:
        if spec.replay_as:  # an expanded tensor is not viewable: reshape copies instead
            return aten_op(spec.replay_as)(classes, *node.args[1:], **node.kwargs)
        return None


def blocks_kept_by(ids: torch.Tensor, classes: torch.Tensor, axes: frozenset[int]) -> torch.Tensor | None:
    """Rows of ids (blocks x ids per block) a ``where`` with a condition of these ``classes`` keeps apart.

    Coordinates whose condition is equal at every position they occupy (for every value of the other axes) may
    permute among themselves: the condition at a coordinate's new position is the one it had. Returns a single
    row when the condition never tells coordinates apart, and None when no such blocks exist (the labels vary
    along the other axes, or the blocks differ in size): then the coordinates must be pinned.
    """
    ids, classes = collapse_pair(ids, classes)
    rest = [a for a in range(ids.dim()) if a not in axes]
    order = [*rest, *sorted(axes)]
    width = 1
    for a in axes:
        width *= ids.shape[a]
    ids = ids.permute(*order).reshape(-1, width)
    classes = classes.permute(*order).reshape(-1, width)
    if bool((ids != ids[:1]).any()) or bool((ids < 0).any()) or len(torch.unique(ids[0])) != width:
        return None
    _, block = torch.unique(classes.T, dim=0, return_inverse=True)
    counts = torch.bincount(block)
    if bool((counts != counts[0]).any()):
        return None
    return ids[0][torch.argsort(block, stable=True)].reshape(len(counts), -1)
