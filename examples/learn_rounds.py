"""Learned matching in rounds (a remedy tried for issue 9, not a mode): full alignment of a shipped pair, then
ROUNDS rounds of the direct method of STEPS steps each; between rounds the permutation groups are re-matched on
weights to A (``--restarts-only``: not re-matched, the optimiser just restarts). Prints the loss barrier (test
split, 11 points, B aligned to A, folded) after each stage as one JSON object.

    python examples/learn_rounds.py vit-digits 3 200
    python examples/learn_rounds.py llama-chars 3 100 --restarts-only
"""
from __future__ import annotations

import argparse
import json
import time

from symgraph.alignment import PERMUTATION_KINDS, align_states, check_same_architecture, select_groups
from symgraph.api import folded_pair, load
from symgraph.connectivity import _Path, barrier_height
from symgraph.consensus import shared_float_names
from symgraph.datasets import load_data
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.learn import LearnOptions, learn_alignment, training_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair", choices=tuple(SHIPPED_PAIRS))
    parser.add_argument("rounds", type=int)
    parser.add_argument("steps", type=int, help="steps per round")
    parser.add_argument("--restarts-only", action="store_true")
    args = parser.parse_args()
    a, b = (str(p) for p in shipped_pair(args.pair))
    source, anchor, _, _ = folded_pair(load(b, None), load(a, None), True, check_same_architecture)
    groups = select_groups(source.report.groups, "full")
    state, anchor_state = source.state_dict(), anchor.state_dict()
    ts = [i / 10 for i in range(11)]
    path = _Path(anchor, load_data(SHIPPED_PAIRS[args.pair], model=load(a, None), split="test"), ts, False)

    def barrier(s) -> float:
        return barrier_height(ts, [m.loss for m in path.metrics(s, "")])

    clock = time.perf_counter()
    result = align_states(groups, state, anchor_state, mode="full")
    data = training_data(SHIPPED_PAIRS[args.pair], source, LearnOptions.batch_size)
    out = {"pair": args.pair, "rounds": args.rounds, "steps": args.steps, "restarts_only": args.restarts_only,
           "start": barrier(result.state)}
    for r in range(args.rounds):
        if r and not args.restarts_only:
            result = align_states([g for g in groups if g.kind in PERMUTATION_KINDS], result.state, anchor_state)
            out[f"rematched_{r}"] = barrier(result.state)
        result, _ = learn_alignment(groups, state, anchor_state, result, model=source.model, data=data,
                                    names=shared_float_names(anchor_state, frozenset()),
                                    options=LearnOptions(steps=args.steps, seed=r), progress=False)
        out[f"learned_{r}"] = barrier(result.state)
    out["seconds"] = time.perf_counter() - clock
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
