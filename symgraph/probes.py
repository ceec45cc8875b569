"""Inputs of more than one shape for the float64 checks, derived from the example inputs alone.

The graph is traced at one input shape, so a mistake that only shows at another shape (a position table sliced
by sequence length, a batch-dependent reshape, padding, a branch taken only for short inputs or a single row) is
invisible there. :func:`probe_inputs` returns the example inputs plus up to two variants that between them cover
batch size 1 and more than 1, a longer and a shorter length, and padding:

* **single row, longer**: batch size 1 (the first row of every tensor that shares the first tensor's batch size);
  every other axis size grown to ``2 n + 3`` (a long axis by ``64 + n // 8 + 3`` only: an image's sides grown to
  twice would make an attention over its patches sixteen times as costly), one size at a time (all axes of that
  size together, so ``input_ids`` and ``attention_mask`` grow as one);
* **more rows, shorter, padded**: one more row; every other axis size above 2 cut to ``n // 2 + 1`` (a prefix);
  an ``attention_mask`` whose first row masks its last third, where the model takes one beside ``input_ids``.

Sizes the model rejects (feature widths, fixed image sizes, mel bins) stay as they are. Grown tensors keep the
original as a prefix; new integer entries are drawn from the values the original holds (token ids stay clear of
special tokens, a mask of ones stays ones), new float entries from its mean and spread. Which changes a model
accepts is found by running it: all of a variant's changes at once first, and one at a time only when that
fails; a change it rejects (an error, or no finite output at all) is left out. Whatever a run changes on the
model's modules (an attribute set from the input's shape) is put back after it. Whether a model takes some inputs
is asked once per model, inputs and weights (the report's checks and the walk's both ask it for the same probes).
"""
from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .depth_check import tensor_key
from .module_state import attributes_kept

__all__ = ["every_probe", "lengthened_inputs", "probe_inputs", "shape_summary", "shortest_inputs"]

log = logging.getLogger(__name__)

Inputs = tuple[tuple, dict]
Change = Callable[[Inputs, torch.Generator], Inputs]
_ANSWERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def probe_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, seed: int = 0, *, padding: bool = True,
                 accepts: Callable[[Inputs], bool] | None = None) -> list[Inputs]:
    """``[(args, kwargs), ...]``: the example inputs first, then the variants the model accepts any change for.

    ``padding=False`` leaves the attention mask out of the changes (shapes change, nothing else does).
    ``accepts(inputs)`` decides which inputs the model takes (default: it runs on them with some finite output; a
    model on the meta device cannot run, so a caller may trace instead).

    Examples
    --------
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> probes = probe_inputs(mlp, (torch.randn(2, 7, 4),), {})
    >>> [tuple(a[0].shape) for a, _ in probes]
    [(2, 7, 4), (1, 17, 4), (3, 4, 4)]
    """
    original = (tuple(args), dict(kwargs))
    tensors = _tensors(original)
    if not tensors:
        return [original]
    batch, sizes = tensors[0].shape[0], {n for t in tensors for n in t.shape[1:]}
    longer = ([_shrink_batch(batch)] if batch > 1 else []) + [
        _grow_size(n) for n in sorted((n for n in sizes if n > 1), reverse=True)]  # a grown size is not regrown
    shorter = [_grow_batch(batch)] + [_shrink_size(n) for n in sorted(n for n in sizes if n > 2)]
    if padding and "input_ids" in original[1] and "attention_mask" in _parameters(model):
        shorter.append(_pad)
    accepts = accepts or (lambda inputs: runs(model, inputs))
    variants = [_variant(accepts, original, changes, seed) for changes in (longer, shorter)]
    return [original] + [v for v in variants if v is not None]


def shortest_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, seed: int = 0, *,
                    accepts: Callable[[Inputs], bool] | None = None) -> list[Inputs]:
    """The inputs with every axis but the batch cut to length 1, and to length 2 (prefixes), for each that the
    model accepts (sizes it rejects stay). Where the model's structure depends on a length affinely (a cut at a
    fixed place beside activations of that length, a chunk in halves), what holds at one long and one short
    probe may still fail at the shortest lengths, where the place crosses into learned tokens.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> [tuple(a[0].shape) for a, _ in shortest_inputs(mlp, (torch.randn(2, 7, 4),), {})]
    [(2, 1, 4), (2, 2, 4)]
    """
    original = (tuple(args), dict(kwargs))
    sizes = {n for t in _tensors(original) for n in t.shape[1:]}
    accepts = accepts or (lambda inputs: runs(model, inputs))
    variants = [_variant(accepts, original, [_shrink_size(n, to=length) for n in sorted(sizes) if n > length], seed)
                for length in (1, 2)]
    return [v for v in variants if v is not None]


