"""Rows of a statistic that hold several heads, and the head permutations that keep such rows whole.

``Constraints.taken`` lists the rows that a statistic blind to their order takes one at a time: a softmax's rows,
a sum's, a norm's. Written in coordinates, a row may hold the coordinates of several heads before any attention op
has named them heads: ``cat([v[..., :8].softmax(-1), v[..., 8:].softmax(-1)])`` softmaxes the values of heads 0-1
and of heads 2-3 apart. A head permutation moves whole heads; it keeps such a row whole only if it maps the row
onto itself: a head moved into another row meets the other row's normaliser. A row over all of every head (a norm
over the whole width) or over the same coordinates of every head (a softmax across the heads axis) is kept whole;
a row that holds one head only (heads attended one by one in a loop) is left to the checks of the ops themselves.
"""
from __future__ import annotations

from collections import defaultdict
from functools import reduce

import numpy as np


class HeadRows:
    """The rows of ``taken`` that hold several classes (``link``: class per id) of ``heads`` (``content``: each
    head's ids), found by a head of each of their classes."""

    def __init__(self, taken, heads: list[int], content: dict[int, set[int]], link: np.ndarray):
        self.classes = {h: np.unique(link[np.fromiter(content[h], dtype=np.int64)]) for h in heads}
        self.rows_of: dict[int, list[np.ndarray]] = defaultdict(list)
        if not heads:
            return
        n = int(link.max()) + 1
        head_of = np.full(n + 1, -1, np.int64)  # a head holding each class (index n: no id)
        for h, classes in self.classes.items():
            head_of[classes] = h
        seen = set()
        for rows, _node in taken:
            rows = np.where(rows >= 0, link[rows], n)
            for row in rows[(head_of[rows] >= 0).sum(1) > 1]:
                row = np.unique(row[head_of[row] >= 0])
                if len(row) > 1 and row.tobytes() not in seen:
                    seen.add(row.tobytes())
                    for h in np.unique(head_of[row]):
                        self.rows_of[int(h)].append(row)

    def keep(self, units: list[list[int]]) -> bool:
        """Whether every permutation of ``units`` (lists of heads; one unit's classes correspond to another's in
        sorted order, classes every unit holds stay) maps each row holding classes of several units onto
        itself: the row holds the same positions of every unit."""
        rows = {id(r): r for u in units for h in u for r in self.rows_of.get(h, ())}
        if not rows:
            return True
        own = [np.unique(np.concatenate([self.classes[h] for h in u])) for u in units]
        shared = reduce(np.intersect1d, own)
        own = [np.setdiff1d(c, shared) for c in own]
        for row in rows.values():
            inside = [np.isin(c, row) for c in own]
            if sum(bool(m.any()) for m in inside) <= 1:
                continue  # one unit's own row: no other unit meets it
            if any(len(m) != len(inside[0]) or (m != inside[0]).any() for m in inside):
                return False
        return True
