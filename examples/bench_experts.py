"""Time expert matching (symgraph/solve/experts.py) on ModuleList mixtures of experts. Prints JSON.

For each expert count, the hand-written MoE language model of examples/handwritten_zoo.py (``moe_lm``: two blocks,
SwiGLU experts kept in an ``nn.ModuleList`` and run by a loop, top-2 softmax routing), in float64, is aligned
(``align_states``, full mode) twice: a copy moved by a random element of every group (expected back to rounding)
and an independently initialised twin. The expert permutation's costs align every pair of experts within their
own groups, E^2 small alignments per solve, so its share of the time grows with the square of the expert count::

    python examples/bench_experts.py --experts 4,8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def one(experts: int) -> dict:
    import numpy as np
    import torch

    import symgraph
    from handwritten_zoo import moe_lm, tokens_only
    from symgraph.alignment import align_states
    from symgraph.elements import apply, sample

    def build(seed: int):
        torch.manual_seed(seed)
        return moe_lm(k=2, experts=experts)().double().eval()

    clock = time.perf_counter()
    model = build(0)
    subject = symgraph.load(model, ((), tokens_only(2, 7, False)))
    groups = subject.report.groups
    row = {"experts": experts, "groups": len(groups), "report_s": round(time.perf_counter() - clock, 1),
           "expert_groups": sum(g.motif == "experts" for g in groups)}
    state = subject.state_dict()
    moved = apply(state, [sample(g, np.random.default_rng(0)) for g in groups])
    twin = {k: v.detach() for k, v in build(1).state_dict().items()}
    for name, source in (("copy", moved), ("twin", twin)):
        clock = time.perf_counter()
        result = align_states(groups, source, state, mode="full")
        solves = [s for s in result.stats if s.group.startswith("experts")]
        row[name] = {"seconds": round(time.perf_counter() - clock, 1), "distance_before": result.distance_before,
                     "distance_after": result.distance_after, "expert_solves": len(solves),
                     "expert_seconds": round(sum(s.seconds for s in solves), 1)}
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="4,8", help="comma-separated expert counts")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = [one(int(e)) for e in args.experts.split(",")]
    out = {"load_average": os.getloadavg()[0], "threads": 1, "rows": rows}
    text = json.dumps(out, indent=1)
    if args.json:
        from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
        write_text_atomic(args.json, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
