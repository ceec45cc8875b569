"""Float64 verification block by block, for models whose float64 copy does not fit in memory.

:class:`symgraph.verify.Evaluator` runs a float64 copy of the whole model: 56 GB at 7B. Here the model is built on
the meta device from its config, the tensors outside its block list (embeddings, final norm, head) are read in
float64, and each block's tensors are read from the safetensors checkpoint just before the block runs and dropped
right after it (forward hooks), so the peak holds the outside tensors, one block and the activations. Both models
run on the same example inputs, one after the other; the outputs are compared as the Evaluator compares them.

Examples
--------
>>> import tempfile, symgraph
>>> from symgraph import zoo
>>> from symgraph.io import model_config, save_model
>>> model = zoo.build("llama", seed=0)
>>> a = save_model(model.state_dict(), tempfile.mkdtemp() + "/a", config=model_config(model))
>>> b = save_model(symgraph.transform(model, seed=1), tempfile.mkdtemp() + "/b", config=model_config(model))
>>> outcome = verify_streamed(a, b)
>>> outcome.ok, outcome.relative_error < 1e-5
(True, True)
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from .errors import MismatchError
from .io import all_finite, nonfinite_error
from .lazy_state import ConvertedState, LazyState, ReadThrough, UntiedState, check_same_tensors
from .moe import REFERENCE, use_experts_implementation
from .verify import (TOLERANCE, Outcome, RoundedExact, _cast_inputs, _LowestFloat, flat_outputs, float64_default,
                     relative_change, rounding_distance)

__all__ = ["check_one_architecture", "verify_streamed", "streamed_outputs"]


def verify_streamed(source, other, inputs=None, exact=None, untied: dict[str, str] | None = None) -> Outcome:
    """Do the safetensors checkpoints ``source`` and ``other`` (Hugging Face folders of one architecture) compute
    the same outputs? Each runs in float64, block by block (see the module docstring), on ``inputs`` (example
    inputs built from the config when None); the relative error of ``other``'s outputs against ``source``'s is
    compared with a tolerance for the lowest precision computed or stored (bf16 weights widen it).

    ``exact`` (what ``other``'s tensors are the rounding of: a mapping read a block at a time, such as
    :class:`symgraph.streamed_align.ExactResult`): where a bf16/fp16 ``other`` misses the tolerance, it passes if
    ``exact`` computes what ``source`` computes (within what the model computes in) and every tensor of ``other``
    lies within :data:`~symgraph.verify.ROUNDINGS` roundings of ``exact``'s (:class:`~symgraph.verify.RoundedExact`):
    a sensitive model's rounding is then told from a change of function.

    ``untied``: names ``other`` stores that ``source`` ties and does not store (an LM head given its own tensor
    by a streamed fold) -> the stored name of ``source`` they tie to; each model runs as its own config builds it.
    """
    check_one_architecture(source, other, untied)
    with _LowestFloat() as seen:
        reference = streamed_outputs(source, inputs)
    outputs = streamed_outputs(other, inputs)
    if outputs.shape != reference.shape:
        raise MismatchError(f"'{source}' and '{other}' give outputs of different sizes ({reference.numel()} vs "
                            f"{outputs.numel()} values).", hint="compare models of one architecture.")
    written = LazyState(other)
    stored = {info.dtype for state in (LazyState(source), written) for info in state.infos()}
    tolerance = max(TOLERANCE[seen.lowest], *(TOLERANCE[d] for d in stored if d in TOLERANCE))
    error = relative_change(outputs, reference)
    low = {info.dtype for info in written.infos()} & {torch.bfloat16, torch.float16}
    if error <= tolerance or exact is None or not low:
        return Outcome(error, tolerance)
    written = ConvertedState(written, _layout(other))  # the model's names, as ``exact`` has them
    compared = _Compared(exact, written)  # each tensor compared as the model reads it: every part computed once
    exact_error = relative_change(streamed_outputs(source, inputs, state=compared), reference)
    unread = [k for k in written if k not in compared.distances]  # tensors the model has no parameter for
    rest = rounding_distance(written, exact, sorted(unread, key=getattr(exact, "part_of", lambda _: 0)))
    roundings = max([*compared.distances.values(), rest], key=lambda d: d[0])
    return Outcome(error, tolerance, RoundedExact(exact_error, TOLERANCE[seen.lowest], *roundings))


class _Compared(ReadThrough):
    """``exact`` read through, each tensor's :func:`~symgraph.verify.rounding_distance` from ``written``'s kept
    in ``distances`` on its first read."""

    def __init__(self, exact, written: LazyState):
        self.state, self.written, self.distances = exact, written, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.state[name]
        if name not in self.distances:
            self.distances[name] = rounding_distance({name: self.written[name]}, {name: value})
        return value


def check_one_architecture(source, other, untied: dict[str, str] | None = None) -> None:
    """Refuse two checkpoints of different model classes, or whose tensors differ in name or shape
    (:func:`~symgraph.lazy_state.check_same_tensors`; ``other`` may also store ``untied``'s names, as
    :func:`verify_streamed` says), naming what differs (their outputs would differ, but not because of their
    weights)."""
    kinds = [_model_class(f) for f in (source, other)]
    if None in kinds:
        return
    if kinds[0] != kinds[1]:
        raise MismatchError(f"'{source}' is a {kinds[0]} and '{other}' a {kinds[1]}: they are different "
                            "architectures.", hint="compare two checkpoints of one architecture (an aligned, folded "
                                                   "or merged model against its source).")
    check_same_tensors(UntiedState(LazyState(source), untied or {}), LazyState(other), f"'{source}' and '{other}'",
                       hint="compare two checkpoints of one configuration.")


def _model_class(folder) -> str | None:
    """The model class a Hugging Face folder's config.json names (or its model_type); None without a config.json
    (loading the folder then says what is wrong)."""
    from .checkpoint import _config_of

    config = _config_of(Path(folder))
    if config is None:
        return None
    return next(iter(config.get("architectures") or ()), None) or f"{config.get('model_type', 'unknown')} model"


def streamed_outputs(folder, inputs=None, state=None) -> torch.Tensor:
    """The flattened float64 outputs of the model at ``folder`` on ``inputs``, its weights read block by block
    (from ``state``, a mapping keyed by the model's names with ``info``, when given)."""
    from .api import _inputs_for
    from .checkpoint import StoredLayout
    from .inputs import in_some_form
    from .io import load_model

    loaded = load_model(Path(folder), config_only=True)
    # experts by transformers' reference loop, as the in-memory check runs them (grouped_mm has no float64 kernel)
    model = use_experts_implementation(loaded.model, REFERENCE).to(torch.float64)
    if state is None:
        state = ConvertedState(LazyState(folder), StoredLayout(loaded.model))
    args, kwargs = _inputs_for(model, loaded.config, inputs)
    names = _checkpoint_names(model, state, folder)
    blocks = _block_list(model, loaded.config)
    outside = [n for n in names if not any(n.startswith(f"{prefix}.") for prefix in blocks)]
    _materialise(model, {n: names[n] for n in outside}, state, folder)
    with contextlib.ExitStack() as hooks:
        for prefix, block in blocks.items():
            own = {n: names[n] for n in names if n.startswith(f"{prefix}.")}
            hooks.enter_context(_streamed_block(model, block, own, state))
        with torch.no_grad(), float64_default():  # as the in-memory check runs (XGLM's constants overflow float32)
            def outputs(form):
                args64, kwargs64 = _cast_inputs(args, form, torch.float64)
                return flat_outputs(model(*args64, **kwargs64))

            # inputs built from the config that the code cannot run on: the other forms symgraph.load tries
            return in_some_form(kwargs, outputs, others=inputs is None)[0]


def _layout(folder):
    """How the checkpoint at ``folder`` stores its model's tensors (:class:`~symgraph.checkpoint.StoredLayout`)."""
    from .checkpoint import StoredLayout
    from .io import load_model

    return StoredLayout(load_model(Path(folder), config_only=True).model)


def _checkpoint_names(model: nn.Module, state, folder) -> dict[str, str]:
    """Model parameter -> the name ``state`` (keyed by the model's names) holds it by: its own, or for a tied
    parameter another of its tie (a tied LM head may be stored under either name)."""
    from .checkpoint import _declared_ties

    partners: dict[str, list[str]] = {}
    for tied, source in _declared_ties(model).items():
        partners.setdefault(tied, []).append(source)
        partners.setdefault(source, []).append(tied)
    names = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        key = next((k for k in (name, *partners.get(name, ())) if k in state), None)
        if key is None:
            raise MismatchError(f"The checkpoint '{folder}' has no tensor '{name}', which "
                                f"{type(model).__name__} needs (under that name, its tie's, or stored as transformers "
                                "saves it).", hint="re-save the model with save_pretrained (or symgraph).")
        names[name] = key
    return names


def _block_list(model: nn.Module, config) -> dict[str, nn.Module]:
    """The blocks to stream: the entries of the ``ModuleList`` of length ``num_hidden_layers`` (none: everything
    is read at once, which is right for models small enough to have no such list)."""
    depth = getattr(config, "num_hidden_layers", None)
    for stack, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == depth:
            return {f"{stack}.{i}": block for i, block in enumerate(module)}
    return {}


def _materialise(model: nn.Module, names: dict[str, str], state: LazyState, folder) -> None:
    """Read ``names`` (parameter -> checkpoint key) in float64 into ``model``; NaN or Inf weights are bad input,
    not a difference between the models."""
    for name, key in names.items():
        value = state[key].to(torch.float64)
        if not all_finite(value):
            raise nonfinite_error(f"the weights in '{folder}'", [key])
        _set_parameter(model, name, value)


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


@contextlib.contextmanager
def _streamed_block(model: nn.Module, block: nn.Module, names: dict[str, str], state: LazyState):
    """The block's ``forward`` replaced, while the context lasts, by one that reads the block's parameters in
    float64, runs it and puts them back on the meta device. Not forward hooks: a model that calls
    ``layer.forward(...)`` itself (SqueezeBERT's encoder) would bypass them and run the block on the meta device."""
    def load(*_):
        _materialise(model, names, state, state.folder)

    def drop(*_):
        for name in names:
            _set_parameter(model, name, torch.empty(state.info(names[name]).shape, device="meta",
                                                    dtype=torch.float64))

    own = block.__dict__.get("forward")  # a forward the instance already has of its own (symgraph.moe sets some)
    run = block.forward

    def forward(*args, **kwargs):
        load()
        try:
            return run(*args, **kwargs)
        finally:
            drop()

    block.forward = forward
    try:
        yield
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own
