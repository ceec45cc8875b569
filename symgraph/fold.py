"""Norm folding: a function-preserving rewrite after which the residual stream has a larger symmetry group.

A norm's elementwise weight ``g`` (and a LayerNorm's bias ``beta``) moves into the linear layers that read the norm: ``W
(g * n + beta) + b = (W diag g) n + (W beta + b)``. What is left is the same architecture with norm weights 1 and biases
0 (a norm that multiplies by ``1 + w``, as Gemma's and Qwen3-Next's do, moves ``1 + w`` and keeps w 0), so the residual
stream no longer meets a per-coordinate weight: the analysis then finds O(D) for RMSNorm models and {Q in O(D) : Q 1 =
+-1} for LayerNorm models (:mod:`symgraph.analysis.rules`).

For LayerNorm models every parameter that writes into the residual stream (embeddings, position embeddings, class
token, patch embedding, attention output and FFN down projections with their biases) is also centred over the
stream's coordinates: every reader of the stream is a LayerNorm, which subtracts the mean anyway, so each norm now
sees mean-free inputs and computes what an RMSNorm would. A tensor is centred only when every use of it, under any of
its tied names, writes into the stream (an embedding that is also the LM head is refused).

What reads what comes from the captured graph, never from module names. A norm is a ``layer_norm`` or ``rms_norm`` op,
or an RMSNorm: a parameter vector (or one plus it) multiplied into ``x * rsqrt(...)`` (``x * pow(..., -0.5)``,
``x / sqrt(...)``). Its readers are linear layers (also through a product with or division by a number, where the norm
has no bias), or einsums contracting its output with a parameter (a mixture of experts' dense experts,
:mod:`symgraph.moe`, in any layout: the contracted axis absorbs the weight). Anything that would make the rewrite change
the function is refused with the norm, the graph node and the reason.

Examples
--------
>>> import symgraph
>>> from symgraph import zoo
>>> model = zoo.build("llama", seed=0)
>>> folded = symgraph.fold(symgraph.load(model, zoo.example_inputs_for("llama", model)))
>>> len(folded.norms) > 0 and folded.verified_error < 1e-4
True
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch
from torch import fx

from .analysis.centring import centred_input, is_centring_mean
from .analysis.walk import uniform_value
from .errors import InvarianceError, SymgraphError
from .spec import load_specs
from .verify import RoundedExact, _aliases, tie_aliases
from .module_state import copied_module


class FoldError(SymgraphError):
    """A norm cannot be folded into its readers without changing the model's function."""


class TiedFoldError(FoldError):
    """A fold refused because weights are tied (an embedding that is also the LM head): untying cures it."""


@dataclass(frozen=True)
class NormSite:
    """One norm of the graph and the linear layers that absorb its weight."""

    node: str  # the graph node that applies the weight (layer_norm, or the RMSNorm's multiplication)
    weight: str | None  # parameter names; None when the norm has no such parameter
    bias: str | None
    centres: bool  # subtracts the mean (LayerNorm)
    readers: tuple["Reader", ...]  # the parameters reading the norm, which absorb its weight
    source: str = ""  # the model's source line, for messages
    offset: float = 0.0  # the norm multiplies by offset + weight (Gemma's and Qwen3-Next's 1 + w)
    # a LayerNorm bias that stays in the norm, divided by the weight the readers absorb: some reader has no bias to
    # take it (GPT-J, GPT-NeoX, StableLM); the stream's group moves it like any vector of the stream
    keeps_bias: bool = False

    def describe(self) -> str:
        return f"norm {self.weight or self.node} (graph node {self.node}{self.source})"

    def scale(self, weight: torch.Tensor) -> torch.Tensor:
        """What the norm multiplies its output by, given its stored weight: what the readers absorb."""
        return weight + self.offset if self.offset else weight

    def folded_weight(self, like: torch.Tensor) -> torch.Tensor:
        """The stored weight after folding: the one that makes the norm multiply by 1."""
        return torch.full_like(like, 1.0 - self.offset)


