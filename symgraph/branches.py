"""Code paths the trace did not see: parameters a model uses only at input shapes other than the traced one.

The graph is traced at one input shape, and Python control flow on shapes (``if x.shape[1] > 8: x = x +
self.extra(x)``) runs code the trace never recorded. Groups read from that trace can change the function at the
other shapes (the residual stream moved, ``self.extra``'s weights not). :func:`check_traced_paths` runs the model at
the probe shapes (:mod:`symgraph.probes`) and refuses one that uses a parameter there that the traced graph never
reads.

Examples
--------
>>> import torch
>>> from symgraph.capture import capture
>>> class Branchy(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
...     def forward(self, x):
...         return self.b(self.a(x)) if x.shape[1] > 8 else self.a(x)
>>> model, x = Branchy(), torch.randn(2, 7, 4)
>>> check_traced_paths(capture(model, (x,)), [((x,), {}), ((torch.randn(1, 17, 4),), {})])
Traceback (most recent call last):
...
symgraph.errors.CaptureError: At input shape (arg0 1x17x4) the model uses b.bias, b.weight, which the graph traced at ...
"""
from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .capture import Capture
from .errors import CaptureError
from .module_state import attributes_kept, parameter_names

__all__ = ["check_traced_paths", "parameters_used"]

log = logging.getLogger(__name__)


# Tensor methods and properties that read a tensor's metadata, never its values: a parameter reaching only these is
# not used (Hugging Face's ``model.dtype`` asks the first parameter ``is_floating_point()`` on every call)
_METADATA = frozenset(
    [getattr(torch.Tensor, name) for name in (
        "is_floating_point", "is_complex", "dim", "ndimension", "size", "numel", "nelement", "element_size",
        "is_contiguous", "get_device", "stride", "storage_offset", "__len__")]
    + [getattr(torch.Tensor, name).__get__ for name in (
        "dtype", "device", "shape", "ndim", "layout", "is_cuda", "is_meta", "requires_grad", "is_leaf", "itemsize",
        "nbytes")])


class _ParameterUse(TorchFunctionMode):
    """Records the parameters that reach any torch function (F.linear, tensor methods, ...) but a metadata query."""

    def __init__(self, names: dict[int, frozenset[str]]):
        super().__init__()
        self.names, self.used = names, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            for leaf in tree_flatten((args, kwargs or {}))[0]:
                names = self.names.get(id(leaf))
                if names is not None:
                    self.used.add(names)
        return func(*args, **(kwargs or {}))


def parameters_used(model: torch.nn.Module, args: tuple, kwargs: dict) -> set[frozenset[str]]:
    """The parameters one forward call uses, each as the set of names it goes by (tied ones have several)."""
    mode = _ParameterUse(parameter_names(model))
    with torch.no_grad(), mode, attributes_kept(model):  # the run at a probe shape leaves the model as it was
        model(*args, **kwargs)
    return mode.used


def check_traced_paths(cap: Capture, probes: list[tuple[tuple, dict]]) -> None:
    """Raise :class:`CaptureError` when the model, run on a probe input, uses a parameter the traced graph never
    reads (``probes[0]``, the traced inputs, is skipped)."""
    from .probes import shape_summary

    read = {cap.params[n.name] for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.params
            and n.users} | cap.read_unused
    for args, kwargs in probes[1:]:
        try:
            used = parameters_used(cap.model, args, kwargs)
        except Exception as exc:  # noqa: BLE001 -- the probe ran without the recorder; no worse than no check
            log.debug("parameter use not recorded at a probe shape: %s", exc)
            continue
        unseen = sorted(min(names) for names in used if not names & read)
        if unseen:
            shown = ", ".join(unseen[:6]) + (f" and {len(unseen) - 6} more" if len(unseen) > 6 else "")
            raise CaptureError(
                f"At input shape ({shape_summary((args, kwargs))}) the model uses {shown}, which the graph traced at "
                f"({shape_summary((cap.args, cap.kwargs))}) never reads: its code branches on the input shape, and "
                f"groups read from one trace could change what it computes at the other.",
                hint="pass example inputs at a shape that takes every branch (inputs=... in Python, or return "
                     "(module, args) from the factory), or make the branch independent of the input shape.")
