"""How groups are named in reports: the layer their members share and a short list of the modules involved."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

from ..groups import Group, TensorMember


def common_prefix(names: list[str]) -> str:
    if not names:
        return ""
    parts = [n.split(".")[:-1] for n in names]
    prefix = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix)


def short_members(members) -> str:
    names = sorted({(m.role if isinstance(m, TensorMember) else m.param).rsplit(".", 1)[0].split(".")[-1]
                    for m in members})
    return "+".join(names[:4]) + ("+..." if len(names) > 4 else "")


def unique_ids(groups: list[Group]) -> list[Group]:
    """``groups`` with every id unique: the second and later groups of one name get ``#2``, ``#3``, ... in order.

    A name is the members' common prefix and module names, so groups spanning repeated blocks can share one (a
    residual group between MobileNet blocks 0-1 and another between 2-3 are both ``...mobilenet_v2.layer:...``);
    code that keys groups by id (consensus plans, experts, streamed depth) would then move one group's tensors
    with another's element. A link to a shared name goes to the group of that name sharing most tensors with the
    linking group (a rescale group and the group it rescales move the same tensors)."""
    counts = Counter(g.id for g in groups)
    if all(n == 1 for n in counts.values()):
        return groups
    seen: Counter = Counter()
    names = []
    for g in groups:
        seen[g.id] += 1
        names.append(g.id if seen[g.id] == 1 else f"{g.id}#{seen[g.id]}")
    named = defaultdict(list)  # a shared name -> (its new name, its tensors) per group
    for g, name in zip(groups, names):
        if counts[g.id] > 1:
            named[g.id].append((name, set(g.params)))

    def link(g: Group, to: str) -> str:
        if to not in named:
            return to
        return max(named[to], key=lambda candidate: len(candidate[1] & set(g.params)))[0]

    return [replace(g, id=name, links=tuple(link(g, to) for to in g.links)) for g, name in zip(groups, names)]


def role(param: str) -> str:
    """A parameter's name with its indices starred: the role it plays in each of a ModuleList's entries."""
    return ".".join("*" if part.isdigit() else part for part in param.split("."))