class Reader(NamedTuple):
    """A parameter that reads a norm's output: a linear layer's weight (``axis`` its last, the input columns) with
    its bias, a weight stored (in, out) (``axis`` 0: GPT-2's Conv1D through ``addmm``, ``x @ W``), or a tensor an
    einsum contracts with the output (the dense experts of :mod:`symgraph.moe`: ``axis``
    the contracted one, no bias)."""

    weight: str
    bias: str | None
    axis: int

    def absorb(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``w`` with ``g`` multiplied in along the axis that meets the norm's coordinates."""
        view = [1] * w.dim()
        view[self.axis] = -1
        return w * g.reshape(view)


@dataclass
class FoldResult:
    """The folded state dict, what was folded and centred, and the float64 check of the rewrite."""

    state: dict[str, torch.Tensor]
    norms: list[NormSite]
    centred: list[str] = field(default_factory=list)
    verified_error: float | None = None
    verified_rounded: RoundedExact | None = None  # bf16/fp16 past the tolerance: judged as an exact result rounded
    untied: list[str] = field(default_factory=list)  # names given their own tensor (``untie``)
    config: object = None  # the config to write with ``state`` (the source's, or its untied copy)

    def to_json(self) -> dict:
        return {"norms": [{"node": n.node, "weight": n.weight, "bias": n.bias, "layer_norm": n.centres,
                           "bias_kept": n.keeps_bias,
                           "readers": [r.weight for r in n.readers]} for n in self.norms],
                "centred": self.centred, "untied": self.untied, "verified_relative_error": self.verified_error,
                **({"verified_rounded_exact": asdict(self.verified_rounded)} if self.verified_rounded else {})}


def fold(source, inputs=None, *, verify: bool = True, untie: bool | None = None) -> FoldResult:
    """Fold every norm of ``source`` (anything :func:`symgraph.load` accepts) into the linears that read it.

    Returns :class:`FoldResult` with a new state dict (``source`` is not modified): norms that multiply by 1 (weights 1,
    or 0 in ``1 + w``), biases 0, the same architecture, and for LayerNorm models every residual writer centred. With
    ``verify`` the folded model is first checked in float64 to compute what ``source`` computes. Raises
    :class:`FoldError` naming the norm and the reason when a norm cannot be folded. Tied weights (an embedding that
    is also the LM head) are given tensors of their own first (:func:`untied`) where the tie keeps a norm from
    folding (``untie`` None, the default: :func:`pays_off` says why), always (True) or never (False: such a fold is
    refused with a :class:`TiedFoldError`); the result's ``untied`` names them, and its ``config`` then says the
    weights are not tied.
    """
    from .api import load

    return _fold_as_asked(load(source, inputs), verify, untie)[0]


def _fold_as_asked(subject, verify: bool, untie: bool | None) -> tuple[FoldResult, object]:
    """:func:`fold`'s result and the subject it folded: ``subject``, or its untied copy where it untied."""
    try:
        return _fold(subject, verify, bool(untie))
    except TiedFoldError:
        if untie is not None:
            raise
        return _fold(subject, verify, True)


def _fold(subject, verify: bool, untie: bool) -> tuple[FoldResult, object]:
    names = []
    if untie:
        subject, names = untied(subject)
    if subject.config_only:
        raise FoldError(f"{subject.name} was built without weights (config only): there is nothing to fold.",
                        hint="fold a model with its weights.")
    cap = subject.capture
    norms = find_norms(cap)
    if not norms:
        _refuse_nothing_to_fold(subject.name, cap)
    state = subject.state_dict()
    centred = residual_writers(cap, norms) if all(n.centres for n in norms) else []

    def rewritten(state):  # a tied name follows the one the graph reads: every use of that tensor was checked above
        folded = {**state, **_folded_params(state, norms)}
        folded.update(_centred(folded, centred))
        return tie_aliases(subject.model, folded)

    result = FoldResult(rewritten(state), norms, sorted({name for name, _ in centred}), untied=names,
                        config=subject.config)
    if verify:  # the exact fold: the same rewrite of the weights in float64, nothing rounded
        _verify(subject, result, lambda: rewritten({k: v.double() if v.is_floating_point() else v
                                                    for k, v in state.items()}))
    return result, subject


def _refuse_nothing_to_fold(name: str, cap) -> None:
    """Why no norm can be folded: norms with weights that read no residual stream, weightless norms, or none."""
    weighted = [(node, found[0]) for node in cap.graph.nodes for found in [_norm_at(node, cap.params)]
                if found is not None and found[0] is not None]
    if weighted:
        node, weight = weighted[0]
        source = _unscaled(_norm_input(node))
        raise FoldError(f"{name} has norms with weights ({len(weighted)}, the first {weight}, graph node "
                        f"{node.name}{_source_line(node)}), but none normalises a residual stream (a sum of "
                        f"residual branches or the embeddings): that one reads {getattr(source, 'target', source)} "
                        f"(hyper-connections, or a per-head norm). There is nothing this fold can rewrite.",
                        hint="align without --fold.")
    if any(_is_rms_normalised(node) for node in cap.graph.nodes):
        raise FoldError(f"{name} normalises by x * rsqrt(...) without a weight to fold: there is nothing to fold, "
                        f"and the report already has the groups such norms allow.", hint="align without --fold.")
    raise FoldError(f"{name} has no norm on a residual stream (no layer_norm op, no RMSNorm weight * x * rsqrt(...)) "
                    f"in its graph: there is nothing to fold.", hint="align without --fold.")


def pays_off(subject, untie: bool | None = None) -> bool:
    """The default of ``--fold`` for merge and barrier: fold every model whose norms can be folded (tied models
    too, untied first, unless ``untie`` is False). Measured by
    ``examples/bench_fold.py`` (``examples/results/fold.json``, loss barriers on the test splits): folding lowered
    the full-mode barrier on both foldable shipped pairs (llama-chars 2.063 -> 1.930, vit-digits 3.414 -> 3.193)
    and the permutation-mode barrier too (2.134 -> 2.084, 4.653 -> 4.612); only the paper's algorithm lost on the
    LLaMA (2.716 -> 2.896). Post-LN models (bert-topics) cannot be folded; config-only models are never folded.
    Untying tied weights (one more vocabulary-sized matrix) lets the final norm fold into the LM head and opens a
    tied LM's residual stream to orthogonal maps: on held-out twins (examples/study_heldout_pairs.py) the barrier of
    data-free full mode went from 0.901 tied to 0.569 untied and folded on a GPT-2 (2.034 unaligned), and from
    0.836 to 0.400 on a LLaMA of width 96 (2.823); permutation mode's moved little (1.99 -> 1.93, 2.00 -> 2.08)."""
    if subject.config_only:
        return False
    try:
        norms = find_norms(subject.capture)
    except TiedFoldError:
        return untie is not False
    except FoldError:
        return False
    return bool(norms)


def folded_where_asked(subjects: list, fold: bool | None, check,
                       untie: bool | None = None) -> tuple[list, bool, str]:
    """``(subjects, folded, note)``: every subject folded (:func:`folded_subject`, untied first as ``untie`` says:
    :func:`fold`) when ``fold`` is True, or None and folding pays off for the first; else unchanged. ``fold`` None
    was not a request: where folding is refused after all (:func:`pays_off` finds the norms, not what centring
    needs) every subject stays unfolded, and ``note`` says why; where tied weights were untied to fold, it says
    which. ``check(subjects, groups)`` refuses models that do not match: before folding without comparing groups
    (a folded model and an unfolded one have different groups until both are folded), after it with them."""
    if untie and fold is False:
        raise FoldError("Untying tied weights serves only a fold, and folding was turned off (--no-fold).",
                        hint="leave out --untie, or fold (--fold, or the default).")
    wanted = pays_off(subjects[0], untie) if fold is None else fold
    check(subjects, not wanted)
    if not wanted:
        return subjects, False, "" if fold is False else _tied_note(subjects[0], untie)
    try:
        folded = [folded_subject(s, untie=untie) for s in subjects]
    except (FoldError, InvarianceError) as exc:  # the latter: the fold's own float64 check found it unsound
        if fold:
            raise
        check(subjects, True)
        cure = _UNTIE_CURES if isinstance(exc, TiedFoldError) else ""
        return subjects, False, f"norms not folded: {exc.message}{cure}"
    check(folded, True)
    untied_now = untied_by_fold(subjects[0].model, folded[0].model)
    return folded, True, (f"tied weights untied so the norm they read folds: {', '.join(untied_now)} (their "
                          f"config now says tie_word_embeddings false; --no-untie keeps them tied, unfolded)"
                          if untied_now and untie is None else "")


def untied(subject) -> tuple[object, list[str]]:
    """``(subject, names)``: a copy of ``subject`` whose tied weights each have a tensor of their own (same values),
    with a config that says so (``tie_word_embeddings`` false, in the config and its text config), and the names
    given their own tensor; ``subject`` itself when nothing is tied. Refused (:class:`FoldError`) when the config
    has no such flag: a model built from it would tie the weights again, and the folded head would be lost."""
    if not _aliases(subject.model):
        return subject, []
    model = copied_module(subject.model)  # its modules share one copy of the config
    config = getattr(model, "config", None)
    for c in [config] + ([config.get_text_config()] if hasattr(config, "get_text_config") else []):
        if hasattr(c, "tie_word_embeddings"):
            c.tie_word_embeddings = False
    still = _ties_built_from(model)
    if still:
        raise FoldError(f"Cannot untie {subject.name}: a model built from its config with tie_word_embeddings false "
                        f"still ties {', '.join(' = '.join(names) for names in still)}.",
                        hint="fold without --untie (the norm read by the tied weights is then refused), or untie "
                             "them in the model's code.")
    names = untied_names(subject.model)
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, leaf)
        setattr(module, leaf, torch.nn.Parameter(tensor.detach().clone(), requires_grad=tensor.requires_grad))
    name = subject.name if subject.name.endswith("(untied)") else f"{subject.name} (untied)"
    return replace(subject, model=model, name=name, config=config if config is not None else subject.config,
                   weights_from_path=False, _capture=None, _report=None), names


