"""Analysis: axis/space propagation over the captured graph, then assembly into symmetry groups."""
from __future__ import annotations

from ..capture import Capture
from ..moe import note_shared_expert_units
from ..spec import Specs, load_specs
from .assemble import Analysis, Assembler
from .walk import Walker


def analyse_capture(cap: Capture, specs: Specs | None = None) -> Analysis:
    """Walk ``cap``'s graph and assemble every symmetry group it admits."""
    specs = specs or load_specs()
    walker = Walker(cap, specs).run()
    analysis = Assembler(walker, specs).analyse()
    analysis.groups = note_shared_expert_units(analysis.groups)
    return analysis


__all__ = ["Analysis", "analyse_capture"]