def every_probe(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[Inputs]:
    """The inputs every float64 check and the branch check run at: :func:`probe_inputs`, then
    :func:`shortest_inputs` (a fast path for one token, or a cut that crosses into learned tokens, shows only
    there)."""
    return probe_inputs(model, args, kwargs) + shortest_inputs(model, args, kwargs)


def _variant(accepts: Callable[[Inputs], bool], original: Inputs, changes: list[Change], seed: int) -> Inputs | None:
    """The inputs with every change the model accepts; ``None`` when it accepts none."""
    if not changes:
        return None
    variant = _apply(changes, original, seed)
    if accepts(variant):
        return variant
    accepted = [c for c in changes if accepts(_apply([c], original, seed))]
    if not accepted:
        return None
    variant = _apply(accepted, original, seed)
    return variant if accepts(variant) else _apply(accepted[:1], original, seed)  # each alone, not together


def shape_summary(inputs: Inputs) -> str:
    """The tensor shapes of one probe, for reports: ``input_ids 3x17, attention_mask 3x17``.

    Examples
    --------
    >>> shape_summary(((torch.zeros(2, 4),), {"mask": torch.ones(2, 4)}))
    'arg0 2x4, mask 2x4'
    """
    args, kwargs = inputs
    named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return ", ".join(f"{name} {'x'.join(map(str, t.shape))}" for name, t in named if isinstance(t, torch.Tensor))


def _tensors(inputs: Inputs) -> list[torch.Tensor]:
    tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    return tensors if tensors and tensors[0].dim() else []


def _apply(changes: list[Change], inputs: Inputs, seed: int) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    for change in changes:
        inputs = change(inputs, generator)
    return inputs


def _grow_batch(batch: int) -> Change:
    def change(inputs, generator):
        return tree_map(lambda t: _grow(t, 0, batch + 1, generator)
                        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t, inputs)
    return change


def lengthened_inputs(args: tuple, kwargs: dict, size: int, to: int, seed: int = 0) -> Inputs:
    """The inputs with every axis but the batch of length ``size`` grown to ``to`` (token ids and their mask as
    one), the originals a prefix, new entries drawn as for the probes.

    >>> ids = torch.tensor([[5, 6, 7]])
    >>> _, kw = lengthened_inputs((), {"input_ids": ids, "attention_mask": torch.ones(1, 3)}, 3, 8)
    >>> tuple(kw["input_ids"].shape), kw["input_ids"][0, :3].tolist(), set(kw["input_ids"].flatten().tolist())
    ((1, 8), [5, 6, 7], {5, 6, 7})
    >>> kw["attention_mask"].sum().item()
    8.0
    """
    return _apply([_grow_size(size, to)], (tuple(args), dict(kwargs)), seed)


def _grow_size(size: int, to: int | None = None) -> Change:
    def grown(t, generator):
        if isinstance(t, torch.Tensor):
            for axis in range(1, t.dim()):
                if t.shape[axis] == size:
                    t = _grow(t, axis, _longer_size(size) if to is None else to, generator)
        return t

    return lambda inputs, generator: tree_map(lambda t: grown(t, generator), inputs)


def _longer_size(size: int) -> int:
    """The longer probe's length for an axis of ``size``: ``2 size + 3``, but a long axis grows by a part of it.

    >>> [_longer_size(n) for n in (1, 17, 73, 512, 864)]
    [5, 37, 149, 643, 1039]
    """
    return size + min(size, 64 + size // 8) + 3


def _shrink_batch(batch: int) -> Change:
    def change(inputs, generator):
        return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t,
                        inputs)
    return change


def _shrink_size(size: int, to: int | None = None) -> Change:
    def shrunk(t):
        if isinstance(t, torch.Tensor):
            for axis in range(1, t.dim()):
                if t.shape[axis] == size:
                    t = t.narrow(axis, 0, size // 2 + 1 if to is None else to)
        return t

    return lambda inputs, generator: tree_map(shrunk, inputs)


def _pad(inputs: Inputs, generator) -> Inputs:
    """An ``attention_mask`` (the given one, or ones) whose first row masks its last third."""
    del generator
    args, kwargs = inputs
    ids = kwargs["input_ids"]
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None or mask.shape != ids.shape else mask.clone()
    length = ids.shape[-1]
    mask[0, length - max(1, length // 3):] = 0
    return args, {**kwargs, "attention_mask": mask}


def _grow(t: torch.Tensor, axis: int, size: int, generator: torch.Generator) -> torch.Tensor:
    extra_shape = list(t.shape)
    extra_shape[axis] = size - t.shape[axis]
    if t.is_floating_point():
        spread = float(t.double().std()) if t.numel() > 1 else 1.0
        extra = float(t.double().mean()) + spread * torch.randn(extra_shape, generator=generator,
                                                                 dtype=torch.float64)
    else:
        values = torch.unique(t)
        extra = values[torch.randint(len(values), extra_shape, generator=generator)]
    return torch.cat([t, extra.to(device=t.device, dtype=t.dtype)], dim=axis)


def runs(model, inputs: Inputs) -> bool:
    """Whether the model takes ``inputs`` and gives some finite output: entries masked with -inf are compared as
    a pattern (:func:`symgraph.verify.relative_change`), but outputs with no finite value, or no value at all,
    can check nothing. Found once per model, inputs and tensor versions (an in-place write asks anew)."""
    key = (_fingerprint(inputs), tuple((id(t), t._version) for t in (*model.parameters(), *model.buffers())))
    answers = _ANSWERS.setdefault(model, {})
    if key not in answers:
        answers[key] = _runs_now(model, inputs)
    return answers[key]


def forget_runs(model) -> None:
    """Forget what :func:`runs` found for ``model``: it runs otherwise from now on (its float32 casts kept in
    float64: :class:`symgraph.verify.Float64Casts`)."""
    _ANSWERS.pop(model, None)


def _fingerprint(inputs: Inputs) -> tuple:
    """Inputs as a key: each tensor's shape, dtype and a hash of its values; anything else as its repr."""
    leaves, spec = tree_flatten(inputs)
    return str(spec), tuple(tensor_key(t) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


def _runs_now(model, inputs: Inputs) -> bool:
    args, kwargs = inputs
    try:
        with torch.no_grad(), attributes_kept(model):  # a probe leaves no setting it made behind (Swin's window)
            out = model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- any failure means "not a shape this model takes"
        log.debug("probe shape rejected by %s: %s", type(model).__name__, exc)
        return False
    leaves = tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)[0]
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return bool(floats) and all(bool(t.isfinite().any()) for t in floats)  # all empty (length 1 split off): none


def _parameters(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
