"""Analysis: axis/space propagation over the captured graph, then assembly into symmetry groups."""
from __future__ import annotations

from ..capture import Capture
from ..moe import note_shared_expert_units
from ..spec import Specs, load_specs
from .assemble import Analysis, Assembler
from .free_outputs import assemble_with_free_outputs
from .walk import Walker, walk


def analyse_capture(cap: Capture, specs: Specs | None = None, free_outputs: bool = False) -> Analysis:
    """Walk ``cap``'s graph and assemble every symmetry group it admits; with ``free_outputs``, outputs that are
    residual reads move with the residual stream instead of pinning it (:mod:`symgraph.outputs`)."""
    return assemble_capture(cap, specs, free_outputs)[0]


def assemble_capture(cap: Capture, specs: Specs | None = None,
                     free_outputs: bool = False) -> tuple[Analysis, Assembler]:
    """:func:`analyse_capture`, with the assembler (its per-parameter pin counts serve symgraph.depth)."""
    specs = specs or load_specs()
    if free_outputs:
        analysis, assembler = assemble_with_free_outputs(cap, specs, walk, Assembler)
    else:
        assembler = Assembler(walk(cap, specs), specs)
        analysis = assembler.analyse()
    analysis.groups = note_shared_expert_units(analysis.groups)
    return analysis, assembler


__all__ = ["Analysis", "analyse_capture", "assemble_capture"]