def untied_names(model: torch.nn.Module) -> list[str]:
    """The names :func:`untied` gives tensors of their own: every tied name but the first of its group."""
    return [name for group in _aliases(model) for name in group[1:]]


def untied_by_fold(model: torch.nn.Module, folded: torch.nn.Module) -> list[str]:
    """The tied names of ``model`` that have tensors of their own in ``folded`` (its folded copy)."""
    return sorted(set(untied_names(model)) - set(untied_names(folded)))


def _ties_built_from(model: torch.nn.Module) -> list[list[str]]:
    """The ties of a model of ``model``'s class built from its config on the meta device (no weights made); none
    for a module without a Hugging Face config (nothing rebuilds it)."""
    if getattr(model, "config", None) is None or not hasattr(type(model), "_from_config"):
        return []
    with torch.device("meta"):
        built = type(model)._from_config(model.config)
    return _aliases(built)


_UNTIE_CURES = " Pass --untie (untie=True) to fold them."


def _tied_note(subject, untie: bool | None) -> str:
    """Why a model whose norms would fold once untied was not folded (empty for any other reason)."""
    if untie is not False:
        return ""
    try:
        find_norms(subject.capture)
    except TiedFoldError as exc:
        return f"norms not folded: {exc.message}{_UNTIE_CURES}"
    except FoldError:
        pass
    return ""


def folded_subject(subject, inputs=None, untie: bool | None = None):
    """A :class:`~symgraph.api.Subject` of the folded model: a copy of ``subject``'s module holding the folded
    weights, with the same example inputs, config and source folder (untied first as ``untie`` says: :func:`fold`)."""
    from .api import Subject, load

    result, subject = _fold_as_asked(load(subject, inputs), True, untie)
    model = copied_module(subject.model)
    model.load_state_dict(result.state, strict=True)
    name = subject.name if subject.name.endswith("(folded)") else f"{subject.name} (folded)"
    return Subject(model, name, subject.args, dict(subject.kwargs), subject.config,
                   subject.path, subject.config_only, free_outputs=subject.free_outputs,
                   stored_dtypes=subject.stored_dtypes)


def residual_note(cap, groups, config_only: bool) -> str | None:
    """Why the residual stream has only permutations, for the report (None when it is orthogonal or absent)."""
    if not any(g.motif == "residual" and g.kind in ("permutation", "signed_permutation") for g in groups):
        return None
    if config_only:
        return ("residual stream: permutations only, since without weights no norm weight can be known to be 1; "
                "fold the model (`symgraph fold`) and analyse it with its weights for the orthogonal group")
    try:
        norms = find_norms(cap)
    except FoldError as exc:
        return f"residual stream: permutations only; its norms cannot be folded: {exc.message}"
    if not norms:
        return None
    if all(_folded_already(cap, site) for site in norms):  # what limits the stream is no norm weight
        limits = sorted({note for g in groups if g.motif == "residual" for note in g.notes
                         if note.startswith("limited by")})
        return ("residual stream: permutations only although its norms are folded (every norm multiplies by 1)"
                + (f"; {'; '.join(limits)}" if limits else ""))
    return ("residual stream: permutations only, because its norm weights are not 1; `symgraph fold` (or --fold) "
            "folds them into the linears that read them, and the folded model's stream is orthogonal")


def _folded_already(cap, site: NormSite) -> bool:
    """The norm multiplies by one number, 1 (its weight is 1, or 0 in ``1 + w``), and adds no bias."""
    weight = uniform_value(cap.program.state_dict.get(site.weight))
    bias = None if site.bias is None else uniform_value(cap.program.state_dict.get(site.bias))
    return weight is not None and weight + site.offset == 1 and (site.bias is None or bias == 0)


