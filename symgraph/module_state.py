"""A caller's ``nn.Module`` comes back exactly as it was given: training flags, gradients, hooks, tensors.

symgraph needs a module in eval mode (dropout off, norms on their running statistics) and sometimes with every
parameter requiring grad (Fisher statistics). It never flips those switches on the caller's object:
:func:`private_tree` gives it a module tree of its own that shares the caller's tensors (no weight memory), and
:func:`eval_mode` / :func:`gradients_on` put back every flag they changed, module by module and tensor by tensor;
:func:`attributes_kept` puts back what a ``forward`` changed on its modules (a traced one's cached tensors, a
probe's shape-dependent settings).

Examples
--------
>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
>>> own = private_tree(net).eval()
>>> net.training, own.training, own[0].weight is net[0].weight
(True, False, True)
>>> net[1].eval()
Dropout(p=0.5, inplace=False)
>>> with eval_mode(net):
...     [m.training for m in net.modules()]
[False, False, False]
>>> [m.training for m in net.modules()]  # each module's own flag, the dropout's included
[True, True, False]
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

__all__ = ["attributes_kept", "copied_module", "private_tree", "eval_mode", "gradients_on", "parameter_names"]

#: Per-module dicts a module tree of its own must not share with the caller's (the rest of ``__dict__`` is
#: shared by a shallow copy: the config, plain attributes; tensors stay the caller's).
_OWN_DICTS = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_forward_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def private_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree of submodules holding the very same parameter and buffer tensors: switching
    its modes, adding or removing its hooks, or registering tensors on it leaves ``module`` as it was. A
    submodule that appears twice (shared layers) is copied once, so sharing is kept. Writing into a tensor still
    reaches the caller's (they are the same tensors): symgraph computes on copies of the values."""
    copies: dict[int, torch.nn.Module] = {}

    def own(original: torch.nn.Module) -> torch.nn.Module:
        if id(original) not in copies:
            clone = type(original).__new__(type(original))  # not copy.copy: parametrized modules refuse pickling
            clone.__dict__.update(original.__dict__)
            for name in _OWN_DICTS:
                if name in original.__dict__:
                    clone.__dict__[name] = copy.copy(original.__dict__[name])
            copies[id(original)] = clone
            clone._modules = {k: None if m is None else own(m) for k, m in original._modules.items()}
        return copies[id(original)]

    return own(module)


def copied_module(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)``, also where a module keeps a tensor computed from its parameters as a plain
    attribute (``torch.nn.utils.weight_norm``'s ``weight``, recomputed by a pre-forward hook), which deepcopy
    refuses: such tensors are copied detached, and the hook computes them anew from the copy's parameters."""
    memo = {id(value): value.detach().clone() for m in module.modules() for value in vars(m).values()
            if isinstance(value, torch.Tensor) and not value.is_leaf}
    return copy.deepcopy(module, memo)


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` in eval mode inside the block; every submodule's own training flag comes back afterwards (a
    module whose norms the caller froze in eval mode stays so)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def gradients_on(module: torch.nn.Module) -> Iterator[None]:
    """Every parameter requires grad inside the block, starting from no gradient; each parameter's
    ``requires_grad`` and ``.grad`` come back afterwards."""
    saved = {p: (p.requires_grad, p.grad) for p in module.parameters()}
    try:
        for p in saved:
            p.grad = None
            p.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for p, (flag, grad) in saved.items():
            p.requires_grad_(flag)
            p.grad = grad


@contextlib.contextmanager
def attributes_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put every module's attributes back as they were: plain ones, buffers, submodules, hooks (the bindings: a
    tensor written into in place stays written). Code that changes its module while it runs would otherwise leave
    the change behind: export runs ``forward`` on fake tensors, and transformers' long-context rotary embeddings
    cache tensors on their module (``self.long_inv_freq = ...``, ``register_buffer("inv_freq", ...)``), leaving
    fake tensors the model can neither run nor be copied with; Swin's layers shrink ``window_size`` for good on
    an image smaller than a window, so one probe at a small shape would break every later run."""
    saved = [(m, {k: copy.copy(v) if k in _OWN_DICTS else v for k, v in vars(m).items()}) for m in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            vars(module).clear()
            vars(module).update(attributes)


def parameter_names(model: torch.nn.Module) -> dict[int, frozenset[str]]:
    """Every name each parameter of ``model`` goes by, keyed by the parameter's ``id`` (a tied LM head and its
    embedding: one parameter, two names)."""
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    return {key: frozenset(value) for key, value in names.items()}
