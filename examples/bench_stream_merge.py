"""Streamed simple merge against its floor, the time to read both checkpoints once; prints JSON.

    python examples/bench_stream_merge.py /work/big7b/A /work/big7b/B1 [--out /work/big7b/merged] [--keep]

Two stages, each in a process of its own so that its peak RSS (``wait4``'s ``ru_maxrss``) is its own:
``read`` reads every tensor of both checkpoints once through :class:`symgraph.lazy_state.LazyState` into memory
(a copy of each memory-mapped tensor: the floor);
``merge`` runs ``symgraph merge A B --stream --method simple --align none -o OUT`` (read both, average in fp32,
write the stored dtype as sharded safetensors). Times are measured inside each process (Python and symgraph
start-up left out; the wall times with them are reported too). The page cache is shared with the machine and not
dropped: on a machine whose RAM cannot cache both checkpoints, both stages read mostly from disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

READ_BOTH = """
import sys, time
from symgraph.lazy_state import LazyState
start, total = time.perf_counter(), 0
for source in sys.argv[1:]:
    state = LazyState(source)
    for name in state:
        total += state[name].clone().nbytes  # the tensor is memory-mapped: copying it reads every byte
print(total, time.perf_counter() - start)
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--out", type=Path, default=Path("/work/big7b/merged"))
    parser.add_argument("--shard-size", default="5GB")
    parser.add_argument("--keep", action="store_true", help="keep the merged folder (default: remove it)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    read = _stage([sys.executable, "-c", READ_BOTH, args.a, args.b])
    summary_file = args.out.parent / f".{args.out.name}-bench.json"
    merge = _stage([sys.executable, "-m", "symgraph", "merge", args.a, args.b, "--stream", "--align", "none",
                    "--shard-size", args.shard_size, "-o", str(args.out), "--overwrite", "--json", str(summary_file)])
    merged = json.loads(summary_file.read_text())
    summary_file.unlink()
    if not args.keep:
        shutil.rmtree(args.out)
    size, floor = read["stdout"].split()
    gb, floor = int(size) / 1e9, float(floor)
    return {"models": [args.a, args.b], "read_gb": round(gb, 2), "written_gb": round(merged["bytes_written"] / 1e9, 2),
            "floor_read_both_s": round(floor, 1), "read_gb_per_s": round(gb / floor, 3),
            "floor_peak_rss_mb": read["peak_rss_mb"], "merge_s": round(merged["seconds"], 1),
            "merge_over_floor": round(merged["seconds"] / floor, 2), "merge_peak_rss_mb": merge["peak_rss_mb"],
            "wall_with_python_start_s": {"read": read["seconds"], "merge": merge["seconds"]},
            "shard_size": args.shard_size, "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}


def _stage(command: list[str]) -> dict:
    """Run one stage in a child process: wall time, stdout, and the child's own peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {os.waitstatus_to_exitcode(status)})")
    return {"seconds": round(seconds, 1), "stdout": stdout.strip(), "peak_rss_mb": round(usage.ru_maxrss / 1024)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
