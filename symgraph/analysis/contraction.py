"""The one rule behind linear, addmm, matmul, bmm, einsum and attention: a sum over shared letters.

For operands ``A`` and ``B`` written with einsum letters:

* a channel of ``A`` that varies along a *contracted* letter is tied, dually, to the channel of ``B`` that varies
  along the same letters (``x . W^T``: activation coordinates are contracted with weight columns). Without such a
  partner the coordinates are contracted with data and are pinned.
* when that channel also varies along a *batch* letter (the head axis of ``q @ k^T``), each batch index is its
  own block: coordinates of different heads may not mix, and the output gets a block channel whose ids stand for
  the heads, linked to the rows they came from. This is how head structure (and GQA sharing) is read.
* a channel that varies along no contracted letter passes to the output (weight rows, value rows). If it also
  varies along a batch letter along which the other operand's values vary (``probs @ v``: each head has its own
  attention pattern), every batch index meets a different linear map, so its coordinates may not mix with those
  of other indices. This holds whether or not the other operand still carries head labels: an unknown op on the
  query/key path loses the labels, not the per-head structure.
* every passing channel is multiplied by the other operand's values, every contracted pair summed into one
  product: its coordinates are recorded as passing that matrix or sum
  (:meth:`~symgraph.analysis.constraints.Constraints.passes_through`), so that coordinates of one space that meet
  different matrices or sums (heads computed one by one in a loop, then joined) are never mixed.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import torch

from ..pattern import Pattern, parse_pattern
from .constraints import monomial
from .labels import (Chan, by_one_coordinate, chan_axes, collapse, collapse_pair, data_varies, one_coordinate,
                     slices_are_whole_spaces, unique_rows)
from .selections import selections_of

NEUTRAL = monomial("one")


@dataclass
class Operand:
    chans: list[Chan]
    shape: tuple[int, ...]
    letters: str
    data: object = None  # the operand's value when it depends on no parameter (None: unknown, may vary anywhere)
    constant_axes: frozenset[int] = frozenset()  # axes along which the values are known not to vary (expanded)
    source: str | None = None  # the graph node holding these values (None: values known only to this contraction)


def expand_ellipsis(pattern: Pattern, shapes: list[tuple[int, ...]]) -> tuple[list[str], str]:
    """Turn ``"...i,oi->...o"`` into explicit letters for the given operand ranks (numpy broadcasting)."""
    specs, output = pattern.operands, pattern.output
    used = set("".join(specs) + output) - set(".")
    pool = [c for c in string.ascii_uppercase if c not in used]
    n_ell = max((len(s) - len(spec.replace("...", "")) for spec, s in zip(specs, shapes) if "..." in spec),
                default=0)
    ell = "".join(pool[:n_ell])
    explicit = []
    for spec, shape in zip(specs, shapes):
        if "..." in spec:
            k = len(shape) - len(spec.replace("...", ""))
            spec = spec.replace("...", ell[n_ell - k:] if k else "")
        explicit.append(spec)
    return explicit, output.replace("...", ell)


def matmul_pattern(ra: int, rb: int) -> Pattern:
    """An einsum pattern equivalent to torch.matmul for operand ranks ``ra`` and ``rb``."""
    if ra == 1 and rb == 1:
        return parse_pattern("k,k->")
    if ra == 1:
        return parse_pattern("k,...km->...m")
    if rb == 1:
        return parse_pattern("...nk,k->...n")
    return parse_pattern("...nk,...km->...nm")


class Contraction:
    """Apply the contraction rule for one node; ``walker`` supplies constraints and id allocation."""

    def __init__(self, walker, node_name: str, step: int = 0):
        self.w = walker
        self.node = node_name
        self.step = step  # which pairwise product of the node this is (an einsum of several factors, attention)

    def run(self, a: Operand, b: Operand, out_letters: str, out_shape: tuple[int, ...]) -> list[Chan]:
        sizes = _letter_sizes([a, b], out_letters, out_shape)
        contracted = set(a.letters) & set(b.letters) - set(out_letters)
        batch = set(a.letters) & set(b.letters) & set(out_letters)
        moved = self._through_permutation(a, b, contracted, out_letters, out_shape)
        if moved is None:
            moved = self._weighted_sum_of_slices(a, b, contracted, out_letters, out_shape)
        if moved is not None:
            return moved
        outs: list[Chan] = []
        used_b: set[int] = set()
        heads_at: dict[int, list[Chan]] = {}  # channel of b -> the head blocks of a linked to it
        passed_a: list[tuple[Chan, frozenset]] = []
        for ca in a.chans:
            ca = self.w.resolve(ca, self.node)
            va = _letters_of(ca, a.letters)
            if ca.block and va & contracted:
                j = self._link_heads_to_consumers(ca, a, b, va & contracted, used_b, sizes)
                heads_at.setdefault(j, []).append(ca)
                continue
            if va & contracted:
                partner = self._partner(b, va & contracted, used_b)
                if partner is None:
                    self.w.c.pin(ca.ids, "contracted with data that carries no symmetry", self.node)
                    continue
                cb = self.w.resolve(b.chans[partner], self.node)
                block = self._contract_pair(ca, a, cb, b, batch, sizes, out_letters, out_shape)
                if block is not None:
                    outs.append(block)
            else:
                passed_a.append((ca, va))
        passed_b = []
        for j, cb in enumerate(b.chans):
            if j in used_b:
                continue
            cb = self.w.resolve(cb, self.node)
            vb = _letters_of(cb, b.letters)
            if cb.block and vb & contracted:
                self._link_heads_to_consumers(cb, b, a, vb & contracted, set(), sizes)
                continue
            if vb & contracted and j in heads_at and not vb - contracted and \
                    self._one_head_per_index(heads_at[j], a, vb, sizes):
                self._weights_of_heads(cb, heads_at[j])
                continue
            if vb & contracted:
                self.w.c.pin(cb.ids, "contracted with data that carries no symmetry", self.node)
                continue
            passed_b.append((cb, vb))
        passed_a, passed_b = self._tie_batch_factors(a, b, passed_a, passed_b, batch, outs, out_letters, out_shape)
        moved_a, moved_b = [], []
        for chan, letters, op, other, moved_of in [(c, v, a, b, moved_a) for c, v in passed_a] + \
                [(c, v, b, a, moved_b) for c, v in passed_b]:
            differs = letters & batch - _constant_letters(other)
            self._separate_batch_indices(chan, op, differs)
            if chan.block:
                self._pin_heads_beside_unlabelled_data(chan.ids, differs, other.chans, other, "values")
            if not chan.block:
                self.w.c.passes_through(chan.ids, self._matrix_key(other, op, out_letters))
            moved = self._to_output(chan, letters, op, out_letters, out_shape)
            if moved is not None:
                moved_of.append(moved)
        return _merge_batch_channels(self.w, outs + _squares_of_one_coordinate(moved_a, moved_b), self.node)

    def _through_permutation(self, a: Operand, b: Operand, contracted: set[str], out_letters: str,
                             out_shape) -> list[Chan] | None:
        """One operand times a constant monomial matrix (``h @ torch.eye(d)``, a fixed reordering, a signed one
        such as rotate_half's, a diagonal of scales): each output coordinate is one input coordinate times a known
        number, so the channels move as through an ``index_select`` and are then scaled as by ``h * numbers``,
        instead of meeting data that pins them. None unless one operand is such a matrix, contracted along one
        letter into another."""
        for x, p in ((a, b), (b, a)):
            found = _monomial_of(p) if p.source is not None and not self._from_inputs(p.source) else None
            if found is None:
                continue
            (k, m), (order, numbers) = p.letters, found
            if k in out_letters:  # the matrix read the other way round (F.linear's weight): its columns contracted
                k, m, order = m, k, torch.argsort(order)
                numbers = numbers[order]
            if contracted != {k} or m not in out_letters or m in x.letters:
                continue
            axis, letters = x.letters.index(k), x.letters.replace(k, m)
            chans = [self.w.resolve(c, self.node) for c in x.chans]
            scaled = bool((numbers != numbers[0]).any())
            if scaled and any(c.block and k in _letters_of(c, x.letters) for c in chans):
                return None  # numbers that differ from head to head stay when the heads move
            moved = [c.map(lambda t: t.index_select(axis, order) if t.shape[axis] > 1 else t) for c in chans]
            op = Operand(moved, out_shape, letters)
            outs = [o for c in moved if (o := self._to_output(c, _letters_of(c, letters), op, out_letters,
                                                              out_shape)) is not None]
            if not scaled:
                return [c.times(numbers[0]) for c in outs]  # outs come from resolved channels: none is mixed
            view = [len(numbers) if l == m else 1 for l in out_letters]
            return [c.scaled(numbers.reshape(view).expand(out_shape)) if m in _letters_of(c, out_letters) else c
                    for c in outs]  # as h * numbers: channels that do not vary along m meet one number each
        return None

    def _weighted_sum_of_slices(self, a: Operand, b: Operand, contracted: set[str], out_letters: str,
                                out_shape) -> list[Chan] | None:
        """Whole spaces stacked along the one contracted letter, summed with a weight per slice
        (``einsum("bne,bned->bnd", gates, stacked)``): as ``(gates[..., None] * stacked).sum(-2)``, the slices are
        tied and the sum carries their coordinates on; the weights, the same for every coordinate of a slice, pin
        their own coordinates (they would have to move with whole slices), unless the slices are stacked experts
        that move with them (analysis/experts.py). None where the operands are anything else."""
        if len(contracted) != 1:
            return None
        k = next(iter(contracted))
        for x, g in ((a, b), (b, a)):
            chans, weights = x.chans, g.chans  # mixed channels (resolved once, later) take the general rule
            if len(chans) != 1 or k not in x.letters or any(c.mixed for c in chans + weights):
                continue
            axis, kept = x.letters.index(k), _letters_of(chans[0], x.letters) - {k}
            varies = set(g.letters) - _constant_letters(g)
            if k not in _letters_of(chans[0], x.letters) or not kept <= set(out_letters) or kept & varies or \
                    any(c.block or _letters_of(c, g.letters) - {k} for c in weights) or \
                    not slices_are_whole_spaces(self.w.ids, chans[0], frozenset({axis})):
                continue
            if not self.w.branch_reads.weigh(self.w, self.node, x.source, axis, len(x.letters), weights,
                                             g.letters.index(k), summed_later=False):
                for c in weights:
                    self.w.c.pin(c.ids, "a weight per slice of spaces stacked along this axis", self.node)
            tied = tie_slices(self.w, chans[0], axis, self.node)
            self.w.c.passes_through(tied.ids, self._matrix_key(g, x, out_letters))
            moved = self._to_output(tied, kept, x, out_letters, out_shape)
            return [moved] if moved is not None else []
        return None

    def _from_inputs(self, name: str) -> bool:
        """Whether graph node ``name`` is computed from the model's inputs (its traced values may differ later)."""
        return any(n.name == name for n in selections_of(self.w.cap).from_inputs)

    def _tie_batch_factors(self, a: Operand, b: Operand, passed_a, passed_b, batch: set[str], outs: list,
                           out_letters: str, out_shape) -> tuple[list, list]:
        """Channels of both operands that vary along the same batch letters only (expert ``e``'s activations
        times expert ``e``'s weights) are one coordinate: tie them, permutation only (their scales would
        multiply), and put one copy in ``outs``. Returns the passing channels left to place."""
        kept_a, kept_b = [], list(passed_b)
        for ca, va in passed_a:
            j = None if ca.block or not va or not va <= batch else \
                next((j for j, (cb, vb) in enumerate(kept_b) if not cb.block and vb == va), None)
            if j is None:
                kept_a.append((ca, va))
                continue
            cb = kept_b.pop(j)[0]
            self.w.c.tie(_along(ca.ids, a.letters, va), _along(cb.ids, b.letters, va))
            for c in (ca, cb):
                self.w.c.restrict(c.ids, NEUTRAL, "multiplied elementwise along a batch axis", self.node)
                self.w.c.tag("experts", c.ids)  # index e of one factor meets index e of the other: whole experts
            outs.append(self._to_output(ca, va, a, out_letters, out_shape))
        return kept_a, kept_b

    def _link_heads_to_consumers(self, blk: Chan, a: Operand, b: Operand, letters, used_b, sizes) -> int | None:
        """Head outputs contracted with a weight (merged heads into o_proj): link each head to its columns.
        Returns the channel of ``b`` linked (None where none is: the heads are pinned)."""
        j = next((j for j, cb in enumerate(b.chans)
                  if not cb.block and _letters_of(cb, b.letters) & letters == letters), None)
        if j is None:
            self.w.c.pin(blk.ids, "heads contracted with data", self.node)
            return None
        k_letters = sorted(letters)
        heads = _rows_by_fiber(blk.ids, a.letters, [], k_letters, sizes)[0]
        cols = _rows_by_fiber(self.w.resolve(b.chans[j], self.node).ids, b.letters, [], k_letters, sizes)[0]
        for head_row in heads:
            for col_row in cols:
                for block_id in torch.unique(head_row):
                    ids = torch.unique(col_row[head_row == block_id])
                    self.w.c.rowlinks.append((np.array([int(block_id)]), ids.numpy()[None], self.node))
        return j

    @staticmethod
    def _one_head_per_index(heads: list[Chan], a: Operand, letters: set[str], sizes) -> bool:
        """Whether every index along ``letters`` holds a head of its own: a weight contracted there meets one
        head's output as one number (a router's), not a head's vector of values unit by unit (o_proj's columns
        where the values carry no coordinates, a gate per unit)."""
        k_letters = sorted(letters)
        return all(len(torch.unique(row)) == row.numel() and bool((row >= 0).all())
                   for blk in heads for row in _rows_by_fiber(blk.ids, a.letters, [], k_letters, sizes)[0])

    def _weights_of_heads(self, chan: Chan, heads: list[Chan]) -> None:
        """A channel that varies along the heads' letters only, a head of its own at each index, and is contracted
        with them, no values beside (``einsum("ted,te->td", per_expert, routing)``: experts stacked in one
        parameter's rows, each output weighed by its routing weight): each coordinate weighs one head's output,
        to which it is linked, so it may move with its head and nothing else: its coordinates neither mix nor scale
        (a scale would have to reach the head's output, which no linear map of the head's rows does alone). The
        heads are experts, the rows linked to them each expert's units (specs/motifs.yaml)."""
        ids = torch.unique(chan.ids[chan.ids >= 0])
        self.w.c.separate(ids.reshape(-1, 1), self.node)
        self.w.c.restrict(ids, NEUTRAL, "weighs the output of one head", self.node)
        blocks = np.unique(np.concatenate([blk.ids.reshape(-1).numpy() for blk in heads]))
        self.w.c.tag("experts", blocks)
        for block_ids, rows, _node in self.w.c.rowlinks:
            if np.isin(block_ids, blocks).any():
                self.w.c.tag("expert_units", rows)

    def _partner(self, b: Operand, letters: set[str], used: set[int]) -> int | None:
        for j, cb in enumerate(b.chans):
            if j not in used and not cb.block and _letters_of(cb, b.letters) & letters == letters:
                used.add(j)
                return j
        return None

    def _contract_pair(self, ca, a, cb, b, batch, sizes, out_letters, out_shape) -> Chan | None:
        va, vb = _letters_of(ca, a.letters), _letters_of(cb, b.letters)
        k_letters = sorted((va | vb) & (set(a.letters) & set(b.letters)) - set(out_letters))
        fiber = sorted((va | vb) & batch, key=out_letters.index)
        rows_a = _rows_by_fiber(ca.ids, a.letters, fiber, k_letters, sizes)
        rows_b = _rows_by_fiber(cb.ids, b.letters, fiber, k_letters, sizes)
        for ra, rb in zip(rows_a, rows_b):
            for x in ra:
                for y in rb:
                    self.w.c.tie(x, y, dual=True, node=self.node)
        for c in (ca, cb):  # one sum over these coordinates: no map may mix them with coordinates it leaves out
            self.w.c.passes_through(c.ids, f"{self.node}[{self.step}]")
        if not fiber:
            return None
        # One block per batch index (head): coordinates of different heads may not mix.
        first_a = torch.stack([r[0] for r in rows_a])
        first_b = torch.stack([r[0] for r in rows_b])
        self.w.c.separate(first_a, self.node)
        self.w.c.separate(first_b, self.node)
        self.w.c.tag("qk", first_a)
        self.w.c.tag("qk", first_b)
        # Batch indices whose query and key coordinates are the same rows are one head (a batch axis merged into
        # the heads axis, ``view(b * h, ...)``, then split again): one block, as for a batch axis kept apart
        heads: dict = {}
        same = [heads.setdefault((tuple(tuple(r.tolist()) for r in ra), tuple(tuple(r.tolist()) for r in rb)),
                                 len(heads)) for ra, rb in zip(rows_a, rows_b)]
        blocks = self.w.ids.allocate(len(heads), block=True)[torch.tensor(same)]
        for rows, op, chan in ((rows_a, a, ca), (rows_b, b, cb)):
            differs = set(fiber) - _constant_letters(op)
            if differs and any(bool((r < 0).any()) for head in rows for r in head):
                # some of a head's entries carry no coordinate (a pinned query times a rotary table one of whose
                # rows is a parameter: MLCD): that data differs per head and stays when the heads move
                self.w.c.pin(blocks, "a head's entries include data that differs from head to head", self.node)
            else:  # keys rebuilt from pieces along the heads axis: the same coordinates in every head
                self._pin_heads_beside_unlabelled_data(blocks, differs, [chan], op, "keys")
        self.w.c.rowlinks.append((blocks.numpy(), first_a.numpy(), self.node))
        self.w.c.rowlinks.append((blocks.numpy(), first_b.numpy(), self.node))
        view = [sizes[l] if l in fiber else 1 for l in out_letters]
        return Chan.clean(blocks.reshape(view).expand(out_shape), block=True)

    def _matrix_key(self, other: Operand, op: Operand, out_letters: str) -> str:
        """What ``op``'s passing coordinates are multiplied by: the same graph node's values contracted the same
        way are the same matrix (``a @ v1`` and ``a @ v2``, linears reading one input); anything else is a matrix
        of this product alone."""
        if other.source is None:
            return f"{self.node}[{self.step}]"
        rename = {l: string.ascii_letters[i] for i, l in enumerate(dict.fromkeys(other.letters + op.letters
                                                                                 + out_letters))}
        spell = "".join
        return f"{other.source}|{spell(map(rename.get, other.letters))},{spell(map(rename.get, op.letters))}" \
               f"->{spell(map(rename.get, out_letters))}"

    def _pin_heads_beside_unlabelled_data(self, heads, letters: set[str], chans: list[Chan], op: Operand,
                                          what: str) -> None:
        """Heads (block ids) multiplied by ``op``, which differs from head to head along ``letters``, must carry
        its per-head entries with them: only coordinates of ``chans`` that vary along those letters move there.
        Where none do (values or keys joined from pieces along the heads axis, then tied as a data axis; labels
        lost to an unknown op), a head permutation would leave those entries in place: pin the heads."""
        if letters and not any(not c.block and letters <= _letters_of(c, op.letters) for c in chans):
            self.w.c.pin(heads, f"heads multiplied by {what} that differ from head to head without moving with "
                         "them", self.node)

    def _separate_batch_indices(self, chan: Chan, op: Operand, letters: set[str]) -> None:
        """Coordinates at different indices of ``letters`` meet different data there: keep them apart."""
        if chan.block or not letters:
            return
        axes = [op.letters.index(l) for l in sorted(letters, key=op.letters.index)]
        rows = _ids_per_index(chan.ids, axes)
        self.w.c.separate(rows, self.node)
        if rows.shape[1] > 1:  # a vector per head (values), not one scalar per index
            self.w.c.tag("vo", rows)

    def _to_output(self, chan: Chan, letters: set[str], op: Operand, out_letters, out_shape) -> Chan | None:
        lost = letters - set(out_letters)
        if lost:
            self.w.c.pin(chan.ids, f"summed over axis '{''.join(sorted(lost))}' by a contraction", self.node)
            return None
        if not chan.ids.numel():  # a zero-width operand (Linear(0, n)'s weight rows): no coordinate to carry on
            return None
        index = tuple(slice(None) if l in out_letters else 0 for l in op.letters)
        kept = [l for l in op.letters if l in out_letters]
        order = sorted(kept, key=out_letters.index)

        def placed(t):
            t = t.expand(chan.ids.shape)[index].permute([kept.index(l) for l in order])  # a list: 0-d ids too
            view = [t.shape[order.index(l)] if l in order else 1 for l in out_letters]
            return (t.reshape(view) if t.is_contiguous() else t.contiguous().reshape(view)).expand(out_shape)

        out = Chan.clean(placed(chan.ids), block=chan.block)
        summed = {a for a, l in enumerate(op.letters) if l not in out_letters}
        # a factor the same along the letters summed over is a factor of the sum (x @ P, P a fixed permutation)
        if chan.factor is None or data_varies(chan.factor, summed, chan.ids.shape):
            return out
        return out.times(placed(chan.factor))


def tie_slices(w, c: Chan, axis: int, node: str) -> Chan:
    """The slices of ``c`` along ``axis`` tied, as ``add`` ties its operands; the result carries the first slice's
    coordinates in every slice."""
    first = c.ids.narrow(axis, 0, 1)
    for e in range(1, c.ids.shape[axis]):
        w.c.tie(*collapse_pair(first, c.ids.narrow(axis, e, 1)), node=node)
    return Chan.clean(first.expand(c.ids.shape))


def _constant_letters(op: Operand) -> set[str]:
    """Letters along which ``op``'s values are known not to vary (size 1, or known data constant there)."""
    out = {l for l, n in zip(op.letters, op.shape) if n == 1} | {op.letters[a] for a in op.constant_axes}
    if isinstance(op.data, torch.Tensor) and not op.chans and op.data.dim() == len(op.letters):
        out |= {l for a, l in enumerate(op.letters) if not data_varies(op.data, frozenset({a}), op.data.shape)}
    elif op.data is not None and not isinstance(op.data, torch.Tensor) and not op.chans:
        out |= set(op.letters)  # a Python scalar
    return out


def _ids_per_index(ids: torch.Tensor, axes: list[int]) -> np.ndarray:
    """(R, K): for each index along ``axes``, the distinct ids there; short rows repeat their first id."""
    ids = collapse(ids, keep=frozenset(axes))
    rest = [a for a in range(ids.dim()) if a not in axes]
    moved = ids.permute(*axes, *rest).reshape(int(np.prod([ids.shape[a] for a in axes])), -1)
    return _padded_rows([torch.unique(r[r >= 0]).numpy() for r in moved])


def _padded_rows(rows: list[np.ndarray]) -> np.ndarray:
    """Rows of different lengths as one (R, K) array, short rows repeating their first id (same set)."""
    rows = [r for r in rows if len(r)]
    width = max((len(r) for r in rows), default=0)
    return np.array([np.pad(r, (0, width - len(r)), mode="edge") for r in rows], dtype=np.int64).reshape(-1, width)


def _along(ids: torch.Tensor, letters: str, along: set[str]) -> torch.Tensor:
    """The labels along ``along`` (in letter order), read at index 0 of every other axis."""
    order = sorted(along)
    picked = ids[tuple(slice(None) if l in along else 0 for l in letters)]
    kept = [l for l in letters if l in along]
    return picked.permute(*[kept.index(l) for l in order])


def _letter_sizes(ops: list[Operand], out_letters: str, out_shape) -> dict[str, int]:
    sizes = {}
    for op in ops:
        for l, n in zip(op.letters, op.shape):
            sizes[l] = max(sizes.get(l, 1), n)
    for l, n in zip(out_letters, out_shape):
        sizes[l] = max(sizes.get(l, 1), n)
    return sizes


def _monomial_of(op: Operand) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a constant square real matrix with one nonzero entry in every row and column (and no channel), the
    row holding each column's nonzero and that number (float64); None for anything else."""
    data = op.data
    if op.chans or not isinstance(data, torch.Tensor) or data.dim() != 2 or data.shape[0] != data.shape[1] \
            or len(op.letters) != 2 or data.is_complex() or not bool(data.isfinite().all()):
        return None
    nonzero = data != 0
    if not bool((nonzero.sum(0) == 1).all() and (nonzero.sum(1) == 1).all()):
        return None
    order = nonzero.to(torch.int64).argmax(0)
    return order, data.to(torch.float64)[order, torch.arange(len(order))]


def _letters_of(chan: Chan, letters: str) -> set[str]:
    return {letters[a] for a in chan_axes(chan)}


def _rows_by_fiber(ids, letters, fiber, k_letters, sizes) -> list[list[torch.Tensor]]:
    """For each batch index in ``fiber``, the distinct label vectors along the contracted letters."""
    full = ids.expand([sizes[l] for l in letters]) if ids.dim() == len(letters) else ids
    fiber_axes = [letters.index(l) for l in fiber if l in letters]
    k_axes = [letters.index(l) for l in k_letters if l in letters]
    if not fiber_axes:
        return [list(unique_rows(full, k_axes))]
    n = int(np.prod([sizes[l] for l in fiber]))
    moved = full.permute(*fiber_axes, *[i for i in range(full.dim()) if i not in fiber_axes])
    moved = moved.reshape(n, *moved.shape[len(fiber_axes):])
    k_after = [1 + sorted([i for i in range(full.dim()) if i not in fiber_axes]).index(a) - 1 for a in k_axes]
    return [list(unique_rows(moved[i], k_after)) for i in range(n)]


def _squares_of_one_coordinate(from_a: list[Chan], from_b: list[Chan]) -> list[Chan]:
    """The channels both factors pass to the output, where each factor scales with one and the same coordinate
    everywhere (a token type's score in queries and in keys): their product is that coordinate's square, one
    channel of degree 2, as an elementwise ``x * x``. Carried as two, every attention layer doubled them (Funnel's
    twelve layers: tens of thousands of channels on the stream)."""
    out, used, a_single = list(from_a), set(), by_one_coordinate(from_a)
    for cb in from_b:
        coordinate = one_coordinate(cb)
        k = next((k for k in a_single.get(coordinate, ()) if k not in used), None) if coordinate is not None else None
        if k is None:
            out.append(cb)
            continue
        used.add(k)
        ca = from_a[k]
        factor = None if ca.factor is None and cb.factor is None else \
            torch.as_tensor(1.0 if ca.factor is None else ca.factor, dtype=torch.float64) * \
            torch.as_tensor(1.0 if cb.factor is None else cb.factor, dtype=torch.float64)
        out[k] = Chan(ca.terms, degree=2, factor=factor)
    return out


def _merge_batch_channels(walker, chans: list[Chan], node: str) -> list[Chan]:
    """Link head blocks to the coordinate rows that vary along the same axes.

    ``probs @ v``: the heads of ``probs`` are linked to the rows of ``v`` they select. The output keeps both
    channels: ``v``'s coordinates, and the head ids, which a later contraction (the output projection) turns into
    links from each head to the columns that read it.
    """
    coords = [c for c in chans if not c.block]
    blocks = [c for c in chans if c.block]
    out = list(coords)
    if blocks:  # coordinates that pass a contraction beside head blocks are values (even one shared KV head)
        for c in coords:
            walker.c.tag("vo", c.ids)
    for blk in blocks:
        axes = chan_axes(blk)
        same = next((o for o in out if o.block and chan_axes(o) == axes), None)
        if same is not None:
            walker.c.tie(same.ids, blk.ids, node=node)
            continue
        out.append(blk)  # kept: a later contraction links each head to the weight columns that read it
        host = next((c for c in coords if axes and axes <= chan_axes(c)), None)
        if host is None:
            continue
        other = [a for a in range(host.ids.dim()) if a not in axes]
        b_ids = blk.ids
        h_ids = host.ids
        n_axes = sorted(axes)
        heads = b_ids.permute(*n_axes, *other).reshape(-1, *[b_ids.shape[a] for a in other])
        rows = h_ids.permute(*n_axes, *other).reshape(heads.shape[0], -1)
        block_ids = heads.reshape(heads.shape[0], -1)[:, 0].numpy()
        read = [torch.unique(r[r >= 0]).numpy() for r in rows]  # every id a head reads
        block_ids = block_ids[[len(r) > 0 for r in read]]
        rows_np = _padded_rows(read)
        walker.c.rowlinks.append((block_ids, rows_np, node))
        walker.c.separate(rows_np, node)  # each head reads only its own value rows
        walker.c.tag("vo", rows_np)
    return out
