"""Assembly with free outputs (``--free-outputs``, see :mod:`symgraph.outputs`): walk with every output free,
assemble, and pin again each output that a group other than the residual stream's reached, until none does."""
from __future__ import annotations

import dataclasses

from ..groups import FreeOutput, Group, Member, PinnedSpace
from ..outputs import is_virtual, output_names
from .naming import common_prefix, short_members


def assemble_with_free_outputs(cap, specs, walk, assembler_class):
    """(analysis, assembler) with ``analysis.free_outputs`` filled and no virtual member left in any group."""
    names = output_names(cap)
    free = frozenset(range(len(names)))
    while True:
        walker = walk(cap, specs, free)
        assembler = assembler_class(walker, specs)
        analysis = assembler.analyse()
        groups, found, refused = split_free_outputs(analysis.groups, walker.free_sites)
        if refused:
            free -= refused
            continue
        analysis.groups = groups
        analysis.free_outputs = found
        analysis.fixed_outputs = [n for i, n in enumerate(names) if i not in {f.index for f in found}]
        analysis.pinned = _without_virtual(analysis.pinned, assembler.pinned_sizes)
        return analysis, assembler


def split_free_outputs(groups: list[Group], sites: dict[str, tuple[int, str, int]]
                       ) -> tuple[list[Group], list[FreeOutput], set[int]]:
    """Take the virtual members out of ``groups``.

    ``sites`` maps each virtual parameter to (output index, output name, axis counted from the end). Returns the
    groups without virtual members (named as if those had never been there), the free outputs, and the indices
    of outputs that a group other than the residual stream's isometries reached (they must be pinned).
    """
    kept, free, refused = [], [], set()
    for g in groups:
        virtual = [m for m in g.members if isinstance(m, Member) and is_virtual(m.param)]
        if not virtual:
            kept.append(g)
            continue
        isometric = g.kind in ("orthogonal", "permutation", "signed_permutation") and g.scale in (None, "sign")
        if g.motif != "residual" or not isometric:
            refused.update(sites[m.param][0] for m in virtual)
            continue
        real = tuple(m for m in g.members if m not in virtual)
        layer = common_prefix([p for m in real for p in m.params])
        gid = f"{g.id.split(':', 1)[0]}:{layer or 'model'}:{short_members(real)}"
        names = ", ".join(sites[m.param][1] for m in virtual)
        kept.append(dataclasses.replace(g, id=gid, members=real, layer=layer,
                                        notes=g.notes + (f"moves the free model output(s) {names}",)))
        free.extend(FreeOutput(*sites[m.param], group=gid, member=m) for m in virtual)
    return kept, free, refused


def _without_virtual(pinned: list[PinnedSpace], sizes: dict) -> list[PinnedSpace]:
    """The pinned spaces without virtual parameters (a free output whose stream something else pins), and
    ``sizes`` (per pinned space, coordinates per parameter) likewise, in place."""
    out = []
    for p in pinned:
        counts = sizes[(p.reason, p.node)]
        for name in [n for n in counts if is_virtual(n)]:
            del counts[name]
        if counts:
            out.append(dataclasses.replace(p, params=tuple(sorted(counts)), size=sum(counts.values())))
    return out
