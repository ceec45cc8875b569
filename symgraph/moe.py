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

A few experts modules (DBRX's, LongCat-Flash's) loop over the experts a batch hits in their own forward, outside
that interface; ``specs/experts.yaml`` says where such a module keeps its weights (and how many identity experts,
which pass the token on, follow the others), and :func:`layout_experts_forward` runs it in the same dense form (the
module's own loop stays the reference). A mixture-of-experts module that sends some picks to identity experts
(LongCat-Flash's zero-computation ones, since transformers 5.25) turns them into zero-weight picks of routed experts
by arithmetic on the indices; :func:`identity_routing_forward` runs it as one dense routing matrix instead.
JetMoE's mixtures (of GLU experts, and of attention heads) sort the tokens by expert and split them by counts read at
run time; ``sorted_tokens`` in the same file says where their router and weights are, and
:func:`sorted_glu_forward`, :func:`sorted_heads_map` and :func:`sorted_heads_reduce` run them densely. Llama 4 runs
every expert on every token scaled by its router score but stacks the experts' inputs along the rows, which hides
the expert axis; :func:`scaled_inputs_forward` (``scaled_inputs``) keeps it apart.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import types
from collections.abc import Iterator

import torch

from .groups import Member
from .spec import ExpertsLayout, IdentityRouting, ScaledInputs, SortedTokens, load_specs

__all__ = ["DENSE", "REFERENCE", "dense_experts_forward", "experts_implementation", "experts_modules",
           "identity_routing_forward", "identity_routing_modules", "layout_experts_forward", "layout_modules",
           "note_shared_expert_units", "scaled_inputs_modules", "sorted_tokens_modules", "use_experts_implementation"]

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
    return _mix(_every_expert(self, hidden_states), _routing(top_k_index, top_k_weights, self.num_experts),
                hidden_states.dtype)


def _every_expert(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output of every expert of an experts-interface module on every token: (tokens, experts, hidden)."""
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
    return out


def identity_routing_forward(self, hidden_states: torch.Tensor, *, layout: IdentityRouting) -> torch.Tensor:
    """A mixture-of-experts module with identity experts (specs/experts.yaml ``identity_routing``) on every token:
    its experts-interface module densely, plus each token times its identity experts' routing weights."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    picked = getattr(self, layout.router)(tokens)
    routed = getattr(self, layout.routed)
    routing = _routing(picked[layout.indices_output], picked[layout.weights_output],
                       routed + getattr(self, layout.identity))
    out = _mix(_every_expert(getattr(self, layout.experts), tokens), routing[:, :routed], hidden_states.dtype)
    return (out + _passed_on(tokens, routing[:, routed:])).view(hidden_states.shape)


def layout_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           *, layout: ExpertsLayout) -> torch.Tensor:
    """A hand-written experts module (weights where ``layout`` says) on every token, mixed by the routing matrix;
    identity experts (LongCat-Flash's zero-computation ones) add each token times its routing weight to them."""
    experts = getattr(self, layout.experts)
    identity = getattr(self, layout.identity_experts) if layout.identity_experts else 0
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    if layout.gate_up is None:
        gate, up = (_per_expert(tokens, _stacked(self, path, experts), False, "td")
                    for path in (layout.gate, layout.up))
    else:
        gate, up = _per_expert(tokens, _stacked(self, layout.gate_up, experts), False, "td").chunk(2, dim=-1)
    hidden = operator.attrgetter(layout.activation)(self)(gate) * up
    out = _per_expert(hidden, _stacked(self, layout.down, experts), layout.down_rows == "units", "tei")
    routing = _routing(top_k_index, top_k_weights, experts + identity)
    mixed = _mix(out, routing[:, :experts], hidden_states.dtype)
    return (mixed + _passed_on(tokens, routing[:, experts:]) if identity else mixed).view(hidden_states.shape)


def sorted_glu_forward(self, hidden_states: torch.Tensor, *, layout: SortedTokens) -> torch.Tensor:
    """A token-sorting mixture of gated FFN experts (specs/experts.yaml ``sorted_tokens``, form glu) on every
    token, mixed by the dense routing matrix."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, index, weights = _sorted_picks(self, tokens, layout)
    up, down = self.get_parameter(layout.up), self.get_parameter(layout.down)
    gate, up_rows = _per_expert(tokens, up, False, "td").chunk(2, dim=-1)
    out = _per_expert(operator.attrgetter(layout.activation)(self)(gate) * up_rows, down, False, "tei")
    mixed = _mix(out, _routing(index, weights, up.shape[0]), hidden_states.dtype)
    return mixed.view(hidden_states.shape) + self.get_parameter(layout.bias)


def sorted_heads_map(self, hidden_states: torch.Tensor, *, layout: SortedTokens):
    """A mixture of attention heads' queries (form heads): each token's picks through their experts' query rows,
    as (batch, length, top_k, rows), with the router's logits and the (tokens, top_k, experts) routing weights."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits, index, weights = _sorted_picks(self, tokens, layout)
    up = self.get_parameter(layout.up)
    picks = torch.nn.functional.one_hot(index, up.shape[0]).to(tokens.dtype)
    queries = torch.einsum("teo,tke->tko", _per_expert(tokens, up, False, "td"), picks)
    return queries.view(*hidden_states.shape[:-1], *index.shape[-1:], -1), logits, picks * weights.unsqueeze(-1)


def sorted_heads_reduce(self, per_pick: torch.Tensor, routing: torch.Tensor, *, layout: SortedTokens) -> torch.Tensor:
    """Each pick's attention output through every expert's output projection, weighted by the routing and summed
    (routed after the projection, as the module's own code does)."""
    batch, length, picks, rows = per_pick.shape
    out = torch.einsum("tki,eoi->tkeo", per_pick.reshape(-1, picks, rows), self.get_parameter(layout.down))
    mixed = torch.einsum("tkeo,tke->to", out, routing.to(out.dtype)).view(batch, length, -1)
    return mixed + self.get_parameter(layout.bias)


def scaled_inputs_forward(self, hidden_states: torch.Tensor, *, layout: ScaledInputs):
    """Every expert on every token scaled by its router score (specs/experts.yaml ``scaled_inputs``), the expert
    axis kept apart from the tokens', plus the shared expert: the (tokens, hidden) output and the router logits."""
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    scores, logits = self.get_submodule(layout.router)(tokens)
    routed_in = tokens * scores.transpose(0, 1).unsqueeze(-1)  # (experts, tokens, hidden)
    gate, up = torch.bmm(routed_in, self.get_parameter(layout.gate_up)).chunk(2, dim=-1)
    routed_out = torch.bmm(up * operator.attrgetter(layout.activation)(self)(gate), self.get_parameter(layout.down))
    return self.get_submodule(layout.shared)(tokens) + routed_out.sum(dim=0), logits


_SORTED_FORWARDS = {"glu": (sorted_glu_forward,), "heads": (sorted_heads_map, sorted_heads_reduce)}


def _sorted_picks(self, tokens: torch.Tensor, layout: SortedTokens):
    """The router's float32 logits, each token's top-k experts and their weights (softmax over the picked
    logits, in the tokens' dtype)."""
    logits = self.get_submodule(layout.router)(tokens).float()
    picked, index = logits.topk(operator.attrgetter(layout.top_k)(self), dim=1)
    return logits, index, torch.softmax(picked, dim=1).type_as(tokens)


def _passed_on(tokens: torch.Tensor, identity_routing: torch.Tensor) -> torch.Tensor:
    """What identity experts add: each token times the sum of its routing weights at them (summed in the weights'
    dtype, as the modules do: a float32 router's sum otherwise rounds differently)."""
    return tokens * identity_routing.sum(-1, keepdim=True).to(tokens.dtype)


def _routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int) -> torch.Tensor:
    """The dense (tokens, experts) routing matrix: each token's top-k weights at its experts, zero elsewhere."""
    routing = torch.nn.functional.one_hot(top_k_index, experts).to(top_k_weights.dtype)
    return (routing * top_k_weights.unsqueeze(-1)).sum(-2)


def _mix(out: torch.Tensor, routing: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every expert's output (tokens, experts, hidden) weighted by its routing column and summed over experts."""
    return torch.einsum("ted,te->td", out, routing.to(out.dtype)).to(dtype)


def _stacked(module: torch.nn.Module, path: str, experts: int) -> torch.Tensor:
    """Parameter ``path`` of ``module`` as (experts, rows, columns): its experts stacked along the rows, or its first
    ``experts`` entries where it has an expert axis of its own (LongCat-Flash's also holds its identity experts')."""
    weight = module.get_parameter(path)
    if weight.dim() == 3:
        return weight if weight.shape[0] == experts else weight[:experts]
    return weight.view(experts, -1, weight.shape[-1])


def _per_expert(x: torch.Tensor, weight: torch.Tensor, transposed: bool, x_letters: str) -> torch.Tensor:
    """``x`` through every expert's linear map: weight is (experts, out, in), or (experts, in, out) transposed."""
    in_letter = x_letters[-1]
    w_letters = f"e{in_letter}o" if transposed else f"eo{in_letter}"
    return torch.einsum(f"{x_letters},{w_letters}->teo", x, weight)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose routine transformers picks by ``config._experts_implementation`` (its experts decorator)."""
    return [m for m in model.modules() if _runs_by_interface(m)]


def _runs_by_interface(module: torch.nn.Module) -> bool:
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "config")


def _matching(model: torch.nn.Module, layouts, matches, among=lambda module: True) -> list[tuple]:
    """The modules of ``model`` (those ``among`` accepts) that some entry of ``layouts`` ``matches``, each with
    the first such entry."""
    found = [(m, next((layout for layout in layouts if matches(m, layout)), None))
             for m in model.modules() if among(m)]
    return [(m, layout) for m, layout in found if layout is not None]


def layout_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ExpertsLayout]]:
    """Hand-written experts modules of ``model`` with the layout of specs/experts.yaml each matches."""
    return _matching(model, load_specs().experts.values(), _matches, among=_takes_routing)


def identity_routing_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, IdentityRouting]]:
    """Mixture-of-experts modules of ``model`` with identity experts, with the entry of specs/experts.yaml
    (``identity_routing``) each matches: a router, an experts-interface module, and at least one of each kind."""
    return _matching(model, load_specs().identity_routing.values(), _routes_to_identity)


def _routes_to_identity(module: torch.nn.Module, layout: IdentityRouting) -> bool:
    counts = [getattr(module, layout.routed, None), getattr(module, layout.identity, None)]
    experts = getattr(module, layout.experts, None)
    return (all(isinstance(n, int) and n >= 1 for n in counts) and _runs_by_interface(experts)
            and isinstance(getattr(module, layout.router, None), torch.nn.Module))


def sorted_tokens_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, SortedTokens]]:
    """Mixture-of-experts modules of ``model`` that sort tokens by expert (JetMoE's), with the entry of
    specs/experts.yaml (``sorted_tokens``) each matches."""
    return _matching(model, load_specs().sorted_tokens.values(), _sorts_tokens)


_SORTED_METHODS = {"glu": ("forward",), "heads": ("map", "reduce")}  # what each form's dense code replaces


def _sorts_tokens(module: torch.nn.Module, layout: SortedTokens) -> bool:
    router = _attribute(module, layout.router)
    if not isinstance(router, torch.nn.Linear) or not isinstance(_attribute(module, layout.top_k), int):
        return False
    weights = [_attribute(module, p) for p in (layout.up, layout.down)]
    callables = [_attribute(module, a) for a in (layout.activation, *_SORTED_METHODS[layout.form]) if a]
    return (all(isinstance(w, torch.nn.Parameter) and w.dim() == 3 and w.shape[0] == router.out_features
                for w in weights)
            and isinstance(_attribute(module, layout.bias), torch.nn.Parameter) and all(map(callable, callables)))


def scaled_inputs_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ScaledInputs]]:
    """Mixture-of-experts modules of ``model`` that stack every expert's scaled inputs along the rows (Llama 4's),
    with the entry of specs/experts.yaml (``scaled_inputs``) each matches."""
    return _matching(model, load_specs().scaled_inputs.values(), _scales_inputs)


def _scales_inputs(module: torch.nn.Module, layout: ScaledInputs) -> bool:
    router = _attribute(module, layout.router)
    if not isinstance(router, torch.nn.Linear):
        return False
    gate_up, down = _attribute(module, layout.gate_up), _attribute(module, layout.down)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3):
        return False
    experts, hidden, units = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2
    return (tuple(down.shape) == (experts, units, hidden) and router.out_features == experts
            and gate_up.shape[2] == 2 * units and isinstance(_attribute(module, layout.shared), torch.nn.Module)
            and callable(_attribute(module, layout.activation)))


def _attribute(module: torch.nn.Module, path: str):
    try:
        return operator.attrgetter(path)(module)
    except AttributeError:
        return None


def _dense_forwards(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, types.MethodType]]:
    """The methods capture runs densely outside the experts interface: (module, method name, dense method)."""
    pairs = [(m, "forward", functools.partial(layout_experts_forward, layout=layout))
             for m, layout in layout_modules(model)]
    pairs += [(m, "forward", functools.partial(identity_routing_forward, layout=layout))
              for m, layout in identity_routing_modules(model)]
    pairs += [(m, "forward", functools.partial(scaled_inputs_forward, layout=layout))
              for m, layout in scaled_inputs_modules(model)]
    pairs += [(m, name, functools.partial(dense, layout=layout)) for m, layout in sorted_tokens_modules(model)
              for name, dense in zip(_SORTED_METHODS[layout.form], _SORTED_FORWARDS[layout.form])]
    return [(m, name, types.MethodType(forward, m)) for m, name, forward in pairs]


def _takes_routing(module: torch.nn.Module) -> bool:
    parameters = list(inspect.signature(type(module).forward).parameters)[1:4]
    return parameters == ["hidden_states", "top_k_index", "top_k_weights"]


def _matches(module: torch.nn.Module, layout: ExpertsLayout) -> bool:
    experts = getattr(module, layout.experts, None)
    if not isinstance(experts, int) or experts < 1:
        return False
    names = dict(module.named_parameters())
    paths = [p for p in (layout.gate, layout.up, layout.gate_up, layout.down) if p is not None]
    if layout.identity_experts is not None and not isinstance(getattr(module, layout.identity_experts, None), int):
        return False
    return all(p in names and (names[p].dim() == 2 and names[p].shape[0] % experts == 0
                               or names[p].dim() == 3 and names[p].shape[0] >= experts) for p in paths)


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, name: str) -> Iterator[torch.nn.Module]:
    """Run ``model``'s experts with routine ``name`` inside the block; the configs are restored afterwards."""
    configs = {id(m.config): m.config for m in experts_modules(model)}
    saved = {key: config._experts_implementation_internal for key, config in configs.items()}
    forwards = {(id(m), name): (m, name, m.__dict__.get(name)) for m, name, _ in _dense_forwards(model)}
    try:
        use_experts_implementation(model, name)
        yield model
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]
        for module, name, forward in forwards.values():
            _set_method(module, name, forward)


def use_experts_implementation(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Switch ``model``'s experts to routine ``name`` for good (for copies symgraph owns, never a caller's model).

    Hand-written experts modules and modules with identity experts (specs/experts.yaml) run densely under ``DENSE``
    and their own forward otherwise."""
    if name == DENSE:
        _register()
    for m in experts_modules(model):
        m.config._experts_implementation_internal = name
    for m, method, dense in _dense_forwards(model):
        _set_method(m, method, dense if name == DENSE else None)
    return model


def _set_method(module: torch.nn.Module, name: str, method) -> None:
    """Give ``module`` its own method ``name`` (``None``: the class's again)."""
    if method is None:
        module.__dict__.pop(name, None)
    else:
        setattr(module, name, method)


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
