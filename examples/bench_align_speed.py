"""Alignment speed against an earlier commit, on one pair, in one run; prints JSON.

The pair is ``bench_align.py``'s ``llama-1b`` (LlamaConfig hidden 2048, 16 layers, 32/8 heads, SwiGLU 5632,
vocab 32000, untied head: 0.85B parameters), ``transformed`` (a random element of A's group plus 1% noise) or
``independent``; ``--layers`` makes it shallower for a quick look. Each side runs ``bench_align.py --run`` in a
process of its own, one after the other on the same pair files: this tree, and the commit ``--baseline`` exported
with ``git archive`` (default: the commit before the speed work). Reported per side: time per stage, distance
before/after, peak RSS, CPU time; then ``speedup`` (baseline total / this total, wall clock), ``cpu_speedup`` (the
same for CPU time) and ``distance_relative_difference``.

Example::

    python examples/bench_align_speed.py --layers 2 --modes full
    python examples/bench_align_speed.py --out examples/results/align_speed_0.85b.json      # the 0.85B pair
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "0a3125a"  # main before the speed work (incremental residual cost, views, device/dtype)


def export(rev: str, folder: Path) -> Path:
    """The tree of ``rev`` under ``folder`` (git archive), with the package's specs where the package reads them."""
    archive = folder / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree", filter="data")
    specs = folder / "tree" / "symgraph" / "specs"
    if not specs.exists():
        specs.symlink_to(Path("..") / "specs")
    return folder / "tree"


def child(tree: Path, *args: str) -> dict:
    """One ``bench_align.py`` child of ``tree``; ``cpu_s`` is its CPU time (steadier than wall time on a machine
    that other jobs share)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, str(tree / "examples" / "bench_align.py"), *args], capture_output=True,
                         text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"{tree}: {args} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return result


def run_args(tree: Path, folder: Path, mode: str) -> list[str]:
    """``bench_align.py --run`` arguments for ``tree``: later trees also take the device (cpu here)."""
    takes_device = '"--run", nargs=4' in (tree / "examples" / "bench_align.py").read_text()
    return ["--run", "llama-1b", str(folder), mode, *(["cpu"] if takes_device else [])]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="transformed", choices=["transformed", "independent"])
    parser.add_argument("--modes", default="full")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the 16 of the 0.85B pair")
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--pair-dir", type=Path, help="reuse (or keep) the pair files here")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = args.pair_dir or tmp / "pair"
        layers = ["--layers", str(args.layers)] if args.layers else []
        results = {"pair": f"llama-1b/{args.kind}", "layers": args.layers or 16, "baseline": args.baseline,
                   "threads": os.environ.get("BENCH_THREADS", "all"), "modes": {}}
        if not (folder / "source" / "model.safetensors").exists():
            results["build"] = child(ROOT, "--build", "llama-1b", args.kind, str(folder), *layers)
        old_tree = export(args.baseline, tmp)
        for mode in args.modes.split(","):
            new = child(ROOT, *run_args(ROOT, folder, mode))
            old = child(old_tree, *run_args(old_tree, folder, mode))
            results["modes"][mode] = {
                "this": new, "baseline": old, "speedup": old["total_s"] / new["total_s"],
                "cpu_speedup": old["cpu_s"] / new["cpu_s"],
                "distance_relative_difference": abs(new["distance_after"] - old["distance_after"])
                / old["distance_after"]}
            if args.out:
                from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
                write_text_atomic(args.out, json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
