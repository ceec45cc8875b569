"""The declarative rules under ``specs/``: op behaviour and motifs, validated once and indexed by ATen op name.

The YAML files install with the package (``symgraph.specs``), so the engine works outside the repository.
Each rule has a model of its own holding only the fields its handler reads; unknown keys are rejected so that a
field nobody reads cannot drift into the files. Patterns are parsed and argument names checked against the op's
schema when the files load, so a malformed entry fails there with the op and field named.
"""
from __future__ import annotations

import functools
from importlib import resources
from typing import Annotated, Literal, Union, get_args

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import SpecError
from .groups import Kind
from .pattern import Pattern, parse_pattern

GroupLimit = Literal["general_linear", "orthogonal", "signed_permutation", "permutation"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def arguments(self) -> tuple[str, ...]:
        """Schema argument names this entry refers to (checked against the op when the specs load)."""
        return ()


class _Equivariant(_Frozen):
    # permuting the positions along any axis of the inputs permutes the output alike (elementwise maps, softmax):
    # the order along a top-k axis passes through the op (unflagged ops are assumed to see it: sound, fewer groups)
    equivariant: bool = False
    # every output is > 0 (softmax, sigmoid, exp): a where / masked_fill setting other entries to 0 or less leaves
    # them below every kept one, so a top-k over them ranks the kept ones first and never meets the filled ties
    positive: bool = False


class PlainSpec(_Equivariant):
    """Rules whose handler needs nothing beyond the op's arguments."""

    rule: Literal["attention", "add", "mul", "div", "batch_norm", "group_norm", "instance_norm", "pad", "scan",
                  "softmax", "embedding", "ignore", "one_hot", "gather", "scatter", "index_add", "index_put", "copy",
                  "glu", "weight_norm", "lerp"]


class TopkSpec(_Frozen):
    rule: Literal["topk"]
    indices_only: bool = False  # returns the indices alone (argmax, argmin), not (values, indices)
    smallest: bool = False  # ranks the smallest first (argmin); topk reads its `largest` argument


class ReduceSpec(_Equivariant):
    rule: Literal["reduce"]
    norm: bool = False  # a vector norm (its `ord` read from the call): 2 passes orthogonal maps, others signed permutations
    order_free: bool = False  # a symmetric function of the entries but no sum (var, max, logsumexp): permutations only


class NormSpec(_Frozen):
    rule: Literal["layer_norm"]
    centres: bool = True  # subtracts the mean over the normalised axes (LayerNorm); false: RMSNorm


class MovementSpec(_Equivariant):
    rule: Literal["movement"]
    concatenates: bool = False  # pieces joined along `dim`: pieces carrying the same coordinates are tied
    stacks: bool = False  # pieces joined along a new axis `dim`, each one position wide there (stack)
    broadcasts: bool = False  # repeats the input along axes where it has size 1 (expand): values constant there
    cuts: bool = False  # keeps part of the input along `dim` (slice, select, split): checked at other input shapes
    regroups: bool = False  # may split an axis into rows of positions (reshape, unfold): checked at other shapes
    shifts: bool = False  # moves positions along axes by numbers it is given (roll): checked at other shapes
    replay_as: str | None = None  # the op to replay on label tensors when this one cannot (view of an expanded tensor)
    # the axis a join without a `dim` argument joins along (hstack 1, vstack 0, dstack 2): cat along it for pieces
    # with more axes than that; pieces with fewer are reshaped first, which the rule does not follow
    along: int | None = None

    @field_validator("replay_as")
    @classmethod
    def _real_op(cls, name):
        if name is not None:
            aten_op(name)
        return name


class IdentitySpec(_Equivariant):
    rule: Literal["identity"]
    negates: bool = False  # the output is minus the input (indices through it no longer point anywhere)


class SubSpec(_Equivariant):
    rule: Literal["sub"]
    swapped: bool = False  # the second argument minus the first (rsub)


class WhereSpec(_Frozen):
    rule: Literal["where"]
    condition: str = "condition"  # the schema argument that chooses
    choices: tuple[str, str] = ("self", "other")  # the schema arguments chosen between
    # the first choice is packed (masked_scatter's source): its values fill the chosen positions in order
    packed: bool = False

    def arguments(self) -> tuple[str, ...]:
        return (self.condition, *self.choices)


class MapSpec(_Equivariant):
    """Elementwise maps of each coordinate (activations), or of each channel over its positions (pooling)."""

    rule: Literal["activation", "pool"]
    group: GroupLimit  # the largest group commuting with the map
    scale: Literal["positive", "nonzero"] | None = None  # the per-coordinate scale it passes
    # a clamp's lower and upper bound (schema arguments): `group` holds only when they are opposite numbers
    # (clamp(-x, -c, c) = -clamp(x, -c, c)); any other bounds commute with permutations only
    bounds: tuple[str, str] | None = None
    # the schema argument holding a slope per channel of axis 1, or one for all (prelu's weight): the map of each
    # coordinate is its own channel's, so the slopes move with the channels and never scale
    slopes: str | None = None
    even: bool = False  # f(-x) = f(x): a statistic of f over whole rows of coordinates passes signed permutations
    ties: bool = False  # sends whole intervals to one value: a ranking downstream sees the coordinates' order
    # a map of two tensors' coordinates, one pair at a time (max(a, b)): labelled alike, they are tied as in add
    pairs: bool = False

    def arguments(self) -> tuple[str, ...]:
        return (*(self.bounds or ()), *((self.slopes,) if self.slopes else ()))


class ContractSpec(_Frozen):
    rule: Literal["contract"]
    pattern: str  # einsum-like, or "matmul" (numpy broadcasting) / "einsum" (the equation argument)
    operands: tuple[str, ...] | None = None  # schema arguments in pattern order; default: every Tensor argument
    factors: int = 2  # operands multiplied together (bilinear: 3); those after them are added (biases)
    _recipe: Pattern | None = PrivateAttr(default=None)

    @field_validator("pattern")
    @classmethod
    def _parse(cls, text: str) -> str:
        if text not in ("matmul", "einsum"):
            parse_pattern(text)  # raises ValueError naming what is wrong
        return text

    def model_post_init(self, _context) -> None:
        self._recipe = None if self.pattern in ("matmul", "einsum") else parse_pattern(self.pattern)

    @property
    def recipe(self) -> Pattern | None:
        """The parsed pattern (None for ``matmul`` and ``einsum``, whose pattern comes from the call)."""
        return self._recipe

    def arguments(self) -> tuple[str, ...]:
        return self.operands or ()


class ConvSpec(_Frozen):
    rule: Literal["conv"]
    transposed: bool = False  # the kernel is laid out (in, out, taps...), as in conv_transpose


class ComplexViewSpec(_Frozen):
    rule: Literal["complex_view"]
    to: Literal["complex", "real"]  # view_as_complex: pairs (re, im) along the last axis; view_as_real: back


class FillSpec(_Frozen):
    rule: Literal["fill"]
    value: float | None = None  # the value every element gets (zeros_like); None: the call's `fill_value`
    unset: bool = False  # the values are left unspecified (new_empty): unknown data, to be written later

    def arguments(self) -> tuple[str, ...]:
        return () if self.value is not None or self.unset else ("fill_value",)


class RecurrentSpec(_Frozen):
    rule: Literal["recurrent"]
    gates: int  # blocks of rows per weight, one per gate: 1 (RNN), 3 (GRU), 4 (LSTM)


class PowSpec(_Frozen):
    rule: Literal["pow"]
    exponent: float | None = None  # fixed by the op (square); else read from the call


_RULE_MODELS = (PlainSpec, TopkSpec, NormSpec, ReduceSpec, MovementSpec, IdentitySpec, SubSpec, WhereSpec, MapSpec,
                ContractSpec, ConvSpec, PowSpec, FillSpec, ComplexViewSpec, RecurrentSpec)
OpSpec = Annotated[Union[_RULE_MODELS], Field(discriminator="rule")]
RULES: tuple[str, ...] = tuple(sorted(r for m in _RULE_MODELS for r in get_args(m.model_fields["rule"].annotation)))


GroupFamily = Literal["coordinates", "scales", "heads"]


class Subgroup(_Frozen):
    of: Kind  # the exact group the analysis finds
    emit: Kind  # the subgroup emitted in its place
    note: str  # what the report says about the choice


class Rescale(_Frozen):
    note: str  # what the report says about the scalar rescale group


class DerivedTag(_Frozen):
    """specs/motifs.yaml ``derived_tags``: a tag on the coordinates carrying every tag of ``all`` and none of
    ``none``."""
    description: str
    all: tuple[str, ...]
    none: tuple[str, ...] = ()


class MotifSpec(_Frozen):
    description: str
    tag: str | None = None  # the role tag (attached by the rules) that marks the motif's coordinates
    unless: str | None = None  # a tag that, carried by the same group, keeps this motif from naming it
    subgroup: Subgroup | None = None
    rescale: Rescale | None = None  # also emit the per-copy scalar rescale (a, 1/a) of the emitted subgroup

    @model_validator(mode="after")
    def _rescale_needs_subgroup(self):
        if self.rescale is not None and self.subgroup is None:
            raise ValueError("field 'rescale' needs a 'subgroup' whose emitted groups it rescales")
        return self


class SumSpec(_Frozen):
    """An op whose result is ``into`` plus its ``terms``, in any order (specs/branches.yaml)."""

    terms: tuple[str, ...]
    into: str | None = None
    flag: str | None = None  # a boolean argument that must be true (index_put's accumulate)
    unit: str | None = None  # an argument that must be 1 (add's alpha)

    def arguments(self) -> tuple[str, ...]:
        return tuple(a for a in (*self.terms, self.into, self.flag, self.unit) if a is not None)


class ReadSpec(_Frozen):
    """An op reading one position of a tensor, named by the number ``index`` (``end``: index + 1): a position along
    ``dim`` (``positions``), or the elements of an index tensor that point at that position (``values``)."""

    of: Literal["positions", "values"]
    index: str
    tensor: str = "self"  # the tensor read
    dim: str | None = None  # positions: the axis they lie along
    end: str | None = None
    unit: str | None = None  # an argument that must be 1 (a slice's step)

    @model_validator(mode="after")
    def _positions_need_an_axis(self):
        if (self.of == "positions") != (self.dim is not None):
            raise ValueError("field 'dim' names the axis of a `positions` read, and only of one")
        return self

    def arguments(self) -> tuple[str, ...]:
        return tuple(a for a in (self.index, self.tensor, self.dim, self.end, self.unit) if a is not None)


class StackSpec(_Frozen):
    """An op joining its ``terms`` (one list argument) along a new axis ``dim``, each at its own position."""

    terms: tuple[str]
    dim: str

    @property
    def into(self) -> None:  # read as a sum's spec: no running total
        return None

    def arguments(self) -> tuple[str, ...]:
        return (*self.terms, self.dim)


class BranchSpecs(_Frozen):
    """specs/branches.yaml: what isomorphic parallel branches (ModuleList experts) may meet in and read."""

    sums: dict[str, SumSpec] = {}
    stacks: dict[str, StackSpec] = {}
    reads: dict[str, ReadSpec] = {}


class ExpertsLayout(_Frozen):
    """specs/experts.yaml: where a hand-written experts module keeps each expert's gated FFN weights."""

    experts: str  # attribute holding the number of experts
    gate: str | None = None  # parameter paths, experts stacked along the rows
    up: str | None = None
    gate_up: str | None = None  # or one (experts, 2 units, hidden) parameter: gate rows, then up rows
    down: str
    down_rows: Literal["units", "hidden"]  # what each expert's block of ``down`` rows indexes
    activation: str  # attribute path of the gate's activation
    identity_experts: str | None = None  # attribute: how many experts past the others pass their input on

    @model_validator(mode="after")
    def _gate_and_up_once(self):
        separate = self.gate is not None and self.up is not None
        if (self.gate_up is None and separate) or (self.gate_up is not None and self.gate is self.up is None):
            return self
        raise ValueError("an experts layout names either `gate` and `up` (stacked rows) or `gate_up` (fused), "
                         "not both and not neither")


class IdentityRouting(_Frozen):
    """specs/experts.yaml: a mixture-of-experts module that sends some top-k picks to identity experts (which pass
    the token on) and the others to an experts module of transformers' experts interface."""

    router: str  # submodule: tokens -> a tuple holding the top-k weights and indices
    weights_output: int  # where the router's tuple holds the top-k weights
    indices_output: int  # and the top-k indices (identity experts: routed + i)
    experts: str  # submodule run through the experts interface
    routed: str  # attribute: the number of routed experts
    identity: str  # attribute: the number of identity experts after them


class SortedTokens(_Frozen):
    """specs/experts.yaml: a mixture-of-experts module whose router sorts the tokens by expert and whose experts
    split them by counts read at run time (JetMoE's): each token's top-k picks of the router's logits, weighted by
    a softmax over the picked logits."""

    form: Literal["glu", "heads"]  # a gated FFN per expert, or each pick's query and output projections (map/reduce)
    router: str  # submodule: the linear layer giving each token's expert logits
    top_k: str  # attribute path: the picks per token
    up: str  # parameter (experts, rows, hidden): glu: gate rows then up rows; heads: each pick's query rows
    down: str  # parameter (experts, hidden, units)
    bias: str  # parameter added to the module's output
    activation: str | None = None  # glu: attribute path of the gate's activation

    @model_validator(mode="after")
    def _activation_for_glu(self):
        if (self.activation is None) == (self.form == "glu"):
            raise ValueError("a `glu` entry names its `activation`, a `heads` entry none")
        return self


class ScaledInputs(_Frozen):
    """specs/experts.yaml: a mixture-of-experts module that runs every expert on every token scaled by its router
    score, the experts' inputs stacked along the rows (Llama 4's)."""

    router: str  # submodule: tokens -> (scores (tokens, experts), logits)
    gate_up: str  # parameter (experts, hidden, 2 units): gate columns, then up columns
    down: str  # parameter (experts, units, hidden)
    activation: str  # attribute path of the gate's activation
    shared: str  # submodule every token also goes through


class Specs(_Frozen):
    ops: dict[str, OpSpec]
    motifs: dict[str, MotifSpec]
    derived_tags: dict[str, DerivedTag] = {}
    classify: dict[GroupFamily, tuple[str, ...]]  # per group family: motifs by precedence, the last the default
    branches: BranchSpecs = BranchSpecs()
    experts: dict[str, ExpertsLayout] = {}
    identity_routing: dict[str, IdentityRouting] = {}
    sorted_tokens: dict[str, SortedTokens] = {}
    scaled_inputs: dict[str, ScaledInputs] = {}

    @model_validator(mode="after")
    def _check_classify(self):
        for family, names in self.classify.items():
            unknown = [n for n in names if n not in self.motifs]
            if unknown or not names:
                raise ValueError(f"specs/motifs.yaml: classify.{family} must list motifs of that file; "
                                 f"unknown: {unknown}")
            untagged = [n for n in names[:-1] if self.motifs[n].tag is None]
            if untagged:
                raise ValueError(f"specs/motifs.yaml: classify.{family}: motif(s) {', '.join(untagged)} have no "
                                 "tag, so only the last entry (the default) may be one of them")
        return self

    def motif_for(self, family: GroupFamily, tagged) -> str:
        """The motif naming a group of ``family`` whose coordinates carry the tags for which ``tagged(tag)``."""
        names = self.classify[family]
        return next((n for n in names[:-1] if tagged(self.motifs[n].tag)
                     and not (self.motifs[n].unless and tagged(self.motifs[n].unless))), names[-1])

    @model_validator(mode="after")
    def _check_against_schemas(self):
        entries = [("ops.yaml", name, spec) for name, spec in self.ops.items()]
        entries += [("branches.yaml", name, spec) for table in (self.branches.sums, self.branches.stacks,
                                                                self.branches.reads)
                    for name, spec in table.items()]
        for file, name, spec in entries:
            schema = aten_op(name)._schema
            names = [a.name for a in schema.arguments]
            unknown = [a for a in spec.arguments() if a not in names]
            if unknown:
                raise ValueError(f"specs/{file}: {name}: the entry names argument(s) {', '.join(unknown)}, which "
                                 f"its schema does not have ({schema})")
            recipe = getattr(spec, "recipe", None)
            n_operands = len(spec.arguments() or _tensor_arguments(schema))
            if recipe is not None and len(recipe.operands) != n_operands:
                raise ValueError(f"specs/ops.yaml: {name}: field 'pattern' has {len(recipe.operands)} operands but "
                                 f"the op passes {n_operands} tensors ({schema}); name them in 'operands'")
        return self

    def op(self, name: str) -> OpSpec | None:
        return self.ops.get(name)


def motif_order(motif: str) -> int:
    """Where ``motif`` comes in specs/motifs.yaml (reports list a layer's groups in that order); unknown: last."""
    names = list(load_specs().motifs)
    return names.index(motif) if motif in names else len(names)


def aten_op(name: str) -> torch._ops.OpOverload:
    """The overload an op name such as ``aten.linear.default`` stands for; ValueError if there is none."""
    try:
        namespace, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"{name!r} is not an ATen op overload (namespace.op.overload)") from exc