# -- finding norms -----------------------------------------------------------------------------------------------
def find_norms(cap) -> list[NormSite]:
    """Every norm of the captured graph that carries parameters, with the linears reading it."""
    names, placeholders, tied = cap.params, _placeholders(cap), _tied_names(cap)
    sites = []
    for node in cap.graph.nodes:
        found = _norm_at(node, names)
        if found is None:
            continue
        weight, bias, centres, offset = found
        site = NormSite(node.name, weight, bias, centres, (), _module_of(node), offset)
        if not _reads_residual_stream(node):
            continue  # an in-block norm (per-head QK-norm): not on the stream, and no linear after it to absorb it
        if weight is None and bias is None:
            if centres:
                sites.append(site)  # nothing to fold, but it makes the stream centrable
            continue
        _check_used_once(placeholders, node, site)
        sites.append(_with_bias_placement(replace(site, readers=_linear_readers(cap, placeholders, tied, node, site))))
    return sites


def _norm_at(node: fx.Node, names):
    """``(weight, bias, centres, offset)`` of the norm ``node`` computes (a norm op, or ``g * normalised``), or
    None."""
    if node.op != "call_function":
        return None
    return _norm_op(node, names) if _is_norm_op(node) else _rms_norm(node, names)


def _reads_residual_stream(norm: fx.Node) -> bool:
    """The norm's input is a sum (a residual addition) or an embedding lookup, up to casts, dropout and scaling by
    one number (Gemma's embeddings times sqrt(width)); not a sum of products of tensors, such as the halves of a
    rotary embedding that Hunyuan's per-head QK-norm reads."""
    source = _unscaled(_norm_input(norm))
    if not isinstance(source, fx.Node):
        return False
    if _is_sum(source):
        return not all(_is_product(term) for term in source.args[:2])
    return str(source.target) == "aten.embedding.default" or source.op == "placeholder"


def _norm_input(norm: fx.Node):
    """What the norm normalises: a norm op's first argument, the ``x`` of an RMSNorm or a LayerNorm written out."""
    return norm.args[0] if _is_norm_op(norm) else _rms_input(norm)


def _is_product(term) -> bool:
    """``term`` is a product of two tensors, neither a number (``q * cos``)."""
    term = _unscaled(term)
    return isinstance(term, fx.Node) and str(term.target) == "aten.mul.Tensor"


def _unscaled(source):
    """``source`` back through casts, dropout and products with one number."""
    while True:
        source = _through_identity_back(source)
        factor = _scaled_by_a_number(source)
        if factor is None:
            return source
        source = factor


def _scales_by_a_number(user: fx.Node, node: fx.Node) -> bool:
    """``user`` is ``node * c``, ``c * node`` or ``node / c`` for a Python number ``c`` (MiniCPM's logits scale):
    a norm's weight still folds into the linear reading it, which commutes with the number."""
    target = str(user.target)
    if target not in ("aten.mul.Tensor", "aten.div.Tensor") or len(user.args) != 2 or user.kwargs:
        return False
    pairs = [user.args] + ([user.args[::-1]] if target == "aten.mul.Tensor" else [])
    return any(x is node and isinstance(c, (int, float)) and not isinstance(c, bool) for x, c in pairs)


def _scaled_by_a_number(node):
    """``x`` where ``node`` is ``x * s`` (either order) for a number or a one-element tensor ``s``."""
    if not (isinstance(node, fx.Node) and str(node.target) == "aten.mul.Tensor" and len(node.args) == 2):
        return None
    for x, s in (node.args, node.args[::-1]):
        one = not isinstance(s, fx.Node) or _numel(s) == 1
        if one and isinstance(x, fx.Node) and (_numel(x) or 0) > 1:
            return x
    return None


def _rms_input(mul: fx.Node):
    """``x`` of ``g * (x * rsqrt(...))``, or of ``g * ((x - mean(x)) * rsqrt(...))``."""
    scaled = _rms_scaled(mul)
    return centred_input(scaled) or scaled


def _rms_scaled(mul: fx.Node):
    """What ``g * (y * rsqrt(...))`` scales: ``y``."""
    normalised = next(_through_identity_back(a) for a in mul.args if _is_rms_normalised(a))
    return next(a for a in normalised.args if isinstance(a, fx.Node) and not _is_inverse_root(a))


def _is_layer_norm(node: fx.Node) -> bool:
    return str(node.target) in ("aten.layer_norm.default", "aten.native_layer_norm.default")


def _is_norm_op(node: fx.Node) -> bool:
    """A layer_norm, or the rms_norm op (torch.nn.RMSNorm) that takes its weight as layer_norm does."""
    return _is_layer_norm(node) or str(node.target) == "aten.rms_norm.default"


def _norm_op(node, names):
    args = list(node.args) + [None] * (4 - len(node.args))
    if len(args[1]) != 1:
        return None  # normalised over several axes: not a residual-stream norm; left as it is
    if not _is_layer_norm(node):  # rms_norm(input, shape, weight, eps): no bias, no centring
        return _param(args[2], names), None, False, 0.0
    return _param(args[2], names), _param(args[3], names), True, 0.0


def _rms_norm(node, names):
    """``g * normalised`` (either order), ``normalised`` being ``x * rsqrt(...)``, ``x * pow(..., -0.5)`` or
    ``x / sqrt(...)`` up to dtype casts, and ``g`` a vector parameter or ``c + g`` for a number ``c``: the RMSNorm
    of Hugging Face LLaMA-family models and T5, and the ``(1 + w)`` one of Gemma and Qwen3-Next."""
    if str(node.target) != "aten.mul.Tensor" or len(node.args) != 2:
        return None
    for weight, other in (node.args, node.args[::-1]):
        found = _offset_param(weight, names)
        if found is not None and weight.meta["val"].dim() == 1 and _is_rms_normalised(other):
            centres = centred_input(_rms_scaled(node)) is not None  # a LayerNorm written out
            return found[0], None, centres, found[1]
    return None


def _offset_param(arg, names) -> tuple[str, float] | None:
    """``(name, c)`` where ``arg`` is a parameter (``c`` 0) or a number plus one, up to dtype casts."""
    name = _param(_through_identity_back(arg), names)
    if name is not None:
        return name, 0.0
    if not (isinstance(arg, fx.Node) and str(arg.target) == "aten.add.Tensor" and len(arg.args) == 2
            and arg.kwargs.get("alpha", 1) == 1):
        return None
    for term, number in (arg.args, arg.args[::-1]):
        name = _param(_through_identity_back(term), names)
        if name is not None and isinstance(number, (int, float)) and not isinstance(number, bool):
            return name, float(number)
    return None


