"""The declarative rules under ``specs/``: op behaviour and motifs, validated once and indexed by ATen op name.

The YAML files install with the package (``symgraph.specs``), so the engine works outside the repository.
Unknown keys are rejected so that a field nobody reads cannot drift into the files.
"""
from __future__ import annotations

import functools
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import SpecError

Rule = Literal[
    "movement", "identity", "activation", "contract", "conv", "attention", "add", "sub", "mul", "div", "pow",
    "layer_norm", "batch_norm", "pool", "pad", "reduce", "softmax", "embedding", "where", "ignore", "topk",
    "one_hot", "gather",
]
GroupLimit = Literal["general_linear", "orthogonal", "signed_permutation", "permutation"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpSpec(_Frozen):
    rule: Rule
    group: GroupLimit | None = None  # activation, pool: largest group commuting with the function
    scale: Literal["positive", "nonzero"] | None = None  # activation, pool: per-coordinate scale it passes
    pattern: str | None = None  # contract: einsum-like pattern, or "matmul" / "einsum"
    order: tuple[int, ...] | None = None  # contract: which positional args are the operands, in pattern order
    kind: Literal["sum", "select"] | None = None  # reduce
    exponent: float | None = None  # pow: a fixed exponent (square), else read from the call
    transposed: bool = False  # conv: the kernel is laid out (in, out, taps...), as in conv_transpose


class MotifSpec(_Frozen):
    description: str
    tag: str
    full_group: str | None = None
    emit: str | None = None
    rescale: bool = False


class Specs(_Frozen):
    ops: dict[str, OpSpec]
    motifs: dict[str, MotifSpec]

    def op(self, name: str) -> OpSpec | None:
        return self.ops.get(name)


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
    """Load and validate ``specs/ops.yaml`` and ``specs/motifs.yaml`` (cached)."""
    ops, motifs = _load_yaml("ops.yaml"), _load_yaml("motifs.yaml")
    try:
        return Specs(ops=ops.get("ops", {}), motifs=motifs.get("motifs", {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"Spec rule {where} is invalid: {first['msg']}.",
                        hint="Check the field against the rule list at the top of specs/ops.yaml.") from exc
