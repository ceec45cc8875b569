"""Learned matching on the shipped pairs and the wide ViT: loss barrier (test split) with no alignment, full
alignment and full alignment tuned by learned matching (``full+learn``), its ratio to the unaligned barrier, the
steps, backtracks and seconds of learning.

    python examples/bench_learn.py                       # every shipped pair, default LearnOptions
    python examples/bench_learn.py --pairs vit-digits --steps 600 --points 11
    python examples/bench_learn.py --pairs llama-chars --method ste --t midpoint --lr 0.003 --aligns full,full+learn
    python examples/bench_learn.py --pairs vit-digits,vit-digits-wide --wide-steps 80 --baseline
    python examples/bench_learn.py --pairs vit-digits,llama-chars --steps 2400 --seconds 150 --patience 0
        --aligns none,full+learn --unbounded --json examples/results/learn_condition.json   # (one command)

``--baseline`` also learns with the previous default (one learning rate for every parameter, no backtracking:
``width_aware=False, backtracks=0``) at the same steps, in the same run, as ``full+learn (baseline)``;
``--unbounded`` also learns with no bound on the condition number of learned general linear maps
(``max_condition=inf``, the default before the bound), as ``full+learn (unbounded)``. Wide pairs
(``examples/train_models.py``, cached outside the repository; trained there first when missing) learn for
``--wide-steps`` steps (about 2.6 CPU seconds a step at width 256).

Prints one JSON object (and writes it to ``--json``), with the command and the load average before and after.
Barriers come from ``symgraph.barrier`` (B aligned to A; foldable pairs folded, as ``barrier`` does by default);
learning runs on the pair's training split. Measured: examples/results/bench_learn.json (each run with its
command), examples/results/learn_condition.json (the bound on learned general linear maps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import symgraph
import symgraph.learn
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.files import write_text_atomic
from symgraph.learn import LearnOptions
# examples/: the wide pairs are trained, not shipped
from train_models import WIDE_PAIRS, wide_pair

PAIRS = {**SHIPPED_PAIRS, **WIDE_PAIRS}  # pair -> the dataset it was trained on
BASELINE = {"width_aware": False, "backtracks": 0}  # the default before width-aware rates and backtracking
UNBOUNDED = {"max_condition": math.inf}  # the default before learned general linear maps were bounded
LEARNED = "full+learn"


def measure(pair: str, variants: dict[str, LearnOptions], points: int, aligns: tuple[str, ...]) -> dict:
    """Barriers of ``aligns`` with the first variant's options, then ``full+learn`` with each other variant."""
    a, b = (str(p) for p in (wide_pair(pair) if pair in WIDE_PAIRS else shipped_pair(pair)))
    barriers, seconds, learned = {}, {}, {}
    for i, (name, options) in enumerate(variants.items()):
        modes = aligns if i == 0 else (LEARNED,)
        records = []
        with _records_kept(records):
            clock = time.perf_counter()
            result = symgraph.barrier(a, b, PAIRS[pair], steps=points, aligns=modes, learn=options,
                                      progress=False)
        label = (lambda mode: mode) if name == "default" else (lambda mode: f"{mode} ({name})")
        barriers.update({label(m): c.loss_barrier for m, c in result.curves.items()})
        seconds.update({label(m): c.align_seconds for m, c in result.curves.items()})
        if records:
            learned[label(LEARNED)] = {"options": _plain(options), **records[-1].to_json(),
                                       "barrier_seconds": time.perf_counter() - clock}
    none = barriers.get("none")
    return {"pair": pair, "data": PAIRS[pair], "points": points, "barrier": barriers,
            **({"ratio_to_none": {m: v / none for m, v in barriers.items()}} if none else {}),
            "align_seconds": seconds, "learned": learned}


