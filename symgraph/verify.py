"""Numerical invariance: does a transformed state dict compute what the original computes?

Models are evaluated in float64 with ``torch.func.functional_call`` on a float64 copy, so nothing the caller holds
is modified. Every check runs the example inputs and variants of other shapes (a grown one: larger batch, longer
sequences, a padding mask; a shrunk one: batch size 1, shorter sequences) and the shortest lengths the model
takes, 1 and 2 (a one-token fast path, or a cut at a fixed place that crosses into learned tokens, shows only
there; :func:`symgraph.probes.every_probe`), because the graph was traced at one shape only. The relative error
``||f(g.theta) - f(theta)|| / ||f(theta)||`` is compared with a tolerance that reflects the dtype actually computed
(HF RMSNorm and eager softmax upcast to fp32 internally) and the precision the state is stored in; a result
computed in float64 and stored in float32 (an alignment, a transform) may also miss by ``ROUNDING_FLOORS`` times
what one more rounding of it changes (:meth:`Evaluator.rounding_floor`), where its elements applied without
rounding are exact; one stored in bf16 or fp16, whose floors are too near a change of function to tell them apart,
passes instead where its elements are exact and every stored tensor lies within ``ROUNDINGS`` roundings of theirs
(:class:`RoundedExact`). Tied names are one tensor in a model: the name whose value
a state changed speaks for all of them (:func:`tie_aliases`), and a state changing them differently is refused.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import InvarianceError, UnverifiableError
from .module_state import attributes_kept, copied_module
from .moe import REFERENCE, use_experts_implementation

FLOAT64_TOL = 1e-9


@dataclass(frozen=True)
class RoundedExact:
    """Why a state stored in bf16 or fp16 whose outputs miss the fixed tolerance may still be right: the same
    result computed without rounding to the stored dtype (its elements applied to the source's weights in float64;
    a fold's rewrite in float64) changes the outputs by ``exact_error`` (against ``exact_tolerance``, what the
    model computes in), and the farthest stored tensor, ``tensor``, lies ``roundings`` unit roundoffs of its dtype
    from that result's (``||stored - exact|| / (u ||exact||)``; at most ``ROUNDINGS``)."""

    exact_error: float
    exact_tolerance: float
    roundings: float
    tensor: str

    @property
    def ok(self) -> bool:
        return self.exact_error <= self.exact_tolerance and self.roundings <= ROUNDINGS

    def describe(self) -> str:
        return (f"computed without rounding to the stored dtype it changes the outputs by {self.exact_error:.1e} "
                f"(tolerance {self.exact_tolerance:.0e}), and every stored tensor is within {self.roundings:.2f} "
                f"roundings of that result (at most {ROUNDINGS}; farthest: '{self.tensor}')")


@dataclass(frozen=True)
class Outcome:
    relative_error: float
    tolerance: float
    rounded_exact: RoundedExact | None = None  # computed where a bf16/fp16 state missed the tolerance

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance or bool(self.rounded_exact and self.rounded_exact.ok)

    def describe(self) -> str:
        """The comparison in words, for messages: the error and the tolerance, and how a miss was judged."""
        text = f"relative error {self.relative_error:.2e}, tolerance {self.tolerance:.1e}"
        if self.rounded_exact is not None:
            verdict = "rounding of an exact result" if self.rounded_exact.ok else "not the rounding of an exact result"
            text += f"; {verdict}: {self.rounded_exact.describe()}"
        return text


