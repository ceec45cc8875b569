"""What Fisher and RegMean merging need to know about one model on data.

* :func:`fisher_diagonal`: the diagonal empirical Fisher, the squared gradient of the batch loss averaged over
  batches (one gradient per batch, as the batches come).
* :func:`input_grams`: for every linear layer, the Gram matrix of its inputs ``X^T X / rows``, augmented with a
  column of ones when the layer has a bias (so the bias takes part in the regression). Padding positions
  (``attention_mask == 0``) are left out: they are not inputs the model is ever judged on.

Both run on whatever model they are given; the merge gives them the *aligned* models.

Examples
--------
>>> import torch
>>> from symgraph.datasets import Batch, Dataset
>>> model = torch.nn.Linear(3, 2)
>>> data = Dataset("toy", "classification", (Batch({"input": torch.randn(8, 3)}, torch.zeros(8).long()),))
>>> sorted(fisher_diagonal(model, data, progress=False)), tuple(input_grams(model, data, progress=False)[""].shape)
(['bias', 'weight'], (4, 4))
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .datasets import Batch, Dataset, batch_loss
from .errors import DataError, SymgraphError
from .module_state import eval_mode, gradients_on
from .progress import progress_bar


@dataclass(frozen=True)
class LinearLayer:
    """A layer computing ``x W^T + b``: where its weight and bias live in the state dict.

    ``transposed`` marks Hugging Face's ``Conv1D`` (GPT-2), which stores ``W^T`` (in, out) and computes ``x W + b``.
    """

    weight: str
    bias: str | None
    transposed: bool

    @property
    def params(self) -> tuple[str, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)


def linear_layers(model: torch.nn.Module) -> dict[str, LinearLayer]:
    """Every ``nn.Linear`` and HF ``Conv1D`` of ``model`` by module name.

    Examples
    --------
    >>> linear_layers(torch.nn.Sequential(torch.nn.Linear(2, 3, bias=False), torch.nn.ReLU()))
    {'0': LinearLayer(weight='0.weight', bias=None, transposed=False)}
    """
    conv1d = _conv1d_class()
    out = {}
    for name, module in model.named_modules():
        transposed = isinstance(module, conv1d)
        if isinstance(module, torch.nn.Linear) or transposed:
            prefix = f"{name}." if name else ""
            bias = f"{prefix}bias" if getattr(module, "bias", None) is not None else None
            out[name] = LinearLayer(f"{prefix}weight", bias, transposed)
    return out


def fisher_diagonal(model: torch.nn.Module, data: Dataset, *, progress: bool = True,
                    label: str = "model") -> dict[str, torch.Tensor]:
    """Mean over batches of the squared gradient of the mean batch loss, per parameter, in float64.

    Tied parameters get the entry under each of their names. ``model`` is used in eval mode (no dropout); its
    ``.grad`` fields are cleared afterwards.

    Examples
    --------
    >>> from symgraph.datasets import Batch, Dataset
    >>> data = Dataset("toy", "classification", (Batch({"input": torch.ones(4, 2)}, torch.zeros(4).long()),))
    >>> fisher = fisher_diagonal(torch.nn.Linear(2, 3), data, progress=False)
    >>> tuple(fisher["weight"].shape), bool((fisher["bias"] >= 0).all())
    ((3, 2), True)
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    total = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    with eval_mode(model), gradients_on(model):
        for index, batch in enumerate(progress_bar(data.batches, desc=f"fisher {label}", enabled=progress)):
            model.zero_grad(set_to_none=True)
            checked_loss(model, batch, data, index, label).backward()
            for name, p in params.items():
                if p.grad is not None:
                    total[name] += p.grad.to(torch.float64).pow(2)
        model.zero_grad(set_to_none=True)
    return {name: t / len(data.batches) for name, t in total.items()}


def input_grams(model: torch.nn.Module, data: Dataset, *, layers: dict[str, LinearLayer] | None = None,
                progress: bool = True, label: str = "model") -> dict[str, torch.Tensor]:
    """Per linear layer (by module name), the float64 Gram matrix of its inputs divided by the rows seen.

    A layer with a bias gets the augmented matrix of ``[x, 1]``. Layers whose module is never called (a weight
    used directly, as ``nn.MultiheadAttention`` does with its ``out_proj``) are absent from the result.

    Examples
    --------
    >>> from symgraph.datasets import Batch, Dataset
    >>> data = Dataset("toy", "classification", (Batch({"input": torch.eye(2)}, torch.zeros(2).long()),))
    >>> input_grams(torch.nn.Linear(2, 3, bias=False), data, progress=False)[""]
    tensor([[0.5000, 0.0000],
            [0.0000, 0.5000]], dtype=torch.float64)
    """
    layers = linear_layers(model) if layers is None else layers
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    mask: list[torch.Tensor | None] = [None]  # the current batch's attention mask, read by the hooks

    def hook(name: str, biased: bool):
        def record(_module, args, kwargs):
            x = _first_input(args, kwargs)
            if x is None:
                return
            x = _unpadded(x.detach(), mask[0]).to(torch.float64)
            if biased:
                x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
            sums[name] = sums.get(name, 0) + x.T @ x
            rows[name] = rows.get(name, 0) + x.shape[0]
        return record

    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(hook(name, layer.bias is not None), with_kwargs=True)
               for name, layer in layers.items()]
    try:
        with torch.no_grad(), eval_mode(model):
            for index, batch in enumerate(progress_bar(data.batches, desc=f"gram {label}", enabled=progress)):
                mask[0] = batch.inputs.get("attention_mask")
                checked_loss(model, batch, data, index, label)
    finally:
        for handle in handles:
            handle.remove()
    return {name: s / max(rows[name], 1) for name, s in sums.items()}


def checked_loss(model: torch.nn.Module, batch: Batch, data: Dataset, index: int, label: str) -> torch.Tensor:
    """:func:`symgraph.datasets.batch_loss`, with a failure inside the model reported as data that does not fit."""
    with data_must_fit(data, label, f"batch {index}"):
        return batch_loss(model, batch, data.task)


@contextlib.contextmanager
def data_must_fit(data: Dataset, label: str, where: str = "a batch") -> Iterator[None]:
    """Turn an exception from inside a model's forward pass into a :class:`~symgraph.errors.DataError` that says
    which data and which model did not fit together."""
    try:
        yield
    except SymgraphError:
        raise
    # AttributeError: an input the forward needs is missing (ViT's pixel_values is None when given token ids)
    except (RuntimeError, ValueError, IndexError, TypeError, KeyError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"Data '{data.name}' does not fit {label}: {where} failed in the forward pass "
            f"({type(exc).__name__}: {first}).",
            hint="use data made for this model (input names, shapes, token ids below the vocabulary size, labels "
                 "below the number of classes).") from exc


# -- helpers ---------------------------------------------------------------------------------------------------
def _first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The input of a linear layer's call: its one positional argument, or its one keyword argument (a model
    called as ``model(**batch.inputs)`` that is itself a linear layer)."""
    candidates = list(args) or list(kwargs.values())
    return candidates[0] if len(candidates) == 1 and isinstance(candidates[0], torch.Tensor) else None


def _unpadded(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` (flattened to (rows, features)), without padding positions when the mask lines up."""
    if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
        return x[mask.to(x.device) > 0]
    return x.reshape(-1, x.shape[-1])


def _conv1d_class() -> type:
    from transformers.pytorch_utils import Conv1D  # imported late: transformers takes seconds to import

    return Conv1D