def _is_rms_normalised(node) -> bool:
    node = _through_identity_back(node)
    if not isinstance(node, fx.Node):
        return False
    target = str(node.target)
    if target == "aten.mul.Tensor":
        return any(_is_inverse_root(a) for a in node.args)
    if target == "aten.div.Tensor":
        return isinstance(node.args[1], fx.Node) and str(node.args[1].target) == "aten.sqrt.default"
    return False


def _is_inverse_root(node) -> bool:
    """``rsqrt(s)``, or ``pow(s, -0.5)`` (Gemma 4 writes its RMSNorm so, to match JAX)."""
    if not isinstance(node, fx.Node):
        return False
    target = str(node.target)
    return target == "aten.rsqrt.default" or (target == "aten.pow.Tensor_Scalar" and node.args[1] == -0.5)


def _param(arg, names) -> str | None:
    return names.get(arg.name) if isinstance(arg, fx.Node) and arg.op == "placeholder" else None


def _check_used_once(placeholders, node, site: NormSite) -> None:
    """The norm's parameters reach nothing but the norm (through its casts and its ``c + w``), beyond readers of
    their shape or dtype."""
    for name in (site.weight, site.bias):
        placeholder = placeholders.get(name)
        others = [] if placeholder is None else [u for u in placeholder.users if not _only_feeds(u, placeholder, node)]
        if others:
            raise FoldError(f"Cannot fold {site.describe()}: its parameter {name} is also read by "
                            f"{', '.join(f'{u.target} (graph node {u.name})' for u in others)}; one fold cannot "
                            f"serve both.", hint="untie the parameter, or align without --fold.")


def _only_feeds(user: fx.Node, value: fx.Node, norm: fx.Node) -> bool:
    """``user`` of ``value`` is the norm, reads only metadata, or passes its value on to nothing but the norm."""
    if user is norm or _reads_metadata_only(user, value):
        return True
    return bool(user.users) and all(_only_feeds(u, user, norm) for u in user.users)


def _linear_readers(cap, placeholders, tied, node, site: NormSite) -> tuple[Reader, ...]:
    readers = []
    # a number between norm and reader commutes with the weight, not with a bias folded into the reader's
    for user, value in _readers(node, through_numbers=site.bias is None):
        reader = _absorbing_reader(cap, user, value)
        if reader is None:
            what = "the model's output" if user.op == "output" else f"{user.target} (graph node {user.name})"
            post_ln = str(user.target) == "aten.add.Tensor"
            raise FoldError(f"Cannot fold {site.describe()}: its output is read by {what}; only linear layers (and "
                            f"einsums contracting it with a parameter) can absorb a norm's weight"
                            + (" (a post-LN model: the norm's output is the residual stream itself)." if post_ln
                               else "."),
                            hint="align without --fold: post-LN models keep their norms and residual permutations."
                            if post_ln else "align without --fold.")
        weight, bias = reader.weight, reader.bias
        shared = _ties(tied, weight) or [u.name for u in placeholders[weight].users
                                         if not _only_feeds(u, placeholders[weight], user)]
        if shared:
            raise (TiedFoldError if _ties(tied, weight) else FoldError)(
                   f"Cannot fold {site.describe()} into {weight}: that weight is shared with {shared[0]} "
                            f"(tied weights), which would need a different fold.",
                            hint="untie the weights (--untie; fold(..., untie=True)), or align without --fold.")
        readers.append(reader)
    return tuple(readers)


def _with_bias_placement(site: NormSite) -> NormSite:
    """Keep ``site``'s bias in the norm where a reader has no bias to take it."""
    if site.bias is None or all(r.bias is not None for r in site.readers):
        return site
    return replace(site, keeps_bias=True)


def _absorbing_reader(cap, user: fx.Node, value: fx.Node) -> Reader | None:
    """How ``user`` reads the norm's output ``value`` with a parameter that can absorb its weight, or None: a
    linear layer, or a two-operand einsum contracting the output's last axis with one axis of a parameter (what
    the dense experts of :mod:`symgraph.moe` compute, ``td,eod->teo``)."""
    target = str(user.target)
    if target == "aten.linear.default" and user.args[0] is value:
        weight = _param(_through_casts_back(user.args[1]), cap.params)
        bias = _param(_through_casts_back(user.args[2]), cap.params) if len(user.args) > 2 else None
        return None if weight is None else Reader(weight, bias, len(cap.shapes[weight]) - 1)
    if target == "aten.addmm.default" and user.args[1] is value and not user.kwargs:
        # GPT-2's Conv1D: bias + x @ W, W stored (in, out)
        weight = _param(_through_casts_back(user.args[2]), cap.params)
        bias = _param(_through_casts_back(user.args[0]), cap.params)
        return None if weight is None or len(cap.shapes[weight]) != 2 else Reader(weight, bias, 0)
    if target == "aten.matmul.default" and user.args[0] is value:  # x @ W.T (Falcon's linear) or x @ W
        weight, _, transposed = _matmul_weight(cap, user)
        return None if weight is None else Reader(weight, None, 1 if transposed else 0)
    if target != "aten.einsum.default" or len(user.args[1]) != 2 or value not in user.args[1]:
        return None
    equation = user.args[0].replace(" ", "")
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if "." in equation or not output or len(terms) != 2:
        return None
    mine, other = (0, 1) if user.args[1][0] is value else (1, 0)
    operand = _through_casts_back(user.args[1][other])
    weight = _param(operand, cap.params)
    letter = terms[mine][-1:] if len(set(terms[mine])) == len(terms[mine]) else ""
    if not letter or letter in output or terms[other].count(letter) != 1:
        return None
    axis = terms[other].index(letter)
    if weight is None and axis == len(terms[other]) - 1:  # DBRX's experts: rows of a 2-D weight viewed per expert
        weight = _param(_through_row_reshape(operand), cap.params)
        axis = None if weight is None else len(cap.shapes[weight]) - 1
    return None if weight is None else Reader(weight, None, axis)


