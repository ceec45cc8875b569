"""Group elements: sample them, and apply them to a state dict (always a copy; inputs are never modified).

An element is stored in the cheapest faithful form: dense per-copy matrices for continuous matrix groups
(orthogonal, general linear, rotary), or a permutation plus a diagonal for monomial groups (a residual-stream
permutation of a 70B model is an index array, not an 8192 x 8192 matrix).

Monomial convention: ``(T x)_i = diag_i * x[perm_i]``, so ``T^{-T}`` reads ``x[perm_i] / diag_i``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .groups import Group, Member, TensorMember
from .module_state import copied_module

MATRIX_KINDS = ("general_linear", "orthogonal", "rotary")


@dataclass(frozen=True, eq=False)
class Element:
    group: Group
    matrices: np.ndarray | None = None  # (copies, n, n)
    perm: np.ndarray | None = None  # (copies, n) int
    diag: np.ndarray | None = None  # (copies, n) float

    def is_identity(self, atol: float = 1e-12) -> bool:
        if self.matrices is not None:
            return bool(np.allclose(self.matrices, np.eye(self.group.size), atol=atol))
        ok = True
        if self.perm is not None:
            ok &= bool((self.perm == np.arange(self.group.size)).all())
        if self.diag is not None:
            ok &= bool(np.allclose(self.diag, 1.0, atol=atol))
        return ok


def identity(group: Group) -> Element:
    c, n = group.copies, group.size
    if group.kind in MATRIX_KINDS:
        return Element(group, matrices=np.broadcast_to(np.eye(n), (c, n, n)).copy())
    return Element(group, perm=np.tile(np.arange(n), (c, 1)), diag=np.ones((c, n)))


# -- sampling -------------------------------------------------------------------------------------------------
def sample(group: Group, rng: np.random.Generator, spread: float = 0.3) -> Element:
    """A random element; ``spread`` is the log-standard-deviation of scales (0 keeps scales at 1)."""
    c, n = group.copies, group.size
    kind = group.kind
    if kind == "orthogonal" and group.fixes_ones:
        return Element(group, matrices=np.stack([random_orthogonal_fixing_ones(n, rng) for _ in range(c)]))
    if kind == "orthogonal":
        return Element(group, matrices=np.stack([random_orthogonal(n, rng) for _ in range(c)]))
    if kind == "general_linear":
        return Element(group, matrices=np.stack([random_general_linear(n, rng, spread) for _ in range(c)]))
    if kind == "rotary":
        return Element(group, matrices=np.stack([_rotary_matrix(group, rng, spread) for _ in range(c)]))
    perm = np.stack([_moving_permutation(n, rng) for _ in range(c)]) if kind != "scale" else None
    return Element(group, perm=perm, diag=_diagonal(group, rng, spread))


def _moving_permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A uniform permutation other than the identity where ``n > 1``: of two coordinates, a uniform draw would
    leave them in place half the time, and a check of that element (the fuzz's joint check, a transform) would
    check nothing there."""
    while True:
        perm = rng.permutation(n)
        if n < 2 or not np.array_equal(perm, np.arange(n)):
            return perm


