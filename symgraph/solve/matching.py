r"""Coupled permutation groups: coordinate descent over Hungarian steps (Git Re-Basin weight matching).

The objective is :math:`\sum_{\text{members}} \langle \text{aligned source}, \text{anchor}\rangle` (maximised;
equivalently the parameter distance minimised). With every permutation but :math:`P_k` fixed it is linear in
:math:`P_k`: :math:`\langle P_k, S_k\rangle + \text{const}`, where the caller's ``similarity`` callable returns
:math:`S_k` (indexed ``[anchor unit, source unit]``) built from the current values of the other variables. Each
step solves that linear assignment exactly, so the objective never decreases.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .kernels import hungarian, signed_hungarian

__all__ = ["SignedPerm", "PermVariable", "DescentResult", "coordinate_descent"]


class SignedPerm(NamedTuple):
    r"""A (signed) permutation :math:`T = \operatorname{diag}(s) P`, :math:`(Tx)_i = s_i\, x_{perm_i}`.

    Orthogonal, so :math:`T^{-T} = T`: primal and dual members move the same way (:meth:`apply`)."""

    perm: np.ndarray
    signs: np.ndarray

    @classmethod
    def identity(cls, n: int) -> "SignedPerm":
        return cls(np.arange(n), np.ones(n))

    def apply(self, x: np.ndarray, axis: int = 0) -> np.ndarray:
        """``x`` with ``T`` applied along ``axis``: ``signs * take(x, perm, axis)`` (rows: T X; columns: X T^T)."""
        x = np.asarray(x)
        shape = [1] * x.ndim
        shape[axis] = -1
        return np.take(x, self.perm, axis=axis) * self.signs.reshape(shape)

    def matrix(self) -> np.ndarray:
        """Dense :math:`T` (``T[i, perm[i]] = signs[i]``)."""
        n = self.perm.size
        t = np.zeros((n, n))
        t[np.arange(n), self.perm] = self.signs
        return t

    def linear_value(self, similarity: np.ndarray) -> float:
        r""":math:`\langle T, S\rangle = \sum_i s_i S_{i, perm_i}`."""
        return float(np.sum(self.signs * similarity[np.arange(self.perm.size), self.perm]))


@dataclass(frozen=True)
class PermVariable:
    """One permutation group of a coupled problem.

    ``similarity(assignments)`` returns the ``(size, size)`` linear term ``S`` (``[anchor, source]``) given the
    current :class:`SignedPerm` of every variable (its own entry is ignored by a correct callable). ``signed``
    variables are signed permutations (tanh units)."""

    name: str
    size: int
    similarity: Callable[[Mapping[str, SignedPerm]], np.ndarray]
    signed: bool = False


@dataclass(frozen=True)
class DescentResult:
    """``trace[r]`` is the objective after ``r`` rounds (``trace[0]``: the start); non-decreasing. Without an
    ``objective`` callable it is the accumulated exact gain, starting at 0."""

    assignments: dict[str, SignedPerm]
    trace: list[float] = field(default_factory=list)
    rounds: int = 0
    converged: bool = False


def _solve(variable: PermVariable, s: np.ndarray) -> SignedPerm:
    if variable.signed:
        return SignedPerm(*signed_hungarian(s))
    return SignedPerm(hungarian(s), np.ones(variable.size))


def coordinate_descent(variables: Sequence[PermVariable], *,
                       objective: Callable[[Mapping[str, SignedPerm]], float] | None = None,
                       init: Mapping[str, SignedPerm] | None = None, max_rounds: int = 100, seed: int = 0,
                       rtol: float = 1e-12) -> DescentResult:
    r"""Coordinate ascent over coupled permutations until no variable changes.

    Each round visits the variables in a random order (``numpy.random.default_rng(seed)``); for each it builds
    :math:`S_k` from the current assignment, solves the linear assignment exactly and accepts the result only if
    it strictly improves: the exact gain :math:`\langle T_{new} - T_{old}, S_k\rangle` exceeds
    ``rtol * max(1, |<T_old, S_k>|)`` and, when ``objective`` is given, the objective itself increases (which
    keeps the trace monotone even for terms that are not linear in one variable, e.g. :math:`P W P^\top`).
    Stops after a round without a change (``converged``) or after ``max_rounds``.

    Parameters
    ----------
    variables : sequence of PermVariable
    objective : callable, optional
        Total similarity :math:`\sum\langle\text{aligned source}, \text{anchor}\rangle` of an assignment.
    init : mapping name -> SignedPerm, optional
        Start (identity by default).

    Returns
    -------
    DescentResult
    """
    names = [v.name for v in variables]
    if len(set(names)) != len(names):
        raise ValueError(f"variable names must be unique: {names}")
    current = {v.name: SignedPerm.identity(v.size) for v in variables}
    if init:
        current.update({k: SignedPerm(np.asarray(p.perm), np.asarray(p.signs, dtype=np.float64))
                        for k, p in init.items()})
    value = float(objective(current)) if objective is not None else 0.0
    trace, rng = [value], np.random.default_rng(seed)
    rounds, converged = 0, False
    while rounds < max_rounds:
        rounds += 1
        changed = False
        for k in rng.permutation(len(variables)):
            var = variables[int(k)]
            s = np.asarray(var.similarity(current), dtype=np.float64)
            if s.shape != (var.size, var.size):
                raise ValueError(f"similarity of {var.name!r} has shape {s.shape}, expected {(var.size,) * 2}")
            old, new = current[var.name], _solve(var, s)
            before = old.linear_value(s)
            gain = new.linear_value(s) - before
            if gain <= rtol * max(1.0, abs(before)):
                continue
            trial = {**current, var.name: new}
            if objective is not None:
                new_value = float(objective(trial))
                if not new_value > value:
                    continue
                value = new_value
            else:
                value += gain
            current, changed = trial, True
        trace.append(value)
        if not changed:
            converged = True
            break
    return DescentResult(current, trace, rounds, converged)