class Evaluator:
    """Runs one model in float64 with substitute parameters on inputs of several shapes; caches the reference
    outputs. ``shapes=False`` checks the given inputs only. ``free_outputs`` (a report's, with ``--free-outputs``)
    are outputs whose basis moves with a group: :meth:`check` undoes the elements' action on them."""

    def __init__(self, model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, shapes: bool = True,
                 free_outputs: tuple = ()):
        from .probes import every_probe, shape_summary

        self.free_outputs = tuple(free_outputs or ())
        # experts run transformers' reference loop: it has float64 kernels, and it is not the dense form we trace
        self.model = use_experts_implementation(copied_module(model), REFERENCE).to(torch.float64).eval()
        args, kwargs = _cast_inputs(args, kwargs or {}, torch.float64)
        self.casts = _needs_casts(self.model, args, kwargs)
        with float64_default(self.casts):
            self.probes = every_probe(self.model, args, kwargs) if shapes else [(args, kwargs)]
        self.state = {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items()}
        self.aliases = _aliases(self.model)
        self.references, self.tolerance = self._references(model)
        for (args, kwargs), ref in zip(self.probes, self.references):
            if not bool(ref.isfinite().any()):
                raise UnverifiableError(
                    f"{type(model).__name__} cannot be checked: in float64 every output it gives on inputs "
                    f"{shape_summary((args, kwargs))} is NaN or infinite, so no transformation of it can be "
                    f"verified (its code may add float64's lowest number to itself in an attention mask).",
                    hint="fix the model's float64 path; in Python, verify=False skips the check at your own risk.")

    def _references(self, model) -> tuple[list[torch.Tensor], float]:
        """The outputs with the model's own weights, and the tolerance for the lowest precision computed. A
        higher-order operator (``torch.cond``) cannot run under the dispatch mode that records it: then the
        precision is unknown, and float32's tolerance is assumed (the model's code may cast)."""
        try:
            with _LowestFloat() as seen:
                return self.outputs(self.state), TOLERANCE[seen.lowest]
        except Exception:  # noqa: BLE001 -- rerun without the recorder; the model's own error is raised below
            pass
        try:
            return self.outputs(self.state), TOLERANCE[torch.float32]
        except Exception as exc:
            raise _refusal(type(model).__name__, self.model, self.probes, exc) from exc

    @classmethod
    def of(cls, subject, **kwargs) -> "Evaluator":
        """The evaluator of a :class:`~symgraph.api.Subject`, with its free outputs when it asked for them."""
        free = subject.report.free_outputs if getattr(subject, "free_outputs", False) else ()
        return cls(subject.model, subject.args, subject.kwargs, free_outputs=free, **kwargs)

    def outputs(self, state: dict[str, torch.Tensor], transforms: dict | None = None) -> list[torch.Tensor]:
        """The model's flattened float outputs on each probe input; ``transforms`` (output index -> matrix, from
        :func:`symgraph.outputs.output_transforms`) are undone on the free outputs first."""
        state = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}
        state = _tied(self.aliases, state, self.state, "The state to check")
        return [self._run(state, args, kwargs, transforms) for args, kwargs in self.probes]

    def _run(self, state, args, kwargs, transforms=None) -> torch.Tensor:
        state = dict(state)  # functional_call rewrites its dict where one module is reached by two names
        with torch.no_grad(), float64_default(self.casts), attributes_kept(self.model):  # a run sets nothing
            out = torch.func.functional_call(self.model, state, args, kwargs, tie_weights=False)
        return flat_outputs(out, self.free_outputs, transforms)

    def check(self, state: dict[str, torch.Tensor], elements=(), *, rounding_floor: bool = False,
              exact=None) -> Outcome:
        """Compare outputs at every probe shape (the worst relative error counts); parameters stored in a lower
        precision (a float32 copy) widen the tolerance. ``elements``: those applied to get ``state``, in order
        (free outputs are compared after undoing them; other outputs must not need it). ``rounding_floor`` (a
        result computed in float64 and stored rounded to float32, as alignments and transforms are): where the
        error exceeds the fixed tolerance and ``elements`` applied in float64 without rounding compute what the
        model computes, the tolerance is also ``ROUNDING_FLOORS`` times the state's own rounding floor
        (:meth:`rounding_floor`), for models whose outputs one rounding moves more than most. bf16 and fp16
        states, whose floors are within a few hundred of a change of function (1 / epsilon), pass instead where
        those exact elements' tensors, rounded, are what is stored (:class:`RoundedExact`). ``exact``, for a result
        that is no group element (a fold): a function giving it computed in float64, nothing rounded, which stands
        for the elements; with neither, the fixed tolerance."""
        from .outputs import output_transforms

        transforms = output_transforms(self.free_outputs, elements) if self.free_outputs else None
        outputs = self.outputs(state, transforms)
        err = worst_change(outputs, self.references)
        stored = [TOLERANCE[t.dtype] for t in state.values() if t.is_floating_point() and t.dtype in TOLERANCE]
        tolerance = max([self.tolerance, *stored])
        low = {t.dtype for t in state.values() if t.is_floating_point() and t.dtype != torch.float64}
        half = bool(low & {torch.bfloat16, torch.float16})
        if not (rounding_floor and err > tolerance and (elements or exact is not None)
                and (half or low == {torch.float32})):
            return Outcome(err, tolerance)
        unrounded, exact_err = self._exact(exact() if exact is not None else None, elements, transforms)
        if not half:
            if exact_err <= self.tolerance:
                tolerance = max(tolerance, ROUNDING_FLOORS * self.rounding_floor(state, transforms, outputs))
            return Outcome(err, tolerance)
        # tied names compared as the model holds them: one tensor
        stored, unrounded = (_tied(self.aliases, s, self.state, "The state to check") for s in (state, unrounded))
        return Outcome(err, tolerance, RoundedExact(exact_err, self.tolerance, *rounding_distance(stored, unrounded)))

    def _exact(self, unrounded, elements, transforms) -> tuple[dict[str, torch.Tensor], float]:
        """The unrounded result (``unrounded``, or ``elements`` applied in float64 to the model's own weights) and
        how much it changes what the model computes: only where the change is within the tolerance of what the model
        computes in is a miss of the rounded state rounding, and never a group that is not a symmetry."""
        from .elements import apply

        unrounded = apply(self.state, list(elements)) if unrounded is None else unrounded
        return unrounded, worst_change(self.outputs(unrounded, transforms), self.references)

    def rounding_floor(self, state: dict[str, torch.Tensor], transforms=None, outputs=None) -> float:
        """The relative output change one more rounding of every entry stored below float64 makes (each entry
        times 1 + a normal draw of half its precision's epsilon; tied names nudged alike): how finely ``state``
        computes at all. ``outputs``: the state's own, when already computed."""
        nudged = {}
        for name, value in state.items():
            if not value.is_floating_point() or value.dtype == torch.float64:
                nudged[name] = value
                continue
            x = value.to(torch.float64)  # one seed per tensor: tied names, equal tensors, get equal nudges
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            nudged[name] = torch.where(x.isfinite(), x * (1 + torch.finfo(value.dtype).eps / 2 * noise), x)
        own = outputs if outputs is not None else self.outputs(state, transforms)
        return worst_change(self.outputs(nudged, transforms), own)


