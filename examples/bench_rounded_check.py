"""What the check of a bf16 result as an exact result rounded costs, against the usual check, in one run; prints JSON.

    python examples/make_llama_7b_pair.py --out /work/tmp/pair --num-hidden-layers 2 --models A,B1
    python examples/bench_rounded_check.py /work/tmp/pair/B1 /work/tmp/pair/A [--mode full] [--no-fold]

SOURCE is aligned to ANCHOR block by block (``symgraph.align_streamed``, folded unless ``--no-fold``) with bf16's
fixed tolerance lowered to 1e-6, as a checkpoint whose outputs one rounding moves more than 3e-2 would meet it, so
that every check takes the second route (:class:`symgraph.verify.RoundedExact`): the elements applied anew to
SOURCE in float64 block by block, that model run against SOURCE, each written tensor compared with its float64
counterpart. ``passes_s`` times each streamed forward pass (SOURCE, the written model, the exact model, which
includes applying the elements and the comparisons), ``unread_s`` the comparison of tensors no pass read; the
ratio is the check with the second route over the usual one (the first two passes). Nothing is kept at OUT.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import symgraph.streamed_verify as streamed_verify  # noqa: E402
from symgraph import verify  # noqa: E402
from symgraph.streamed_align import align_streamed  # noqa: E402


def timed(function, into: list):
    def run(*args, **kwargs):
        clock = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - clock)
    return run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("anchor", type=Path)
    parser.add_argument("--mode", default="full")
    parser.add_argument("--no-fold", action="store_true")
    args = parser.parse_args(argv)
    passes, unread = [], []
    kept = streamed_verify.streamed_outputs, streamed_verify.rounding_distance, verify.TOLERANCE[torch.bfloat16]
    streamed_verify.streamed_outputs = timed(kept[0], passes)
    streamed_verify.rounding_distance = timed(kept[1], unread)
    verify.TOLERANCE[torch.bfloat16] = 1e-6
    out = Path(tempfile.mkdtemp(prefix="bench-rounded-")) / "out"
    try:
        clock = time.perf_counter()
        result = align_streamed(args.source, args.anchor, out, mode=args.mode, fold=not args.no_fold)
        total = time.perf_counter() - clock
    finally:  # the module's own functions and tolerance back, for a caller in the same process
        streamed_verify.streamed_outputs, streamed_verify.rounding_distance = kept[:2]
        verify.TOLERANCE[torch.bfloat16] = kept[2]
        shutil.rmtree(out.parent, ignore_errors=True)
    rounded = result.verified_rounded
    report = {"source": str(args.source), "anchor": str(args.anchor), "mode": args.mode, "fold": not args.no_fold,
              "torch_threads": torch.get_num_threads(), "total_s": total, "timings_s": result.timings,
              "relative_error": result.verified_error, "fixed_tolerance_forced": 1e-6,
              "rounded_exact": rounded and rounded.__dict__, "passes_s": passes[:3], "unread_s": sum(unread[-1:]),
              "second_route_over_usual_check": result.timings["verify"] / sum(passes[:2])}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