def _plain(options: LearnOptions) -> dict:
    """``options`` as JSON values (no bound: None, as in the record, not a non-standard Infinity)."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in options.__dict__.items()}


class _records_kept:
    """Within the block, every :class:`symgraph.learn.LearnRecord` made is appended to ``records`` (the barrier
    keeps only the curves)."""

    def __init__(self, records: list):
        self.records, self.original = records, symgraph.learn.learn_alignment

    def __enter__(self):
        def recorded(*args, **kwargs):
            result, record = self.original(*args, **kwargs)
            self.records.append(record)
            return result, record

        symgraph.learn.learn_alignment = recorded

    def __exit__(self, *exc):
        symgraph.learn.learn_alignment = self.original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS),
                        help=f"comma-separated pairs: shipped ({', '.join(SHIPPED_PAIRS)}) or wide "
                             f"({', '.join(WIDE_PAIRS)})")
    parser.add_argument("--steps", type=int, default=LearnOptions.steps, help="learning steps (shipped pairs)")
    parser.add_argument("--wide-steps", type=int, default=80, help="learning steps on the wide pairs")
    parser.add_argument("--lr", type=float, default=LearnOptions.lr)
    parser.add_argument("--batch-size", type=int, default=LearnOptions.batch_size)
    parser.add_argument("--t", default=LearnOptions.t, choices=symgraph.learn.T_CHOICES)
    parser.add_argument("--method", default=LearnOptions.method, choices=("direct", "ste"))
    parser.add_argument("--no-general-linear", action="store_true", help="direct: keep QK/VO maps orthogonal")
    parser.add_argument("--no-width-aware", action="store_true", help="one learning rate for every parameter")
    parser.add_argument("--backtracks", type=int, default=LearnOptions.backtracks)
    parser.add_argument("--checks", type=int, default=LearnOptions.checks, help="checks of the path loss")
    parser.add_argument("--patience", type=int, default=LearnOptions.patience,
                        help="stop when this many checks gain less than --tolerance of the gain so far (0: never)")
    parser.add_argument("--tolerance", type=float, default=LearnOptions.tolerance)
    parser.add_argument("--seconds", type=float, default=LearnOptions.seconds, help="time cap of learning")
    parser.add_argument("--seed", type=int, default=LearnOptions.seed, help="seed of batch order and t")
    parser.add_argument("--t-concentration", type=float, default=LearnOptions.t_concentration,
                        help="random t drawn from Beta(c, c) (1: uniform)")
    parser.add_argument("--backtrack-margin", type=float, default=LearnOptions.backtrack_margin)
    parser.add_argument("--eval-batches", type=int, default=LearnOptions.eval_batches,
                        help="batches each candidate is checked on")
    parser.add_argument("--holdout", action="store_true", help="check on batches held out of the steps")
    parser.add_argument("--mixup", type=float, default=LearnOptions.mixup,
                        help="weight of distillation on mixed inputs (classifiers with float inputs; 0: none)")
    parser.add_argument("--no-rate-trial", action="store_true",
                        help="direct: no trial of 0.3x the rate from the start at a first backtrack to the "
                             "first check's point")
    parser.add_argument("--max-condition", type=float, default=LearnOptions.max_condition,
                        help="bound on the condition number of learned general linear maps")
    parser.add_argument("--baseline", action="store_true",
                        help="also learn with the previous default (width_aware=False, backtracks=0)")
    parser.add_argument("--unbounded", action="store_true",
                        help="also learn with no bound on the condition number (max_condition=inf)")
    parser.add_argument("--points", type=int, default=11, help="points on the path, ends included")
    parser.add_argument("--aligns", default=f"none,full,{LEARNED}", help="comma-separated barrier modes")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    options = LearnOptions(steps=args.steps, lr=args.lr, batch_size=args.batch_size, t=args.t, method=args.method,
                           general_linear=not args.no_general_linear, width_aware=not args.no_width_aware,
                           backtracks=args.backtracks, checks=args.checks, patience=args.patience,
                           tolerance=args.tolerance, seconds=args.seconds, max_condition=args.max_condition,
                           eval_batches=args.eval_batches, holdout=args.holdout, mixup=args.mixup,
                           rate_trial=not args.no_rate_trial, seed=args.seed, t_concentration=args.t_concentration,
                           backtrack_margin=args.backtrack_margin)
    runs, load_before = [], os.getloadavg()
    for pair in args.pairs.split(","):
        steps = args.wide_steps if pair in WIDE_PAIRS else args.steps
        chosen = replace(options, steps=steps)
        variants = {"default": chosen, **({"baseline": replace(chosen, **BASELINE)} if args.baseline else {}),
                    **({"unbounded": replace(chosen, **UNBOUNDED)} if args.unbounded else {})}
        runs.append(measure(pair, variants, args.points, tuple(args.aligns.split(","))))
    out = json.dumps({"command": " ".join(["python", *sys.argv]), "load_average_before_after": [load_before,
                      os.getloadavg()], "options": _plain(options), "wide_steps": args.wide_steps, "runs": runs},
                     indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.json, out)
    print(out)


if __name__ == "__main__":
    main()