def _tensor_arguments(schema) -> tuple[str, ...]:
    optional_tensor = torch.OptionalType.ofTensor()
    return tuple(a.name for a in schema.arguments if a.type.isSubtypeOf(optional_tensor) and not a.kwarg_only)


def operand_names(spec: ContractSpec, target) -> tuple[str, ...]:
    """The schema arguments a contraction reads, in pattern order."""
    return spec.operands or _tensor_arguments(target._schema)


def _load_yaml(name: str) -> dict:
    path = resources.files("symgraph.specs").joinpath(name)
    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise SpecError(f"Spec file {name} is missing from the installed package.",
                        hint="Reinstall symgraph; specs/*.yaml must be installed as package data.") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"Spec file specs/{name} is not valid YAML: {exc}") from exc


@functools.cache
def load_specs() -> Specs:
    """Load and validate the files of ``specs/`` (cached)."""
    ops, motifs, branches = _load_yaml("ops.yaml"), _load_yaml("motifs.yaml"), _load_yaml("branches.yaml")
    experts = _load_yaml("experts.yaml")
    try:
        return Specs(ops=ops.get("ops", {}), motifs=motifs.get("motifs", {}),
                     derived_tags=motifs.get("derived_tags", {}), classify=motifs.get("classify", {}),
                     branches=branches, experts=experts.get("layouts", {}),
                     identity_routing=experts.get("identity_routing", {}),
                     sorted_tokens=experts.get("sorted_tokens", {}),
                     scaled_inputs=experts.get("scaled_inputs", {}))
    except ValidationError as exc:
        message, file = _describe(exc.errors()[0])
        raise SpecError(message, hint=f"Check the entry against the field list at the top of specs/{file}.") from exc


_FILE = {"ops": "ops.yaml", "motifs": "motifs.yaml", "derived_tags": "motifs.yaml", "classify": "motifs.yaml",
         "branches": "branches.yaml", "experts": "experts.yaml", "identity_routing": "experts.yaml",
         "sorted_tokens": "experts.yaml", "scaled_inputs": "experts.yaml"}


def _describe(error: dict) -> tuple[str, str]:
    """``specs/ops.yaml: aten.linear.default, field 'pattern' ...`` from a pydantic error, and the file's name."""
    loc = [str(p) for p in error["loc"]]
    msg = error["msg"].removeprefix("Value error, ")
    if len(loc) >= 2 and loc[0] in _FILE:
        field = f", field '{loc[-1]}'" if len(loc) > 2 else ""
        return f"Spec entry specs/{_FILE[loc[0]]}: {loc[1]}{field} is invalid: {msg}.", _FILE[loc[0]]
    return f"Spec entry {msg}.", "motifs.yaml" if msg.startswith("specs/motifs.yaml") else "ops.yaml"