def _through_row_reshape(node):
    """The tensor that reshape ``node`` regroups along its leading axes only (its last axis kept), or None."""
    if not (isinstance(node, fx.Node) and str(node.target) in _KEEPS_LAST and node.args
            and isinstance(node.args[0], fx.Node)):
        return None
    source = _through_casts_back(node.args[0])
    shape, before = _shape(node), _shape(source)
    return source if shape is not None and before is not None and shape[-1:] == before[-1:] else None


def _readers(node: fx.Node, through_numbers: bool = False) -> list[tuple[fx.Node, fx.Node]]:
    """(reader, the value it reads) for the nodes that consume ``node``'s value with its last axis intact (through
    casts, dropout, row slices, and with ``through_numbers`` products with or divisions by a number: the value is
    then the last of them), leaving out those that read only its metadata."""
    out = []
    for user in node.users:
        if _passes_last_axis(user, node) or through_numbers and _scales_by_a_number(user, node):
            out.extend(_readers(user, through_numbers))
        elif not _reads_metadata_only(user, node):
            out.append((user, node))
    return out


# -- centring the residual stream --------------------------------------------------------------------------------
def residual_writers(cap, norms: list[NormSite]) -> list[tuple[str, int]]:
    """(parameter, axis) of everything written into the residual stream that the LayerNorms read, to be centred
    along that axis. Refuses when anything but a LayerNorm reads the stream (centring would change its input)."""
    nodes = {n.name: n for n in cap.graph.nodes}
    todo = [_norm_input(nodes[n.node]) for n in norms]
    stream, writes = set(), []
    while todo:
        node = todo.pop()
        if node.name in stream:
            continue
        stream.add(node.name)
        _check_stream_readers(node, todo)
        if _is_sum(node):
            for arg in node.args[:2]:
                if isinstance(arg, (int, float)) and arg == 0:  # CTRL adds 0 where it has no token types
                    continue
                if not isinstance(arg, fx.Node):
                    raise FoldError(f"Cannot centre the residual stream: a constant {arg!r} is added to it at graph "
                                    f"node {node.name}{_source_line(node)}.", hint="align without --fold.")
                todo.append(arg)
        elif node.op == "call_function" and _same_value(node):
            todo.append(node.args[0])
        else:
            writes.extend(_writer_params(cap, node, node.meta["val"].dim() - 1))
    _check_only_writes(cap, writes)
    return list(dict.fromkeys((name, axis) for name, axis, _ in writes))


def _matmul_weight(cap, matmul: fx.Node) -> tuple[str | None, fx.Node, bool]:
    """The 2-D parameter ``matmul`` multiplies by on the right (through casts and transposes), the node that reads
    it, and whether it arrives transposed (stored (out, in), as a linear's); None when it is no such parameter."""
    reader, node, transposed = matmul, matmul.args[1], False
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        if str(node.target) in _TRANSPOSES_2D:
            transposed = not transposed
        elif not (_same_value(node) and _shape(node) is not None and _shape(node) == _shape(node.args[0])):
            break
        reader, node = node, node.args[0]
    name = _param(node, cap.params)
    return (name if name is not None and len(cap.shapes[name]) == 2 else None), reader, transposed


def _is_sum(node: fx.Node) -> bool:
    """``a + b``, or ``a += b`` where nothing else reads ``a`` (Falcon's ``mlp_output += attention_output``): the
    node's value is then the sum and nothing sees ``a`` before it."""
    target = str(node.target)
    return target == "aten.add.Tensor" or (target == "aten.add_.Tensor" and isinstance(node.args[0], fx.Node)
                                           and len(node.args[0].users) == 1 and not node.kwargs)


def _check_only_writes(cap, writes: list[tuple[str, int, fx.Node]]) -> None:
    """Centring a parameter changes every use of it: each must be one of its residual writes, all along one axis.
    Tied names are one graph input, so a tied head (the embedding as the LM head's decoder) shows up here."""
    placeholders, tied = _placeholders(cap), _tied_names(cap)
    for name in dict.fromkeys(name for name, _, _ in writes):
        mine = [(axis, reader) for n, axis, reader in writes if n == name]
        others = [u for u in placeholders[name].users if u not in {reader for _, reader in mine}]
        if others or len({axis for axis, _ in mine}) > 1:
            _refuse_centring(name, _ties(tied, name), mine[0][1], others)


def _refuse_centring(name: str, ties: list[str], writer: fx.Node, others: list[fx.Node]) -> None:
    tensor = f"{name} (tied: the same tensor as {', '.join(ties)})" if ties else name
    readers = ", ".join(f"{u.target} (graph node {u.name}{_module_of(u)})" for u in others)
    why = (f"also read by {readers}, whose result centring would change" if others
           else "written into it along different axes, which one centring cannot serve")
    raise (TiedFoldError if ties else FoldError)(
           f"Cannot centre the residual stream: {tensor} is written into it by graph node {writer.name}"
                    f"{_module_of(writer)}, and {why}.",
                    hint="untie the weights (--untie; fold(..., untie=True)), or align without --fold." if ties
                    else "align without --fold.")


def _check_stream_readers(node: fx.Node, todo: list[fx.Node]) -> None:
    """Everything that reads the stream's value at ``node`` (:func:`_readers`: through casts, reshapes and slices
    of rows; reads of its metadata alone, a shape assert or the dtype ``type_as`` takes, are none) must see it
    through a LayerNorm, which centring leaves unchanged: a LayerNorm, or an addition, whose sum is the stream
    further on (added to ``todo``, so its other terms are centred and its own readers checked)."""
    for user, value in _readers(node):
        if (_is_layer_norm(user) and user.args[0] is value) or _reads_centred(user, value):
            continue
        if _is_sum(user):
            todo.append(user)
            continue
        what = "the model's output" if user.op == "output" else f"{user.target} (graph node {user.name})"
        raise FoldError(f"Cannot centre the residual stream: its value at graph node {value.name}"
                        f"{_source_line(value)} is read by {what} without a LayerNorm in between; centring "
                        f"would change what that reader sees.", hint="align without --fold.")


