"""Learned matching on the shipped pairs: loss barrier (test split) with no alignment, full alignment and full
alignment tuned by learned matching (``full+learn``), its ratio to the unaligned barrier, and the seconds spent.

    python examples/bench_learn.py                       # every shipped pair, default LearnOptions
    python examples/bench_learn.py --pairs vit-digits --steps 600 --points 11

Prints one JSON object. Barriers come from ``symgraph.barrier`` (B aligned to A; foldable pairs folded, as
``barrier`` does by default); learning runs on the pair's training split.
"""
from __future__ import annotations

import argparse
import json
import time

import symgraph
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.learn import LearnOptions


def measure(pair: str, options: LearnOptions, points: int) -> dict:
    a, b = (str(p) for p in shipped_pair(pair))
    clock = time.perf_counter()
    result = symgraph.barrier(a, b, SHIPPED_PAIRS[pair], steps=points, aligns=("none", "full", "full+learn"),
                              learn=options, progress=False)
    curves = result.curves
    return {"pair": pair, "data": SHIPPED_PAIRS[pair], "points": points,
            "barrier": {mode: c.loss_barrier for mode, c in curves.items()},
            "ratio_to_none": {mode: c.loss_barrier / curves["none"].loss_barrier for mode, c in curves.items()},
            "align_seconds": {mode: c.align_seconds for mode, c in curves.items()},
            "seconds": time.perf_counter() - clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS), help="comma-separated shipped pairs")
    parser.add_argument("--steps", type=int, default=LearnOptions.steps, help="learning steps")
    parser.add_argument("--lr", type=float, default=LearnOptions.lr)
    parser.add_argument("--t", default=LearnOptions.t, choices=("midpoint", "random"))
    parser.add_argument("--points", type=int, default=11, help="points on the path, ends included")
    args = parser.parse_args()
    options = LearnOptions(steps=args.steps, lr=args.lr, t=args.t)
    runs = [measure(pair, options, args.points) for pair in args.pairs.split(",")]
    print(json.dumps({"options": options.__dict__, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