def random_orthogonal(n: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def random_orthogonal_fixing_ones(n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform on {Q in O(n) : Q 1 = +-1}: a random sign on the ones direction, a random O(n-1) on its complement."""
    from .solve.kernels import ones_basis

    inner = np.zeros((n, n))
    inner[0, 0] = rng.choice([-1.0, 1.0])
    inner[1:, 1:] = random_orthogonal(n - 1, rng)
    h = ones_basis(n)
    return h @ inner @ h


def random_general_linear(n: int, rng: np.random.Generator, spread: float = 0.3) -> np.ndarray:
    """Well-conditioned: U diag(exp(N(0, spread))) V with U, V orthogonal."""
    s = np.exp(rng.normal(0.0, spread, n))
    return random_orthogonal(n, rng) @ np.diag(s) @ random_orthogonal(n, rng)


def _rotary_matrix(group: Group, rng, spread) -> np.ndarray:
    n = group.size
    m = np.zeros((n, n))
    for i, j in group.rotary_pairs:
        phi = rng.uniform(-np.pi, np.pi)
        a = np.exp(rng.normal(0.0, spread)) if group.scale == "positive" else 1.0
        m[np.ix_([i, j], [i, j])] = a * np.array([[np.cos(phi), -np.sin(phi)], [np.sin(phi), np.cos(phi)]])
    p = list(group.passthrough)
    if p:
        block = random_general_linear(len(p), rng, spread) if group.scale == "positive" \
            else random_orthogonal(len(p), rng)
        m[np.ix_(p, p)] = block
    return m


def _diagonal(group: Group, rng, spread) -> np.ndarray:
    c, n = group.copies, group.size
    magnitude = np.exp(rng.normal(0.0, spread, (c, n)))
    signs = rng.choice([-1.0, 1.0], (c, n))
    scale = group.scale
    if group.kind == "signed_permutation" or scale == "sign":
        return signs
    if group.global_sign:
        return np.broadcast_to(rng.choice([-1.0, 1.0], (c, 1)), (c, n)).copy()
    if scale == "positive":
        return magnitude
    if scale == "nonzero":
        return magnitude * signs
    return np.ones((c, n))


# -- application ----------------------------------------------------------------------------------------------
def apply(state: dict[str, torch.Tensor], elements: list[Element], *, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Return a new state dict with every element applied, computed in ``dtype`` and cast back.

    Parameters that no element touches are shared with ``state`` (not copied); touched ones are new tensors.
    Differentiable in the tensors an element may hold (learned matching passes torch matrices and diagonals): the
    inverse transpose of each element's matrices is formed once, and a member over a contiguous run of positions
    (a residual member: the whole axis) is moved as a slice, without an index gather and scatter.
    """
    touched = {p for e in elements for p in e.group.params}
    work = {k: v.detach().to(dtype).clone() for k, v in state.items() if k in touched}
    inverses = {}  # the inverse transposes of matrix elements, for their dual members (transform_slice)
    for e in elements:
        for m in e.group.members:
            if isinstance(m, TensorMember):
                swap_tensors(work, m, e)
            else:
                work[m.param] = _apply_member(work[m.param], m, e, inverses)
    out = dict(state)
    for k, v in work.items():
        out[k] = v.to(state[k].dtype)
    return out


def apply_in_place(state: dict[str, torch.Tensor], elements: list[Element], *, inverses: dict | None = None) -> None:
    """Apply ``elements`` to tensors the caller owns (the aligner's working copy), without copying them.
    ``inverses``, a dict the caller keeps across calls, keeps the inverse transposes of matrix elements for their
    dual members (see :func:`transform_slice`)."""
    for e in elements:
        for m in e.group.members:
            if isinstance(m, TensorMember):
                swap_tensors(state, m, e)
                continue
            run = contiguous_run(m.index)
            idx = None if run is not None else torch.as_tensor(m.index, device=state[m.param].device)
            for part in split_beside(state[m.param], m.axis):
                y = part.movedim(m.axis, 0)  # a view: writing into it writes the tensor
                if run is None:
                    y[idx] = transform_slice(y[idx], m, e, inverses=inverses)
                    continue
                block = y[run]  # a whole axis (residual members): slice views, no index gather and scatter
                view = block.reshape(*m.index.shape, *block.shape[1:])  # splits the first axis: still a view
                moved = transform_slice(view, m, e, in_place=True, inverses=inverses)
                if moved is not view:
                    block.copy_(moved.reshape(block.shape))


PART = 1 << 24  # elements of a large tensor read or moved at a time (64 MiB of float32)


def split_beside(x: torch.Tensor, axis: int) -> list[torch.Tensor]:
    """``x`` as views split along its longest axis other than ``axis``, each of at most about :data:`PART`
    elements. An element acts along ``axis`` alone, so it moves ``x`` part by part, and a cost sums over the parts:
    the temporaries are a part's, not the tensor's (a 3-D expert tensor of a 7B MoE is several GB in float32)."""
    if x.dim() < 2 or x.numel() <= PART:
        return [x]
    other = max((d for d in range(x.dim()) if d != axis % x.dim()), key=lambda d: x.shape[d])
    return list(x.split(max(1, PART * x.shape[other] // x.numel()), dim=other))


def swap_tensors(state: dict[str, torch.Tensor], m: TensorMember, e: Element) -> None:
    """Move the tensors of ``m`` between its slots as ``e`` says, in ``state`` (the dict's entries are replaced,
    the tensors are not copied): slot ``j`` receives the tensor of slot ``e.perm[c][j]``."""
    if e.perm is None or e.matrices is not None or (e.diag is not None and not np.all(e.diag == 1.0)):
        raise ValueError(f"{m.describe()}: whole tensors only move by permutations, not by a {e.group.kind} "
                         "element with scales")
    for row, perm in zip(m.slots, e.perm):
        moved = [state[row[int(p)]] for p in perm]
        for name, tensor in zip(row, moved):
            state[name] = tensor


def contiguous_run(index: np.ndarray) -> slice | None:
    """``index`` as a slice when it lists consecutive positions in order, else None."""
    flat = index.reshape(-1)
    start = int(flat[0])
    return slice(start, start + flat.size) if np.array_equal(flat, np.arange(start, start + flat.size)) else None


def inverse(e: Element) -> Element:
    """The inverse group element: ``apply(apply(s, [e]), [inverse(e)])`` is ``s`` up to rounding."""
    if e.matrices is not None:
        return Element(e.group, matrices=np.linalg.inv(e.matrices))
    perm = np.argsort(e.perm, axis=1) if e.perm is not None else None
    diag = None
    if e.diag is not None:
        diag = 1.0 / (np.take_along_axis(e.diag, perm, axis=1) if perm is not None else e.diag)
    return Element(e.group, perm=perm, diag=diag)


def composed_matrices(elements: list[Element], group: Group) -> np.ndarray:
    """The matrices (copies, size, size) by which ``elements``, applied in turn, move ``group``'s coordinates
    together (whatever kinds they are: permutations of whole copies, scales, maps): one primal member's positions are
    given the unit vectors (coordinate ``j`` of every copy holds ``e_j``), moved by the elements acting along that
    member's axis, and read back. Rows moved from another copy still hold unit vectors: the maps are relative to
    the coordinates' original values, wherever those were."""
    probe = next(m for m in group.members if isinstance(m, Member) and m.action == "primal")
    acting = []
    for e in elements:
        members = tuple(replace(m, param="probe", axis=0) for m in e.group.members
                        if isinstance(m, Member) and (m.param, m.axis) == (probe.param, probe.axis))
        if members:
            acting.append(replace(e, group=replace(e.group, members=members)))
    length = 1 + max(int(m.index.max()) for m in (probe, *(m for e in acting for m in e.group.members)))
    x = torch.zeros(length, group.size, dtype=torch.float64)
    x[torch.as_tensor(probe.index)] = torch.eye(group.size, dtype=torch.float64)[None, :, None, :]
    moved = apply({"probe": x}, acting)["probe"]
    return moved[torch.as_tensor(probe.index[:, :, 0])].numpy()


def _apply_member(x: torch.Tensor, m: Member, e: Element, inverses: dict) -> torch.Tensor:
    y = x.movedim(m.axis, 0)
    run = contiguous_run(m.index)
    if run is not None:
        block = y[run]
        moved = transform_slice(block.reshape(*m.index.shape, *block.shape[1:]), m, e, inverses=inverses)
        moved = moved.reshape(block.shape)
        whole = run.start == 0 and run.stop == y.shape[0]
        y = moved if whole else torch.cat([y[:run.start], moved, y[run.stop:]])
        return y.movedim(0, m.axis)
    idx = torch.as_tensor(m.index, device=y.device)  # (copies, n, block)
    g = y[idx]  # (copies, n, block, rest...)
    g = transform_slice(g, m, e, inverses=inverses)
    y = y.clone()
    y[idx] = g
    return y.movedim(0, m.axis)


def transform_slice(g: torch.Tensor, m: Member, e: Element, *, in_place: bool = False,
                    inverses: dict | None = None) -> torch.Tensor:
    """Member ``m``'s slice ``g`` (copies, size, block, rest...) as element ``e`` moves it (a new tensor; with
    ``in_place``, ``g`` itself where a diagonal alone moves it, or nothing does). A dual member moves by the
    inverse transpose of ``e``'s matrices in ``g``'s dtype; with ``inverses`` (a dict the caller keeps) it is
    computed once per element, dtype and device and reused (the same numbers: a fixed 4096 x 4096 residual
    rotation applied block after block is inverted once, not once per member of every block)."""
    dtype = g.dtype
    if e.matrices is not None:
        if m.action == "permute":
            raise ValueError(f"{m.param}: a weight vector cannot follow a {e.group.kind} transformation")
        if m.action == "dual":
            mat = _inverse_transpose(e, dtype, g.device, inverses)
        else:
            mat = torch.as_tensor(e.matrices, dtype=dtype, device=g.device)
        return torch.einsum("cij,cj...->ci...", mat, g)
    fresh = e.perm is not None or in_place  # g is then a new tensor (or may be written), scaled in place below
    if e.perm is not None:
        perm = torch.as_tensor(e.perm, device=g.device)
        g = g[0, perm[0]][None] if g.shape[0] == 1 else torch.stack([g[c, perm[c]] for c in range(g.shape[0])])
    if e.diag is None or m.action == "permute":
        return g
    d = torch.as_tensor(e.diag, dtype=dtype, device=g.device) ** m.exponent
    d = d.reshape(*d.shape, *([1] * (g.dim() - 2)))
    if m.action == "primal":
        return g.mul_(d) if fresh else g * d
    return g.div_(d) if fresh else g / d


def _inverse_transpose(e: Element, dtype: torch.dtype, device, inverses: dict | None) -> torch.Tensor:
    """``inv(M)^T`` of ``e``'s matrices ``M`` rounded to ``dtype``, kept in ``inverses`` (with the array it was
    computed from, so a key reused by another array after this one is freed is never taken for it)."""
    key = (id(e.matrices), dtype, str(device))
    kept = None if inverses is None else inverses.get(key)
    if kept is not None and kept[0] is e.matrices:
        return kept[1]
    mat = torch.linalg.inv(torch.as_tensor(e.matrices, dtype=dtype, device=device)).transpose(-1, -2)
    if inverses is not None:
        inverses[key] = (e.matrices, mat)
    return mat


def apply_to_model(model: torch.nn.Module, elements: list[Element]) -> torch.nn.Module:
    """A transformed deep copy of ``model`` (the original is untouched); tied weights stay tied."""
    new = copied_module(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    new.load_state_dict(apply(state, elements, dtype=torch.float64), strict=True, assign=False)
    return new
