"""How groups are named in reports: the layer their members share and a short list of the modules involved."""
from __future__ import annotations

from ..groups import TensorMember


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
