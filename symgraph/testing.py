"""Hypothesis strategies for symmetry testing, for symgraph's own tests and for other projects' suites.

Strategies are plural nouns that return values composable with ``.map`` / ``.flatmap``:

* :func:`group_elements` - elements of one :class:`~symgraph.groups.Group`, including edge cases (near the
  identity, extreme scale ratios, reflections where the group has them). Every element is built from a seed and
  a few magnitudes, so hypothesis shrinks a counterexample towards the identity (a permutation towards one swap:
  a permutation is never the identity, which would check nothing).
* :func:`element_lists` - one element per group of a report.
* :func:`equivalent_variants` - state dicts that compute exactly what a model computes.
* :func:`architectures` - names of the tiny model families in :mod:`symgraph.zoo`.

Examples
--------
>>> import torch, symgraph
>>> from hypothesis import given, settings
>>> from symgraph.testing import group_elements
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> group = symgraph.analyze(mlp, inputs=(torch.randn(3, 4),)).groups[0]
>>> @settings(max_examples=5, database=None)
... @given(group_elements(group))
... def test_relu_units(element):
...     assert element.perm.shape == (1, 8)
>>> test_relu_units()
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from scipy.linalg import expm

from .elements import Element, apply, random_orthogonal
from .groups import Group

__all__ = ["architectures", "element_lists", "equivalent_variants", "group_elements"]

_SEEDS = st.integers(0, 2**32 - 1)
_MAGNITUDE = st.floats(0.0, np.pi, allow_nan=False)
_LOG_SPREAD = st.floats(0.0, 7.0, allow_nan=False)  # scale ratios up to e^7 ~ 1e3


def group_elements(group: Group) -> st.SearchStrategy[Element]:
    """Elements of ``group``; shrinking moves towards the identity."""
    if not isinstance(group, Group):
        raise TypeError(f"group_elements needs a symgraph Group, got {type(group).__name__}")
    builders = {
        "orthogonal": _orthogonal,
        "general_linear": _general_linear,
        "rotary": _rotary,
        "permutation": _monomial,
        "signed_permutation": _monomial,
        "scale": _scale,
    }
    return builders[group.kind](group)


def element_lists(groups) -> st.SearchStrategy[list[Element]]:
    """One element of every group (a report's ``groups``)."""
    return st.tuples(*[group_elements(g) for g in groups]).map(list)


def equivalent_variants(subject) -> st.SearchStrategy[dict]:
    """State dicts functionally equivalent to ``subject``'s model (a :class:`symgraph.Subject`)."""
    state = subject.state_dict()
    return element_lists(subject.report.groups).map(lambda elements: apply(state, elements))


def architectures() -> st.SearchStrategy[str]:
    """Names of the tiny model families that :func:`symgraph.zoo.build` constructs."""
    from .zoo import FAMILIES

    return st.sampled_from(FAMILIES)


# -- builders ---------------------------------------------------------------------------------------------------
def _orthogonal(group: Group):
    @st.composite
    def draw(draw_):
        seed, magnitude, reflect = draw_(_SEEDS), draw_(_MAGNITUDE), draw_(st.booleans())
        rng = np.random.default_rng(seed)
        if group.fixes_ones:  # a rotation of the complement of 1, and a sign on 1 (reflect)
            mats = [_fixing_ones(_rotation(group.size - 1, magnitude, rng, False), reflect)
                    for _ in range(group.copies)]
        else:
            mats = [_rotation(group.size, magnitude, rng, reflect) for _ in range(group.copies)]
        return Element(group, matrices=np.stack(mats))

    return draw()


def _fixing_ones(inner: np.ndarray, flip: bool) -> np.ndarray:
    """H diag(+-1, inner) H: the element of {Q in O(n) : Q 1 = +-1} acting as ``inner`` on the complement of 1."""
    from .solve.kernels import ones_basis

    n = len(inner) + 1
    block = np.zeros((n, n))
    block[0, 0] = -1.0 if flip else 1.0
    block[1:, 1:] = inner
    h = ones_basis(n)
    return h @ block @ h


def _general_linear(group: Group):
    @st.composite
    def draw(draw_):
        seed, magnitude, spread = draw_(_SEEDS), draw_(_MAGNITUDE), draw_(_LOG_SPREAD)
        rng = np.random.default_rng(seed)
        mats = []
        for _ in range(group.copies):
            scales = np.exp(spread * rng.uniform(-1, 1, group.size))
            mats.append(_rotation(group.size, magnitude, rng, False) @ np.diag(scales)
                        @ _rotation(group.size, magnitude, rng, False))
        return Element(group, matrices=np.stack(mats))

    return draw()


def _rotary(group: Group):
    @st.composite
    def draw(draw_):
        seed, magnitude = draw_(_SEEDS), draw_(_MAGNITUDE)
        spread = draw_(_LOG_SPREAD) if group.scale == "positive" else 0.0
        rng = np.random.default_rng(seed)
        mats = []
        for _ in range(group.copies):
            m = np.zeros((group.size, group.size))
            for i, j in group.rotary_pairs:
                phi = magnitude * rng.uniform(-1, 1)
                a = np.exp(spread * rng.uniform(-1, 1))
                m[np.ix_([i, j], [i, j])] = a * np.array([[np.cos(phi), -np.sin(phi)], [np.sin(phi), np.cos(phi)]])
            p = list(group.passthrough)
            if p:
                block = _rotation(len(p), magnitude, rng, False)
                if group.scale == "positive":
                    block = block @ np.diag(np.exp(spread * rng.uniform(-1, 1, len(p))))
                m[np.ix_(p, p)] = block
            mats.append(m)
        return Element(group, matrices=np.stack(mats))

    return draw()


def _monomial(group: Group):
    @st.composite
    def draw(draw_):
        seed, swaps = draw_(_SEEDS), draw_(st.integers(1, max(1, 2 * group.size)))
        rng = np.random.default_rng(seed)
        perm = np.stack([_swapped(group.size, swaps, rng) for _ in range(group.copies)])
        diag = draw_(_diagonals(group, rng))
        return Element(group, perm=perm, diag=diag)

    return draw()


def _scale(group: Group):
    @st.composite
    def draw(draw_):
        rng = np.random.default_rng(draw_(_SEEDS))
        return Element(group, diag=draw_(_diagonals(group, rng)))

    return draw()


def _diagonals(group: Group, rng):
    """Per-coordinate factors the group allows: signs, positive scales, or both."""
    c, n = group.copies, group.size
    signed = group.kind == "signed_permutation" or group.scale in ("sign", "nonzero")

    @st.composite
    def draw(draw_):
        d = np.ones((c, n))
        if group.scale in ("positive", "nonzero"):
            d *= np.exp(draw_(_LOG_SPREAD) * rng.uniform(-1, 1, (c, n)))
        if signed:
            flips = draw_(st.integers(0, n))
            for row in d:
                row[rng.choice(n, size=flips, replace=False)] *= -1
        if group.global_sign and draw_(st.booleans()):
            d = -d
        return d

    return draw()


def _rotation(n: int, magnitude: float, rng, reflect: bool) -> np.ndarray:
    """exp(magnitude * K) for a random unit skew K; a reflection on top when asked (det -1)."""
    k = rng.standard_normal((n, n))
    k = (k - k.T) / 2
    norm = np.linalg.norm(k, 2) or 1.0
    r = expm(magnitude * k / norm) if n > 1 else np.ones((1, 1))
    if reflect:
        r = r @ _reflection(n, rng)
    return r


def _reflection(n: int, rng) -> np.ndarray:
    v = random_orthogonal(n, rng)[:, 0]
    return np.eye(n) - 2 * np.outer(v, v)


def _swapped(n: int, swaps: int, rng) -> np.ndarray:
    """A product of ``swaps`` random transpositions, never the identity where ``n > 1``: an even number of swaps
    can undo itself, and a permutation of two coordinates would then be the identity half the time (a check of
    nothing; the fewest swaps, one, is where shrinking ends)."""
    perm, done = np.arange(n), 0
    while n > 1 and (done < swaps or np.array_equal(perm, np.arange(n))):
        i, j = rng.choice(n, size=2, replace=False)
        perm[[i, j]] = perm[[j, i]]
        done += 1
    return perm
