"""Einsum-like contraction patterns (``"...i,oi,o->...o"``), parsed once into an immutable recipe.

Op specs name their contraction as such a pattern; the parse happens when specs/ops.yaml loads, so a malformed
pattern is refused there, not on the first model that reaches the op. Patterns read from a graph (``einsum``) and
the ones built for ``matmul`` go through the same parser (cached).
"""
from __future__ import annotations

import functools
import string
from dataclasses import dataclass

ELLIPSIS = "..."
_LETTERS = frozenset(string.ascii_letters)


@dataclass(frozen=True)
class Pattern:
    """Operand letter strings (``...`` marks broadcast leading axes) and the output's."""

    operands: tuple[str, ...]
    output: str

    def __str__(self) -> str:
        return ",".join(self.operands) + "->" + self.output


@functools.lru_cache(maxsize=256)
def parse_pattern(text: str) -> Pattern:
    """Parse ``text``; raise ValueError saying what is wrong with it.

    >>> parse_pattern("...i, oi, o -> ...o")
    Pattern(operands=('...i', 'oi', 'o'), output='...o')
    >>> parse_pattern("ab,,->->")
    Traceback (most recent call last):
    ValueError: pattern 'ab,,->->' must have exactly one '->' (it has 2)
    """
    compact = text.replace(" ", "")
    arrows = compact.count("->")
    if arrows != 1:
        raise ValueError(f"pattern {text!r} must have exactly one '->' (it has {arrows})")
    inputs, output = compact.split("->")
    operands = tuple(inputs.split(","))
    for k, operand in enumerate(operands):
        if not operand:
            raise ValueError(f"pattern {text!r}: operand {k + 1} has no letters")
        _check_letters(text, f"operand {k + 1}", operand)
    _check_letters(text, "the output", output)
    seen = set("".join(operands))
    missing = sorted(set(output.replace(ELLIPSIS, "")) - seen)
    if missing:
        raise ValueError(f"pattern {text!r}: output letters {''.join(missing)} appear in no operand")
    if ELLIPSIS in output and not any(ELLIPSIS in o for o in operands):
        raise ValueError(f"pattern {text!r}: the output has '...' but no operand does")
    return Pattern(operands, output)


def _check_letters(text: str, where: str, part: str) -> None:
    if part.count(ELLIPSIS) > 1:
        raise ValueError(f"pattern {text!r}: {where} has more than one '...'")
    bad = sorted(set(part.replace(ELLIPSIS, "")) - _LETTERS)
    if bad:
        raise ValueError(f"pattern {text!r}: {where} has characters other than letters and one '...': {''.join(bad)}")
    if where == "the output" and len(set(part.replace(ELLIPSIS, ""))) != len(part.replace(ELLIPSIS, "")):
        raise ValueError(f"pattern {text!r}: the output repeats a letter")