def _reads_centred(user: fx.Node, value: fx.Node) -> bool:
    """``user`` is ``value - mean(value)`` over the last axis, or that mean read by nothing else: a LayerNorm
    written out sees the stream only so, and centring leaves it unchanged."""
    return centred_input(user) is value or (is_centring_mean(user) and user.args[0] is value)


def _reads_metadata_only(user: fx.Node, node: fx.Node) -> bool:
    """Does ``user`` read only ``node``'s shape or dtype: an op of rule ``ignore`` (specs/ops.yaml: asserts, sizes),
    or an ``identity`` op given ``node`` beyond its first argument (its output is the first argument's values)?"""
    spec = load_specs().op(str(user.target)) if user.op == "call_function" else None
    if spec is None:
        return False
    return spec.rule == "ignore" or (spec.rule == "identity" and bool(user.args) and user.args[0] is not node)


def _writer_params(cap, node: fx.Node, axis: int) -> list[tuple[str, int, fx.Node]]:
    """The parameters (and their axis) whose values make up ``node``'s coordinates along ``axis``, each with the
    graph node that reads it there (a parameter written directly: its readers, which are the stream's)."""
    target = str(node.target)
    rank = node.meta["val"].dim()
    if node.op == "placeholder":
        name = _param(node, cap.params)
        if name is None:
            raise FoldError(f"Cannot centre the residual stream: the input or buffer {node.name} is written into it "
                            f"directly, and only parameters can be centred.", hint="align without --fold.")
        return [(name, axis, user) for user in node.users]
    if target == "aten.linear.default" and axis == rank - 1:
        return _read_by(cap, node, node.args[1:3], 0)
    if target in ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default") and axis == 1:
        return _read_by(cap, node, node.args[1:3], 0)
    if target == "aten.embedding.default" and axis == rank - 1:
        return _read_by(cap, node, node.args[:1], 1)
    if target == "aten.addmm.default" and axis == rank - 1 and not node.kwargs:  # Conv1D: bias + x @ W, W (in, out)
        return _read_by(cap, node, node.args[2:3], 1) + _read_by(cap, node, node.args[:1], 0)
    if target == "aten.matmul.default" and axis == rank - 1:  # x @ W.T (Falcon's linear) or x @ W
        weight, reader, transposed = _matmul_weight(cap, node)
        if weight is not None:
            return [(weight, 0 if transposed else 1, reader)]
    scaled = _scaled_by_a_number(node)  # embeddings times sqrt(width) (Pegasus, BioGPT): centred with them
    inner = [(scaled, axis)] if scaled is not None and scaled.meta["val"].dim() == rank else \
        _einsum_source(node, axis) if target == "aten.einsum.default" else _movement_source(node, axis)
    if inner is None:
        raise FoldError(f"Cannot centre the residual stream: it is written by {target} (graph node {node.name}"
                        f"{_source_line(node)}), which has no parameter to centre.",
                        hint="align without --fold.")
    out = []
    for arg, arg_axis in inner:
        if arg.op == "placeholder" and _param(arg, cap.params) is not None:  # a weight the einsum reads
            out.append((_param(arg, cap.params), arg_axis, node))
            continue
        if len(arg.users) > 1:
            raise FoldError(f"Cannot centre the residual stream: graph node {arg.name} writes into it and is also "
                            f"read elsewhere.", hint="align without --fold.")
        out.extend(_writer_params(cap, arg, arg_axis))
    return out


def _read_by(cap, node: fx.Node, args, axis: int) -> list[tuple[str, int, fx.Node]]:
    return [(p, axis, node) for p in (_param(a, cap.params) for a in args) if p is not None]


def _einsum_source(node: fx.Node, axis: int):
    """The one operand of einsum ``node`` (and its axis) that holds the letter of output ``axis``: the output is
    linear in it along that letter, the other operands do not vary along it, so centring it there centres the
    output (the dense experts of :mod:`symgraph.moe`: ``ted,te->td`` mixes experts' outputs, ``tei,edi->ted`` writes
    them from the down projections); None when no single operand holds it."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    letter = output[axis] if axis < len(output) else None
    holders = [(arg, spec.index(letter)) for arg, spec in zip(operands, inputs.split(","))
               if letter is not None and letter in spec]
    if len(holders) != 1 or not isinstance(holders[0][0], fx.Node) or holders[0][1] != inputs.split(",")[
            operands.index(holders[0][0])].rindex(letter):
        return None  # several operands vary along it (a product), or a repeated letter (a diagonal)
    return holders


def _movement_source(node: fx.Node, axis: int):
    """Where ``node``'s ``axis`` comes from in its inputs, for the movement ops that write embeddings into a
    stream (cat of a class token, flatten and transpose of a patch grid, expand, casts); None otherwise."""
    target, args = str(node.target), node.args
    rank = node.meta["val"].dim()
    if target in ("aten.cat.default", "aten.concat.default"):
        dim = (args[1] if len(args) > 1 else 0) % rank
        return None if dim == axis else [(a, axis) for a in args[0]]
    if not isinstance(args[0], fx.Node) or not isinstance(args[0].meta.get("val"), torch.Tensor):
        return None  # a constant, or one output of a multi-output op (max pooling with its indices): no movement
    in_rank = args[0].meta["val"].dim()
    if target == "aten.transpose.int":
        d0, d1 = args[1] % rank, args[2] % rank
        return [(args[0], {d0: d1, d1: d0}.get(axis, axis))]
    if target == "aten.flatten.using_ints":
        start, end = (args[1] if len(args) > 1 else 0) % in_rank, (args[2] if len(args) > 2 else -1) % in_rank
        if axis == start and end > start:
            return None  # the coordinates are mixed with other axes
        return [(args[0], axis if axis < start else axis + end - start)]
    if target == "aten.expand.default":
        shift = axis - (rank - in_rank)
        same = shift >= 0 and _shape(args[0])[shift] == _shape(node)[axis]
        return [(args[0], shift)] if same else None
    if _passes_last_axis(node, args[0]) and axis == rank - 1:
        return [(args[0], in_rank - 1)]
    return None


# -- graph helpers ---------------------------------------------------------------------------------------------------
_SAME_VALUE_RULES = ("identity",)
_TRANSPOSES_2D = ("aten.t.default", "aten.numpy_T.default")  # of a 2-D weight: rows and columns swapped
_ROW_SELECTIONS = ("aten.select.int", "aten.slice.Tensor", "aten.narrow.default")
_KEEPS_LAST = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.clone.default",
               "aten.contiguous.default", "aten.alias.default", "aten.detach.default")


def _passes_last_axis(user: fx.Node, node) -> bool:
    """Does ``user`` hand ``node``'s value on unchanged along its last axis (a cast, dropout, a slice of rows, a
    reshape of the leading axes)?"""
    if user.op != "call_function" or not user.args or user.args[0] is not node or not isinstance(node, fx.Node):
        return False
    target = str(user.target)
    spec = load_specs().op(target)
    if spec is not None and spec.rule in _SAME_VALUE_RULES and not spec.negates:
        return True
    out, src = _shape(user), _shape(node)
    if out is None or src is None or out[-1:] != src[-1:]:
        return False
    if target in _ROW_SELECTIONS:
        return (user.args[1] if len(user.args) > 1 else 0) % len(src) != len(src) - 1
    return target in _KEEPS_LAST


def _same_value(node: fx.Node) -> bool:
    """A cast, dropout or reshape: the same values along the last axis, every row kept."""
    return bool(node.args) and _passes_last_axis(node, node.args[0]) and str(node.target) not in _ROW_SELECTIONS


def _through_casts_back(node):
    """The tensor ``node`` holds unchanged in the same shape (a parameter read in another dtype), or ``node``:
    :func:`_through_identity_back` where every axis keeps its meaning, as a reader weight's absorbing axis must."""
    while isinstance(node, fx.Node) and node.op == "call_function" and _same_value(node) \
            and _shape(node) is not None and _shape(node) == _shape(node.args[0]):
        node = node.args[0]
    return node


