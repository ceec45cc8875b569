"""Partitions of coordinate ids: classes with orientation (union-find over ties), and merged overlapping sets.

Kept apart from :mod:`symgraph.analysis.assemble` so that :mod:`symgraph.analysis.scales` can use them without
importing its caller.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


def parity_classes(n: int, ties, keep=lambda product: True):
    """Union-find with orientation over ids ``0..n-1``: returns (class, parity, self_dual) per id.

    Ties are ``(a, b, dual, product)``; a dual tie flips orientation. Solved as connected components of the
    double cover (id, orientation); an id in the same component as its own flip is self-dual.
    """
    rows, cols = [np.arange(0)], [np.arange(0)]
    for a, b, parity, product in ties:
        if keep(product):
            rows += [a, a + n]
            cols += [b + parity * n, b + (1 - parity) * n]
    r, c = np.concatenate(rows), np.concatenate(cols)
    graph = coo_matrix((np.ones(len(r), dtype=np.int8), (r, c)), shape=(2 * n, 2 * n))
    _, comp = connected_components(graph, directed=False)
    pos, neg = comp[:n], comp[n:]
    canon = np.minimum(pos, neg)
    _, cls = np.unique(canon, return_inverse=True)
    return cls.reshape(-1), (pos != canon).astype(np.int8), pos == neg


def union_sets(sets) -> list[set]:
    """Merge sets that share an element (small inputs: heads, rows)."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s in sets:
        s = list(s)
        for x in s[1:]:
            parent[find(x)] = find(s[0])
        if s:
            find(s[0])
    out: dict = defaultdict(set)
    for x in parent:
        out[find(x)].add(x)
    return list(out.values())
