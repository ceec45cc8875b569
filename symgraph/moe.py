"""Mixture-of-experts layers in a form the analysis can read, and one the float64 check can run.

transformers 5.x stores a layer's experts as 3-D parameters (``gate_up_proj``: experts x 2I x D, ``down_proj``:
experts x D x I) and picks the routine that runs them from ``config._experts_implementation``. None of its
routines suits us: ``grouped_mm`` traces as an opaque ``transformers::grouped_mm_fallback`` op with no float64
kernel, ``eager`` loops over the experts a batch happens to hit (export stops on that data-dependent branch), and
``batched_mm`` gathers expert weights by routed index, which hides which expert a row came from.

:func:`dense_experts_forward` computes the same function with the expert axis kept as a tensor axis: every expert
runs on every token, and the router's choice enters as a dense (tokens x experts) weight matrix built by
``one_hot(top_k_index) * top_k_weights``. The analysis then sees expert ``e``'s weights contracted with router
column ``e`` (the expert permutation moves router rows with it) and each expert's FFN through the layer's own
gate/activation code. Capture uses it; the float64 check runs transformers' own ``eager`` loop instead, so the
two are independent.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .groups import Member

__all__ = ["DENSE", "REFERENCE", "dense_experts_forward", "experts_implementation", "experts_modules",
           "note_shared_expert_units", "use_experts_implementation"]

DENSE = "symgraph_dense"  # registered in transformers' experts interface on first use
REFERENCE = "eager"  # transformers' reference loop: runs in any dtype, not traceable


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one layer on every token, mixed by the dense routing matrix (exact, E/k times the work).

    Examples
    --------
    >>> from symgraph.zoo import build, example_inputs_for
    >>> model = build("mixtral")
    >>> args, kwargs = example_inputs_for("mixtral", model)
    >>> with experts_implementation(model, DENSE):
    ...     dense = model(*args, **kwargs).logits
    >>> with experts_implementation(model, REFERENCE):
    ...     reference = model(*args, **kwargs).logits
    >>> bool(torch.allclose(dense, reference, atol=1e-5))
    True
    """
    routing = torch.nn.functional.one_hot(top_k_index, self.num_experts).to(top_k_weights.dtype)
    routing = (routing * top_k_weights.unsqueeze(-1)).sum(-2)  # (tokens, experts): zero where not routed
    up = self.gate_up_proj if self.has_gate else self.up_proj
    hidden = _per_expert(hidden_states, up, self.is_transposed, "td")
    if self.has_bias:
        hidden = hidden + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
    hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
    out = _per_expert(hidden, self.down_proj, self.is_transposed, "tei")
    if self.has_bias:
        out = out + self.down_proj_bias
    if getattr(self, "has_post_expert_norm", False):  # transformers 5.17 has no post-expert norm
        out = self.post_expert_norm(out)
    return torch.einsum("ted,te->td", out, routing.to(out.dtype)).to(hidden_states.dtype)


def _per_expert(x: torch.Tensor, weight: torch.Tensor, transposed: bool, x_letters: str) -> torch.Tensor:
    """``x`` through every expert's linear map: weight is (experts, out, in), or (experts, in, out) transposed."""
    in_letter = x_letters[-1]
    w_letters = f"e{in_letter}o" if transposed else f"eo{in_letter}"
    return torch.einsum(f"{x_letters},{w_letters}->teo", x, weight)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose routine transformers picks by ``config._experts_implementation`` (its experts decorator)."""
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "config")]


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, name: str) -> Iterator[torch.nn.Module]:
    """Run ``model``'s experts with routine ``name`` inside the block; the configs are restored afterwards."""
    if name == DENSE:
        _register()
    configs = {id(m.config): m.config for m in experts_modules(model)}
    saved = {key: config._experts_implementation_internal for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation_internal = name
        yield model
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]


def use_experts_implementation(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Switch ``model``'s experts to routine ``name`` for good (for copies symgraph owns, never a caller's model)."""
    if name == DENSE:
        _register()
    for m in experts_modules(model):
        m.config._experts_implementation_internal = name
    return model


def note_shared_expert_units(groups: list) -> list:
    """Say, on each FFN group that acts inside a layer's experts, that it is a subgroup of the exact one.

    A member acts on one parameter axis, so the unit axis of ``gate_up_proj`` (experts x 2I x D) gets one
    permutation for every expert; each expert may in fact permute its own units independently.
    """
    expert_params = {m.param for g in groups if g.motif == "experts" for m in g.members
                     if isinstance(m, Member) and m.axis == 0}
    note = ("one unit permutation shared by every expert of the layer; each expert's units may also permute on "
            "their own (a subgroup of the exact group)")
    return [g.with_notes(note) if g.motif == "ffn" and g.members and all(m.param in expert_params and m.axis > 0
                                                                          for m in g.members) else g
            for g in groups]


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    if DENSE not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(DENSE, dense_experts_forward)
