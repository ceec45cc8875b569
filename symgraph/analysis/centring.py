"""A LayerNorm written out: ``x - mean(x)`` over the last axis, recognised in the graph.

Centring commutes with an orthogonal map Q of that axis exactly when Q 1 = +-1: the analysis reads such a
difference as the channel itself under that restriction (rather than a per-row statistic added to every
coordinate, which only permutations keep), and :mod:`symgraph.fold` folds the norm around it as a LayerNorm."""
from __future__ import annotations

from torch import fx


def centred_input(node) -> fx.Node | None:
    """``x`` where ``node`` is ``x - mean(x)`` over ``x``'s last axis (the mean kept as an axis of size one)."""
    if not (isinstance(node, fx.Node) and str(node.target) == "aten.sub.Tensor" and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1):
        return None
    x, mean = node.args
    return x if isinstance(mean, fx.Node) and _last_axis_mean_of(mean, x) else None


def is_centring_mean(node: fx.Node) -> bool:
    """``node`` is the last-axis mean of its input, read by nothing but ``input - node``."""
    return (str(node.target) == "aten.mean.dim" and _last_axis_mean_of(node, node.args[0]) and bool(node.users)
            and all(centred_input(user) is node.args[0] for user in node.users))


def _last_axis_mean_of(mean: fx.Node, x) -> bool:
    if str(mean.target) != "aten.mean.dim" or mean.args[0] is not x or mean.kwargs.get("dtype") is not None:
        return False
    keepdim = len(mean.args) > 2 and bool(mean.args[2]) or bool(mean.kwargs.get("keepdim", False))
    rank = len(getattr(x.meta.get("val"), "shape", ()))
    dims = mean.args[1] if len(mean.args) > 1 else None
    return keepdim and rank > 0 and dims is not None and [d % rank for d in dims] == [rank - 1]
