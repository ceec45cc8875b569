"""Expert matching costs that no group inside an expert can change.

An expert permutation (a group of :class:`~symgraph.groups.TensorMember`: the experts of an ``nn.ModuleList``)
has to be found before the groups inside each expert (its FFN units and their scales), so its cost must not
depend on them. The similarity of anchor expert ``i`` and source expert ``j`` is therefore taken after aligning
``j``'s tensors to ``i``'s within ``i``'s own groups (the aligner's first pass and descent, through
``SolveContext.align_within``): the best similarity those groups allow, as a head's cost is its best rotation.
The members that are positions along an axis (the router's rows) add their plain similarity. At the true
permutation of an exactly reparametrised copy each pair aligns back exactly, the summed similarity is the
anchor's squared norm, and no other permutation reaches it (Cauchy-Schwarz), so the copy is recovered.
"""
from __future__ import annotations

import numpy as np

from ..groups import Group, Member, TensorMember, inner_groups, slot_tensors
from .reduce import row_sums


def expert_similarity(ws, g: Group, members, ctx) -> tuple[np.ndarray, dict]:
    """(S[c, anchor slot, source slot], the elements that aligned source slot ``j`` within anchor slot ``i``'s
    groups, by (c, i, j))."""
    positions = [m for m in members if isinstance(m, Member)]
    total = ws.similarity(positions, g, normalise=False) if positions else np.zeros((g.copies, g.size, g.size))
    if not any(isinstance(m, TensorMember) for m in members):
        return total, {}
    slots = slot_tensors(g)
    inside = {key: [h for h in inner_groups(g, ctx.groups) if set(h.params) <= set(names)]
              for key, names in slots.items()}
    inner = {}
    for (c, i), names in slots.items():
        anchor = {n: ws.anc[n] for n in names}
        for j in range(g.size):
            source = {n: ws.src[m] for n, m in zip(names, slots[(c, j)])}
            if inside[(c, i)] and ctx.align_within is not None:
                elements, moved = ctx.align_within(inside[(c, i)], source, anchor)
                source = {**source, **moved}
                inner[(c, i, j)] = elements
            total[c, i, j] += sum(float(row_sums(anchor[n].reshape(1, 1, -1), source[n].reshape(1, 1, -1))[0, 0])
                                  for n in names)
    return total, inner
