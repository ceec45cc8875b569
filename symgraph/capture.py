"""Capture: a model and example inputs become a torch.fx graph of ATen ops with named parameters.

``torch.export.export(..., strict=False)`` keeps ``linear``, ``layer_norm`` and ``scaled_dot_product_attention``
as single nodes (no decompositions are run). Parameters may live on the meta device (config-only capture): the
analysis only needs their shapes, and the concrete values it does need (positions, masks, rotary tables) are
computed from parameter-free parts of the graph by :func:`data_values`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_map

from .errors import CaptureError
from .module_state import attributes_kept, eval_mode, parameter_names
from .moe import DENSE, experts_implementation

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capture:
    """An exported model: its ATen graph and how graph placeholders map to state-dict names."""

    program: torch.export.ExportedProgram
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    params: dict[str, str]  # placeholder name -> parameter name (trainable or not, as in state_dict)
    buffers: dict[str, str]  # placeholder name -> buffer or lifted-constant name
    user_inputs: tuple[str, ...]  # placeholder names of the example inputs, in graph order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter name -> shape
    # parameters the traced run read only in ops whose results nothing used (removed from the graph)
    read_unused: frozenset[str] = frozenset()
    # inputs of another modality that forward takes and the trace was not given, where it left parameters unread
    # (a vision tower), and the names of the token embeddings' weight: what those inputs compute is written into
    # the embeddings' output by code the trace never took (:func:`untraced_inputs`)
    untraced_inputs: tuple[str, ...] = ()
    token_embeddings: frozenset[str] = frozenset()
    # optional inputs symgraph added to the example inputs, and the parameters only a trace with them reads
    # (XLNet's segment embeddings, with token_type_ids: :func:`symgraph.inputs.optional_inputs`)
    added_inputs: tuple[str, ...] = ()
    read_with_added: tuple[str, ...] = ()
    # the token length given and the longer one traced instead, and the parameters only the longer trace reads
    # (DeepSeek-V4's compressor, from 128 tokens: :func:`_traced_longer`)
    lengthened: tuple[int, int] | None = None
    read_when_longer: tuple[str, ...] = ()
    filled_when_longer: int = 0  # values empty at the length given that the longer trace fills (CANINE's molecules)

    @property
    def graph(self) -> fx.Graph:
        return self.program.graph

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(self.params.values())


def capture(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
            add_optional: bool = True) -> Capture:
    """Export ``model`` on the example inputs and index its placeholders.

    Where the trace leaves parameters unread and ``forward`` takes optional inputs that may read them, which the
    example inputs lack and symgraph can build (:func:`symgraph.inputs.optional_inputs`: XLNet's
    ``token_type_ids``, a decoder's ``encoder_hidden_states``), the model is traced again with them added, and that
    trace is kept where it reads more parameters (:attr:`Capture.added_inputs`; its ``kwargs`` hold them): the groups
    found then keep the function with those inputs too (``add_optional=False``: never; a trace that runs data as it
    is, to record activations). Where parameters are still unread, a token model is traced once more at a longer
    length and that trace is kept where it reads more (:func:`_traced_longer`). Where inputs of another modality
    were not given, the stream they enter is recorded for the walk to pin (:func:`untraced_inputs`).

    Examples
    --------
    >>> import torch
    >>> cap = capture(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> sorted(cap.params.values())
    ['bias', 'weight']
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    cap = _exported(model, args, kwargs)
    unread = unread_parameters(cap)
    extra = _optional_inputs(model, kwargs) if unread and add_optional else {}
    if extra:  # inputs that read them: groups found without them would leave those parameters behind
        try:
            fuller = _exported(model, args, {**kwargs, **extra})
        except CaptureError as exc:
            _log.info("%s traced without %s: with them it could not be traced (%s)", type(model).__name__,
                      ", ".join(extra), exc)
        else:
            reached = unread - unread_parameters(fuller)
            if reached:
                cap = dataclasses.replace(fuller, added_inputs=tuple(extra), read_with_added=tuple(sorted(reached)))
    untraced = untraced_inputs(model, cap.args, cap.kwargs) if _any_unread(cap) else ()
    if add_optional and not untraced and (unread_parameters(cap) or _empty_values(cap)):  # a length's effect?
        cap = _traced_longer(model, cap)
    embeddings = _token_embeddings(model) if untraced else frozenset()
    if untraced and not embeddings:
        raise CaptureError(f"{type(model).__name__} was traced without its {', '.join(untraced)}, and the "
                           "parameters that read them were left unread; symgraph cannot tell where the model puts "
                           "what they compute (it has no get_input_embeddings() with a weight), so no group could "
                           "be known to keep its function on them.",
                           hint=f"pass example inputs with {untraced[0]} (inputs=... in Python, or return (module, "
                                "args) from the factory).")
    return dataclasses.replace(cap, untraced_inputs=untraced, token_embeddings=embeddings)


# a token length to trace again at where parameters stay unread: attention that compresses or chunks its keys reads
# its compressor only from a window's length on (DeepSeek-V4's, 128 tokens), past the short example inputs and the
# probes grown from them; or where values are empty: CANINE keeps all but the last of its molecules (4 characters
# each), none of 7 characters', so a concatenation joined the characters' stream with an empty piece of the
# molecules' and the groups found there moved the molecules' norm with the characters' (a change of 1.5e-2 in its
# outputs at 17 characters); capped by the config's position count
_LONGER_TOKENS = 512


def _empty_values(cap: Capture) -> int:
    """How many values the traced graph computes with no entries (an axis of size 0; sizes known only at run time,
    routed rows, are not counted)."""
    return sum(1 for n in cap.graph.nodes if n.op == "call_function"
               and isinstance(val := n.meta.get("val"), torch.Tensor) and 0 in [d for d in val.shape if type(d) is int])


def _traced_longer(model: torch.nn.Module, cap: Capture) -> Capture:
    """``cap``, or a trace at :data:`_LONGER_TOKENS` tokens (every input of the token ids' length grown with them)
    where that reads parameters ``cap`` leaves unread, or computes fewer empty values: groups found at the short
    length would leave those parameters behind, or join what the empty values carry at longer lengths as if it were
    not there, and the model computes something else on long inputs."""
    from .inputs import longest_tokens
    from .probes import lengthened_inputs

    ids = cap.kwargs.get("input_ids")
    length = longest_tokens(getattr(model, "config", None), _LONGER_TOKENS)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or length <= ids.shape[1]:
        return cap
    args, kwargs = lengthened_inputs(cap.args, cap.kwargs, ids.shape[1], length)
    try:
        longer = _exported(model, args, kwargs)
    except CaptureError as exc:
        _log.info("%s traced at %d tokens: at %d it could not be traced (%s)", type(model).__name__, ids.shape[1],
                  length, exc)
        return cap
    reached = unread_parameters(cap) - unread_parameters(longer)
    filled = _empty_values(cap) - _empty_values(longer)
    if not reached and filled <= 0:
        return cap
    return dataclasses.replace(longer, added_inputs=cap.added_inputs, read_with_added=cap.read_with_added,
                               lengthened=(ids.shape[1], length), read_when_longer=tuple(sorted(reached)),
                               filled_when_longer=max(filled, 0))


def _exported(model: torch.nn.Module, args: tuple, kwargs: dict) -> Capture:
    """``model`` exported on ``args`` and ``kwargs``, its placeholders indexed (no check of what it left unread)."""
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    traced_args, traced_kwargs = _on_meta(args, kwargs) if on_meta else (tuple(args), kwargs)
    try:  # mixture-of-experts layers trace in dense form, with the expert axis kept (see symgraph.moe)
        with torch.no_grad(), _quiet(), eval_mode(model), experts_implementation(model, DENSE), \
                attributes_kept(model):
            _frequencies_held(model)
            real = _module_tensors_to_meta(model) if on_meta else {}
            program = torch.export.export(model, traced_args, traced_kwargs, strict=False)
    except Exception as exc:  # torch raises many unrelated types; all mean "could not trace"
        raise CaptureError(_describe_export_failure(model, exc), hint=_export_hint(exc, kwargs)) from exc
    sig = program.graph_signature
    _put_back_values(program, real)
    read_unused = _drop_unused_ops(program)
    params, buffers, users = {}, {}, []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            buffers[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            users.append(name)
    shapes = {target: tuple(program.state_dict[target].shape) for target in params.values()}
    return Capture(program, model, args, kwargs, params, buffers, tuple(users), shapes,
                   frozenset(params[name] for name in read_unused if name in params))


# transformers' rotary embeddings with dynamic NTK scaling recompute their frequencies from the largest position's
# value on every call (``if max(position_ids) + 1 > cached``), a branch on data export cannot take. Below the
# original context they keep the frequencies they hold, so they are traced as plain rotary embeddings with those
# (the groups they allow, rotations within each frequency's planes, commute with the frequencies of any length)
_UPDATED_ROTARY = "dynamic"


def _frequencies_held(model: torch.nn.Module) -> None:
    """Make every rotary embedding that updates its frequencies at run time use the ones it holds (undone by the
    caller's :func:`attributes_kept`)."""
    def held(kind):
        return "default" if isinstance(kind, str) and _UPDATED_ROTARY in kind else kind

    for module in model.modules():
        kind = vars(module).get("rope_type")
        if isinstance(kind, dict):
            module.rope_type = {layer: held(k) for layer, k in kind.items()}
        elif kind is not None:
            module.rope_type = held(kind)


def _any_unread(cap: Capture) -> bool:
    """Whether the trace left any parameter placeholder unread (a tied alias of a read one included)."""
    return any(not n.users for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.params)


def unread_parameters(cap: Capture) -> frozenset[str]:
    """The parameters the traced graph never reads, under any name: a tied alias (an LM head that is the
    embedding) of a parameter read under another name is read."""
    read = {cap.params[n.name] for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.params and n.users}
    unread = {cap.params[n.name] for n in cap.graph.nodes
              if n.op == "placeholder" and n.name in cap.params and not n.users}
    if not unread:
        return frozenset()
    by_name = {name: names for names in parameter_names(cap.model).values() for name in names}
    return frozenset(name for name in unread if not by_name.get(name, {name}) & read)


def added_inputs_note(cap: Capture) -> str | None:
    """The report's note on the optional inputs :func:`capture` added to the example inputs (None: none)."""
    if not cap.added_inputs:
        return None
    shown = _listed(cap.read_with_added)
    them = "them" if len(cap.added_inputs) > 1 else "it"
    return (f"traced with {', '.join(cap.added_inputs)} added by symgraph (random values): without {them} the "
            f"model leaves {shown} unread, parameters it reads when given {them}; the groups found hold with "
            f"{them}, and the checks run with {them}")


def lengthened_note(cap: Capture) -> str | None:
    """The report's note on a trace :func:`capture` took at a longer token length than given (None: none)."""
    if cap.lengthened is None:
        return None
    given, traced = cap.lengthened
    why = []
    if cap.read_when_longer:
        why.append(f"the model leaves {_listed(cap.read_when_longer)} unread, parameters it reads on longer inputs "
                   f"(an attention that compresses or chunks its keys from a window's length on)")
    if cap.filled_when_longer:
        why.append(f"{cap.filled_when_longer} of the values it computes are empty, which longer inputs fill (a cut "
                   f"or pooling that leaves nothing of short inputs)")
    return (f"traced at {traced} tokens instead of the {given} given: at {given} {' and '.join(why)}; the groups "
            f"found hold at both lengths, and the checks run at {traced}")


def unread_note(cap: Capture) -> str | None:
    """The report's note on parameters the traced graph never reads (None: it reads them all): no group moves
    them, and a code path the trace did not take (an input not given, a training-only branch) may read them."""
    names = sorted(unread_parameters(cap))
    if not names:
        return None
    them = "them" if len(names) > 1 else "it"
    return (f"{len(names)} parameter{'s' if len(names) > 1 else ''} unread at the traced inputs, so held fixed by "
            f"every group: {_listed(names)} (code the trace did not take may read {them}: pass inputs that reach "
            f"that code to have {them} aligned)")


def _listed(names, most: int = 4) -> str:
    """The first ``most`` of ``names``, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _optional_inputs(model: torch.nn.Module, kwargs: dict) -> dict[str, torch.Tensor]:
    """The optional inputs ``model.forward`` takes that could read parameters a trace on ``kwargs`` left unread
    (:func:`symgraph.inputs.optional_inputs`), in the dtype of the model's floating parameters."""
    from .inputs import optional_inputs

    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return optional_inputs(getattr(model, "config", None), names, kwargs, dtype=dtype)


# forward parameters that carry another modality than token ids (images, video, audio) by name: any name of such
# data, but not what only describes it (masks, sizes, grids, positions, counts, switches). Naming too many is safe:
# an input named here pins the stream only where the trace was not given it and left parameters unread.
_MODALITY_INPUT = re.compile(r"^(?!.*(mask|size|label|position|grid|num_|layer|strategy|aspect|type|length|offset|"
                             r"crop|pool|scale|merge|return|use_|select|second|alignment|bbox|compression|idx))"
                             r".*(pixel|image|video|audio|visual|vision|speech|patches|mel|spectrogram|"
                             r"input_features|input_values)")


def untraced_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The inputs of another modality than the traced ones that ``model.forward`` takes and the trace was not
    given (a vision-language model traced on text: its ``pixel_values``). Where the trace left parameters unread,
    the model's code puts what those inputs compute into the sequence it embeds, so every group of the stream they
    enter must hold them fixed: the walk pins the token embeddings' output (:attr:`Capture.token_embeddings`)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return ()
    given = set(kwargs) | set(names[:len(args)])
    return tuple(n for n in names if _MODALITY_INPUT.match(n) and n not in given)


def _token_embeddings(model: torch.nn.Module) -> frozenset[str]:
    """Every state-dict name of the weight of ``model.get_input_embeddings()`` (tied heads share it)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return frozenset()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return frozenset()
    return frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if p is weight)


def _drop_unused_ops(program: torch.export.ExportedProgram) -> set[str]:
    """Remove the ops whose results nothing reads (export keeps them: a product computed, then overwritten);
    their links would describe reads the model never makes (a head that seems to read another head's values).
    Returns the placeholders (parameters, buffers, constants) that only such ops read."""
    graph = program.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    read_before = {n.name for n in placeholders if n.users}
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return read_before - {n.name for n in placeholders if n.users}


def _on_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs as export should see them when the parameters live on the meta device (a config-only
    model or a shallow copy): on the meta device too, since torch refuses ops that mix meta and CPU tensors. The
    capture keeps the CPU inputs: :func:`data_values` evaluates the data nodes (positions, masks) on them."""

    def to_meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value

    return tree_map(to_meta, (tuple(args), kwargs))


def _module_tensors_to_meta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move every buffer and tensor attribute of a meta-parameter model to the meta device for the trace (a
    rotary table indexed by meta positions, as GPT-J's is, must be meta too), and return the real values by
    qualified name. The caller restores the modules (:func:`~symgraph.module_state.attributes_kept`)."""
    real, moves = {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):  # a shared module: every name it has
        for name, value in [*module._buffers.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and value.device.type != "meta":
                real[f"{prefix}.{name}" if prefix else name] = value
                moves[id(module), name] = module, name, value
    for module, name, value in moves.values():
        if name in module._buffers:
            module._buffers[name] = value.to("meta")
        else:
            setattr(module, name, value.to("meta"))
    return real


def _put_back_values(program: torch.export.ExportedProgram, real: dict[str, torch.Tensor]) -> None:
    """The traced program's buffers and lifted tensor attributes get their real values back (the analysis reads
    them: rotary tables, masks, slopes); parameters stay meta."""
    for spec in program.graph_signature.input_specs:
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) and spec.target in real:
            store = program.state_dict if spec.target in program.state_dict else program.constants
            store[spec.target] = real[spec.target]


def data_values(cap: Capture, constants: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Concrete values of every node that depends on no parameter (positions, masks, rotary tables).

    Nodes that read a parameter map to ``None``; so do nodes that could not be evaluated. Parameters may be meta
    tensors: only those named in ``constants`` (held fixed by every group) are read, where they have values.
    Floating data is computed in double precision, the precision groups are checked in: entries that differ only
    below float32's rounding (the cosines of a rotary table's lowest frequencies at a few positions, all 1.0 in
    float32) are told apart, as they are by the model's function.
    """
    program = cap.program
    flat_inputs = program._graph_module_flat_inputs(cap.args, cap.kwargs)
    values: dict[str, Any] = {}
    graph_module = program.graph_module
    placeholders = [n for n in cap.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, flat_inputs):
        values[node.name] = _constant(cap, node.name, constants) if node.name in cap.params \
            else _in_double(_concrete(value))
    for node in cap.graph.nodes:
        if node.op == "get_attr":
            values[node.name] = _in_double(getattr(graph_module, node.target))
        elif node.op == "call_function":
            values[node.name] = _evaluate(node, values)
    return values


def _constant(cap: Capture, placeholder: str, constants: frozenset[str]) -> torch.Tensor | None:
    """The stored value of a parameter named in ``constants``, in double precision (None for the others, and for
    meta parameters, which have no value)."""
    value = cap.program.state_dict.get(cap.params[placeholder]) if cap.params[placeholder] in constants else None
    return None if value is None or value.device.type == "meta" else _in_double(value.detach())


def _evaluate(node: fx.Node, values: dict[str, Any]) -> Any:
    missing = False

    def load(arg):
        nonlocal missing
        if isinstance(arg, fx.Node):
            value = values.get(arg.name)
            if value is None:
                missing = True
            return value
        return arg

    args = fx.node.map_aggregate(node.args, lambda a: _in_double(load(a)))
    kwargs = fx.node.map_aggregate(node.kwargs, lambda a: _in_double(load(a)))
    if missing:
        return None
    if _is_meta_device(kwargs.get("device")):  # config-only models build positions "on the model's device"
        kwargs = {**kwargs, "device": torch.device("cpu")}
    args = tuple(torch.device("cpu") if _is_meta_device(a) else a for a in args)
    try:
        with torch.no_grad():
            return _concrete(node.target(*args, **kwargs))
    except Exception:  # a data node we cannot replay stays unknown; the analysis treats unknown data as varying
        return None


_DOUBLE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
           torch.complex32: torch.complex128, torch.complex64: torch.complex128}


def _in_double(value: Any) -> Any:
    """A floating tensor or dtype in double precision (a cast to float32 inside the graph stays double)."""
    if isinstance(value, torch.dtype):
        return _DOUBLE.get(value, value)
    if isinstance(value, torch.Tensor) and value.dtype in _DOUBLE:
        return value.to(_DOUBLE[value.dtype])
    return value


def _is_meta_device(value) -> bool:
    return isinstance(value, (torch.device, str)) and str(value) == "meta"


def _concrete(value: Any) -> Any:
    """Meta tensors carry no values: treat them as unknown."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return None
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.device.type == "meta"
                                                for v in value):
        return None
    return value


def _describe_export_failure(model: torch.nn.Module, exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "site-packages/torch" not in f.filename]
    where = f" (last user frame: {user[-1].filename}:{user[-1].lineno} in {user[-1].name})" if user else ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {first_line[:300]}"
            f"{where}.")


def _export_hint(exc: Exception, kwargs: dict) -> str:
    if "Couldn't swap" in str(exc):
        return ("the model's forward replaces one of its own submodules (`self.layer = self.layer.to(...)` at the "
                "line named above), which torch.export cannot trace; override that forward without the "
                "reassignment (the cast is a no-op once the model is loaded in that dtype).")
    if any(f.name == "_detect_is_causal_mask" for f in traceback.extract_tb(exc.__traceback__)):
        return ("torch.nn's transformer layers compare a given attention mask with a causal one, a branch on its "
                "values: pass is_causal=True (tgt_is_causal=True for a decoder) with the causal mask.")
    if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
        other = [name for name in kwargs if _MODALITY_INPUT.match(name)]
        instead = (f"; or pass the inputs without {', '.join(other)} (and what sizes them, such as a grid): the "
                   "stream what they compute enters is then pinned, and the groups found hold with them too"
                   if other else "")
        return ("the model branches on tensor values (data-dependent control flow) at the line named above; make "
                f"the branch depend on shapes or config only, or express it with torch.cond{instead}.")
    return ("pass example inputs that match forward(), disable caches (use_cache=False), or wrap the "
            "untraceable part in a module that torch.export supports.")


_NOISY_LOGGERS = ("torch._export", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                  "torch._subclasses.fake_tensor", "torch._functorch")


@contextlib.contextmanager
def _quiet():
    """torch logs its own warnings (with tracebacks) while an export fails; our error says what matters."""
    import logging

    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sink = io.StringIO()  # a failing export also prints the partial graph
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
