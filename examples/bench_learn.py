"""Learned matching on the shipped pairs: loss barrier (test split) with no alignment, full alignment and full
alignment tuned by learned matching (``full+learn``), its ratio to the unaligned barrier, and the seconds spent.

    python examples/bench_learn.py                       # every shipped pair, default LearnOptions
    python examples/bench_learn.py --pairs vit-digits --steps 600 --points 11
    python examples/bench_learn.py --pairs llama-chars --method ste --t midpoint --lr 0.003 --aligns full,full+learn

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


def measure(pair: str, options: LearnOptions, points: int, aligns: tuple[str, ...]) -> dict:
    a, b = (str(p) for p in shipped_pair(pair))
    clock = time.perf_counter()
    result = symgraph.barrier(a, b, SHIPPED_PAIRS[pair], steps=points, aligns=aligns, learn=options,
                              progress=False)
    curves = result.curves
    return {"pair": pair, "data": SHIPPED_PAIRS[pair], "points": points,
            "barrier": {mode: c.loss_barrier for mode, c in curves.items()},
            **({"ratio_to_none": {mode: c.loss_barrier / curves["none"].loss_barrier for mode, c in curves.items()}}
               if "none" in curves else {}),
            "align_seconds": {mode: c.align_seconds for mode, c in curves.items()},
            "seconds": time.perf_counter() - clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS), help="comma-separated shipped pairs")
    parser.add_argument("--steps", type=int, default=LearnOptions.steps, help="learning steps")
    parser.add_argument("--lr", type=float, default=LearnOptions.lr)
    parser.add_argument("--batch-size", type=int, default=LearnOptions.batch_size)
    parser.add_argument("--t", default=LearnOptions.t, choices=("midpoint", "random"))
    parser.add_argument("--method", default=LearnOptions.method, choices=("direct", "ste"))
    parser.add_argument("--no-general-linear", action="store_true", help="direct: keep QK/VO maps orthogonal")
    parser.add_argument("--points", type=int, default=11, help="points on the path, ends included")
    parser.add_argument("--aligns", default="none,full,full+learn", help="comma-separated barrier modes")
    args = parser.parse_args()
    options = LearnOptions(steps=args.steps, lr=args.lr, batch_size=args.batch_size, t=args.t, method=args.method,
                           general_linear=not args.no_general_linear)
    runs = [measure(pair, options, args.points, tuple(args.aligns.split(","))) for pair in args.pairs.split(",")]
    print(json.dumps({"options": options.__dict__, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