def rounding_distance(stored, exact, names=None) -> tuple[float, str]:
    """How far the tensors of ``stored`` lie from those of ``exact`` (float64, the same names; a mapping read one
    name at a time), each in units of one rounding to its own dtype: ``||s - e|| / (u ||e||)``, u its unit roundoff
    (half its epsilon; below the smallest normal number, half a step of the subnormals). One correct rounding is at
    most 1; integer tensors must be equal. ``names``: the names to compare, in this order (all of ``stored``'s).
    The farthest tensor's figure, and its name."""
    worst, name = 0.0, ""
    for key in (k for k in (stored if names is None else names) if k in exact):
        s, e = stored[key], exact[key]
        if not s.is_floating_point():
            distance = 0.0 if torch.equal(s, e.to(s.dtype)) else float("inf")
        else:
            info = torch.finfo(s.dtype)
            u, e = info.eps / 2, e.to(torch.float64)
            gap = float((s.to(torch.float64) - e).norm())
            scale = u * float(e.norm()) + u * info.smallest_normal * e.numel() ** 0.5
            distance = gap / scale if gap == gap else float("inf")  # NaN: no rounding gives it
        if distance > worst or not name:
            worst, name = distance, key
    return worst, name


def worst_change(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    """The largest :func:`relative_change` over the probe shapes' outputs."""
    return max(relative_change(out, ref) for out, ref in zip(outputs, references))


def relative_change(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over the reference's finite entries; infinite unless ``out`` is NaN, +inf and
    -inf exactly where ``ref`` is (logits a model masks with -inf stay masked under any symmetry)."""
    finite = ref.isfinite()
    if not (torch.equal(finite, out.isfinite()) and torch.equal(ref.isnan(), out.isnan())
            and torch.equal(ref[~finite & ~ref.isnan()], out[~finite & ~ref.isnan()])):
        return float("inf")
    return float((out[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30))


def flat_outputs(out, free_outputs=(), transforms=None) -> torch.Tensor:
    """Every float tensor of a model's output (a tensor, tuple or ModelOutput), flattened into one float64 vector;
    with ``transforms`` the free outputs are first moved back (:func:`symgraph.outputs.undo`)."""
    from .outputs import leaf_names, undo

    leaves, _ = tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)
    if transforms:
        leaves = undo(leaves, free_outputs, transforms, leaf_names(out, len(leaves)))
    return torch.cat([t.reshape(-1).to(torch.float64) for t in leaves
                      if isinstance(t, torch.Tensor) and t.is_floating_point()])


@contextlib.contextmanager
def float64_default(casts: bool = False):
    """Make float64 the default dtype while the float64 copy runs: model code that builds constants in the
    default dtype (XGLM's ``torch.full((), finfo(float64).min)``) would overflow float32 otherwise. With ``casts``,
    the lower float dtypes ops are asked for become float64 too (:class:`Float64Casts`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64Casts() if casts else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous)


class Float64Casts(TorchDispatchMode):
    """Turn every float32, float16 or bfloat16 dtype an op is asked for into float64 (complex64 into complex128).
    Code that casts for numerical safety then stays in float64: a router that runs ``F.linear(x.float(), weight)``
    with its weight in the model's dtype (Inkling 2) fails in a float64 copy otherwise, and an upcast to float32
    would round the check."""

    WIDER = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
             torch.complex64: torch.complex128}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") in self.WIDER:
            kwargs = {**kwargs, "dtype": self.WIDER[kwargs["dtype"]]}
        return func(*args, **kwargs)


def _needs_casts(model64: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the float64 copy ``model64`` runs on the inputs only with its casts kept in float64: it gives no
    finite output as it is and does under :class:`Float64Casts`. Where neither runs, ``False``: the check refuses
    with the model's own error (:func:`_refusal`)."""
    from .probes import forget_runs, runs

    with float64_default():
        if runs(model64, (args, kwargs)):  # the probes ask the same: answered once
            return False
    with float64_default(casts=True):
        forget_runs(model64)
        if runs(model64, (args, kwargs)):
            return True
    forget_runs(model64)
    return False


def _refusal(name: str, model64: torch.nn.Module, probes: list, exc: Exception) -> UnverifiableError:
    """Why the float64 copy ``model64`` gave no reference outputs: float64 only when a float32 copy of it runs on
    every probe; where that fails too, the model's own code is at fault (it may change itself as it runs)."""
    from .probes import shape_summary

    model32 = copied_module(model64).to(torch.float32)
    for args, kwargs in probes:
        try:
            args32, kwargs32 = _cast_inputs(args, kwargs, torch.float32)
            with torch.no_grad(), attributes_kept(model32):
                model32(*args32, **kwargs32)
        except Exception as other:  # noqa: BLE001 -- any failure in float32 clears float64 of the blame
            return UnverifiableError(
                f"{name} cannot be checked: it fails on inputs {shape_summary((args, kwargs))} in float32 as well "
                f"as in float64, so float64 is not the cause ({_first_line(other)}).",
                hint="symgraph runs the model at several input shapes (symgraph.probes): its code may fail at one of "
                     "them, or change the model as it runs; in Python, verify=False skips the check at your own risk.")
    return UnverifiableError(
        f"{name} cannot be checked: it does not run in float64, in which symgraph checks every transformation "
        f"({_first_line(exc)}).",
        hint="a kernel without float64 support (flex attention on CPU) can be swapped for another implementation "
             "with the same symmetries (model.set_attn_implementation('sdpa')); in Python, verify=False skips the "
             "check at your own risk.")


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their floating tensors in ``dtype`` (ids and masks as they are)."""
    return tuple(_cast(a, dtype) for a in args), {k: _cast(v, dtype) for k, v in kwargs.items()}


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _aliases(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict names that share storage (tied embeddings)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.numel():  # meta tensors have no storage (data_ptr 0): a tied one is the same parameter object
            where = id(t) if t.device.type == "meta" else t.data_ptr()
            groups.setdefault((where, tuple(t.shape), t.dtype), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def tie_aliases(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Make names that share storage in ``model`` (tied weights) agree with whichever one was transformed (a
    transformation changes the one name the graph reads); refuses names transformed differently."""
    return _tied(_aliases(model), state, model.state_dict(), "The transformed state")


def _tied(aliases: list[list[str]], state: dict[str, torch.Tensor], original: dict[str, torch.Tensor],
          what: str) -> dict[str, torch.Tensor]:
    """``state`` with each tie's names given the value of the one whose value differs from ``original`` (compared
    by value: a state copied to float64 holds new tensors under every name). A model holds one tensor for them,
    so names changed to different values cannot be loaded as checked: refused, nothing is written."""
    out = dict(state)
    for names in aliases:
        changed = [n for n in names if not torch.equal(state[n], original[n].to(state[n].dtype))]
        differ = [n for n in changed[1:] if not torch.equal(state[n], state[changed[0]])]
        if differ:
            raise InvarianceError(
                f"{what} gives tied names different values: {changed[0]} differs from {', '.join(differ)}, which "
                f"the model ties to it (one tensor); a model loading it would keep only one of them, so what it "
                f"computes cannot be verified; nothing was written.",
                hint="give every tied name the same tensor (symgraph.verify.tie_aliases); if symgraph made this "
                     "state, report it as a bug.")
        for n in names:
            out[n] = state[changed[0] if changed else names[0]]
    return out


def tied_copies(model: torch.nn.Module, written: frozenset[str] = frozenset()) -> set[str]:
    """Every name of a tie but one: a functional call (torch.func.functional_call) on ``model`` takes one name of
    each tie, the others sharing its tensor. The one taken is the name in ``written`` where there is one (the names
    group elements write: the one the graph reads, which need not be the first; its aliases keep their old value
    until :func:`tie_aliases`), else the first."""
    copies = set()
    for names in _aliases(model):
        taken = next((n for n in names if n in written), names[0])
        copies.update(n for n in names if n != taken)
    return copies


# Relative tolerance by the lowest float precision seen during the forward pass: float64 end to end gives ~1e-15;
# models that cast to fp32 inside (HF RMSNorm, eager softmax) give ~1e-7 even when fed float64.
TOLERANCE = {torch.float64: FLOAT64_TOL, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# A result rounded once to float32 may also miss by this many of its own rounding floors (the bar the
# architecture sweep's independent check holds every stage to, examples/sweep_pipeline.py): the floors of 429
# swept models reach 2.7e-6, so the fixed 2e-5 allows only about 8 of them, and an exact alignment of a tiny
# wav2vec2 classifier (floor 2.4e-6) came out at 1.9e-5; an unsound transformation misses by orders more.
ROUNDING_FLOORS = 100
# A bf16/fp16 result whose elements are exact may lie this many roundings from their float64 result, per tensor
# and in norm (rounded entries average about 0.4 of one): one for its own rounding, one for a streamed fold's,
# which rounds the folded weights before the elements move them. The 7B alignments checked at errors 2.0e-2 to
# 2.6e-2 against bf16's fixed 3e-2: a more sensitive checkpoint would be refused, exact or not, without this.
ROUNDINGS = 2


class _LowestFloat(TorchDispatchMode):
    """Record the lowest-precision floating dtype any op produced."""

    def __init__(self):
        super().__init__()
        self.lowest = torch.float64

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in TOLERANCE:
                if TOLERANCE[t.dtype] > TOLERANCE[self.lowest]:
                    self.lowest = t.dtype
        return out


def free_members(evaluator: Evaluator, candidate_sets, seed: int = 0) -> list:
    """The candidate member sets whose slices the model ignores: each set's slices are replaced by large random
    values at once, and the set is free when the outputs stay within tolerance (a key bias under plain softmax).

    A set that is not free as a whole is tried member by member, so one layer with RoPE or attention sinks does
    not hide the free key biases of the others. Returns the free members, flattened.
    """
    generator = torch.Generator().manual_seed(seed)
    free = []
    for members in candidate_sets:
        if _ignores(evaluator, members, generator):
            free.extend(members)
        elif len(members) > 1:
            free.extend(m for m in members if _ignores(evaluator, [m], generator))
    return free


def _ignores(evaluator: Evaluator, members, generator) -> bool:
    state = dict(evaluator.state)
    for m in members:
        x = state[m.param].detach().clone()
        idx = torch.as_tensor(m.index.reshape(-1))
        scale = float(x.abs().max()) + 1.0
        noise = torch.randn(idx.numel(), *x.movedim(m.axis, 0).shape[1:], generator=generator, dtype=x.dtype)
        x.movedim(m.axis, 0)[idx] += 10.0 * scale * noise
        state[m.param] = x
    return evaluator.check(state).ok
