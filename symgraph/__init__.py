"""symgraph: find a model's parameter-space symmetries from its traced graph, and align models with them.

Examples
--------
>>> import symgraph, torch
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
>>> [(g.motif, g.kind, g.size) for g in symgraph.analyze(mlp, inputs=(torch.randn(2, 4),)).groups]
[('ffn', 'permutation', 8)]
"""
from .api import Subject, align, analyze, load, sample_elements, transform
from .connectivity import BarrierResult, barrier
from .elements import Element, apply, apply_to_model, sample
from .errors import SymgraphError
from .fold import FoldResult, fold
from .groups import Group, Member, PinnedSpace
from .merging import MergeResult, StreamedMerge, merge, merge_streamed
from .report import Report
from .streamed_align import StreamedAlignment, align_streamed

__all__ = [
    "BarrierResult", "Element", "FoldResult", "Group", "Member", "MergeResult", "PinnedSpace", "Report", "Subject", "SymgraphError",
    "StreamedMerge",
    "align", "analyze", "apply", "apply_to_model", "barrier", "fold", "load", "merge", "sample", "sample_elements",
    "transform", "merge_streamed", "StreamedAlignment", "align_streamed",
]
