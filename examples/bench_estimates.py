"""Assignment costs from bfloat16 estimates against exact costs on one pair, in one process; prints JSON.

The pair is ``bench_align.py``'s ``llama-1b`` pair (hidden 2048, 32/8 heads, SwiGLU 5632, vocab 32000), built
into ``--pair-dir`` by ``bench_align.py --build`` when it is not there yet (``--layers`` makes it shallower). Full
mode (first pass, then ``--rounds`` rounds of descent, no second start) runs twice in this process, one side
after the other: with the estimates (:meth:`symgraph.solve.workspace.Workspace.similarity_estimate`, used where
their error bound proves the assignment) and with exact costs only. Reported per side: CPU seconds of the
alignment (``time.process_time``, steadier than wall time on a shared machine), solver seconds per group kind,
the permutation solves the estimates decided, the distance after; then ``cpu_speedup`` and whether both sides
applied identical elements (``identical``).

Example::

    python examples/bench_estimates.py --pair-dir /tmp/pair2 --layers 2 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def run_side(groups, source, anchor, rounds: int, estimates: bool) -> tuple[dict, list]:
    from symgraph.alignment import align_states
    from symgraph.solve import kernels, workspace

    decided, certain_row_maxima, fast = [], kernels.certain_row_maxima, workspace._bf16_matmul_is_fast

    def recording(s, bound):
        perm = certain_row_maxima(s, bound)
        decided.append(perm is not None)
        return perm

    kernels.certain_row_maxima = recording
    workspace._bf16_matmul_is_fast = fast if estimates else (lambda device: False)
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        result = align_states(groups, source, anchor, mode="full", rounds=rounds, matching_start=False)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        kernels.certain_row_maxima, workspace._bf16_matmul_is_fast = certain_row_maxima, fast
    per_kind = defaultdict(float)
    for s in result.stats:
        per_kind[s.kind] += s.seconds
    return {"cpu_s": cpu, "wall_s": wall, "solver_s_by_kind": dict(per_kind), "timings_s": result.timings,
            "estimates_tried": len(decided), "estimates_decided": int(sum(decided)),
            "distance_before": result.distance_before, "distance_after": result.distance_after,
            "refine_rounds": result.refine_rounds}, result.elements


def same_elements(first, second) -> bool:
    if [e.group.id for e in first] != [e.group.id for e in second]:
        return False
    return all((getattr(e, f) is None and getattr(g, f) is None) or np.array_equal(getattr(e, f), getattr(g, f))
               for e, g in zip(first, second) for f in ("perm", "diag", "matrices"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair-dir", type=Path, required=True, help="the pair's folder (built when missing)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the 16 of the 0.85B pair")
    parser.add_argument("--rounds", type=int, default=1, help="descent rounds after the first pass")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    import symgraph
    from symgraph.alignment import select_groups

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1)))
    if not (args.pair_dir / "source" / "model.safetensors").exists():
        layers = ["--layers", str(args.layers)] if args.layers else []
        subprocess.run([sys.executable, str(HERE / "bench_align.py"), "--build", "llama-1b", "transformed",
                        str(args.pair_dir), *layers], check=True, stdout=subprocess.DEVNULL)
    source = load_file(str(args.pair_dir / "source" / "model.safetensors"))
    anchor = load_file(str(args.pair_dir / "anchor" / "model.safetensors"))
    report = symgraph.analyze(args.pair_dir / "anchor" / "config.json", config_only=True)
    groups = select_groups(report.groups, "full")
    estimated, moves = run_side(groups, source, anchor, args.rounds, estimates=True)
    exact, exact_moves = run_side(groups, source, anchor, args.rounds, estimates=False)
    results = {"pair": "llama-1b/transformed", "layers": args.layers or 16, "rounds": args.rounds,
               "threads": torch.get_num_threads(), "estimates": estimated, "exact": exact,
               "cpu_speedup": exact["cpu_s"] / estimated["cpu_s"],
               "wall_speedup": exact["wall_s"] / estimated["wall_s"],
               "identical": same_elements(moves, exact_moves)
               and estimated["distance_after"] == exact["distance_after"]}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