def _shape(node: fx.Node) -> tuple | None:
    """The node's shape, each size known only at run time as its symbol's name (``u0``: the images a
    vision-language model keeps, picked by pixel values), so that shapes compare without asking torch to decide a
    size the trace left open (which raises GuardOnDataDependentSymNode)."""
    val = node.meta.get("val")
    shape = getattr(val, "shape", None) if isinstance(val, torch.Tensor) else None
    return None if shape is None else tuple(d if isinstance(d, int) else str(d) for d in shape)


def _numel(node: fx.Node) -> float | None:
    """Elements of the node's value (None: not a tensor; infinite where a size is known only at run time: many)."""
    shape = _shape(node)
    if shape is None:
        return None
    return math.prod(shape) if all(isinstance(d, int) for d in shape) else math.inf


def _through_identity_back(node):
    while isinstance(node, fx.Node) and node.op == "call_function" and _same_value(node):
        node = node.args[0]
    return node


def _placeholders(cap) -> dict[str, fx.Node]:
    """Parameter name -> its graph placeholder."""
    return {cap.params[n.name]: n for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.params}


def _ties(tied: dict[str, list[str]], name: str) -> list[str]:
    """The other names of the tensor ``name`` (tied weights), which the graph reads as ``name``."""
    return [n for n in tied.get(name, ()) if n != name]


def _tied_names(cap) -> dict[str, list[str]]:
    return {n: names for names in _aliases(cap.model) for n in names}


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()), ("",))[0] if stack else ""
    return f", module {path}" if path else ""


def _source_line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = next((t.strip() for t in reversed(trace) if t.strip().startswith("File ")), "")
    return f"; {line}" if line else ""


# -- the rewrite -----------------------------------------------------------------------------------------------------
def _folded_params(state, norms: list[NormSite]) -> dict[str, torch.Tensor]:
    """New tensors for every norm and reader parameter, computed in float64 and cast back."""
    out = {}
    for site in norms:
        g = site.scale(state[site.weight].double()) if site.weight else None
        beta = state[site.bias].double() if site.bias else None
        for reader in site.readers:
            weight, bias = reader.weight, reader.bias
            w = state[weight].double()
            if beta is not None and not site.keeps_bias:
                out[bias] = (state[bias].double() + torch.tensordot(w, beta, dims=([reader.axis], [0]))).to(
                    state[bias].dtype)
            if g is not None:
                out[weight] = reader.absorb(w, g).to(state[weight].dtype)
        if site.weight:
            out[site.weight] = site.folded_weight(state[site.weight])
        if site.keeps_bias and g is not None and bool((g == 0).any()):
            raise FoldError(f"Cannot fold {site.describe()}: its bias {site.bias} stays in the norm (a reader has "
                            f"no bias to take it), divided by the norm's weight, which has zeros.",
                            hint="align without --fold.")
        if site.bias:  # g x + b = g (x + b / g): the readers absorb g, the norm keeps b / g
            kept = beta / g if site.keeps_bias and g is not None else beta
            out[site.bias] = kept.to(state[site.bias].dtype) if site.keeps_bias else torch.zeros_like(state[site.bias])
    return out


def _centred(state, targets: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, axis in targets:
        x = state[name].double()
        out[name] = (x - x.mean(dim=axis, keepdim=True)).to(state[name].dtype)
    return out


def _verify(subject, result: FoldResult, exact) -> None:
    """The folded state must compute what the source computes (``exact``: the fold without rounding, for a
    result past the fixed tolerance; see :meth:`symgraph.verify.Evaluator.check`)."""
    from .verify import Evaluator

    outcome = Evaluator(subject.model, subject.args, subject.kwargs).check(result.state, rounding_floor=True,
                                                                           exact=exact)
    if not outcome.ok:
        raise InvarianceError(
            f"The folded model differs from {subject.name} ({outcome.describe()}); nothing was written.",
            hint="report this as a bug with the model's config; align without --fold meanwhile.")
    result.verified_error, result.verified_rounded = outcome.relative_error, outcome.rounded_exact
