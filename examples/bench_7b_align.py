"""Streamed alignment of a large pair against its floor, the time to read both checkpoints once; prints JSON.

    python examples/bench_7b_align.py /work/big7b/B1 /work/big7b/A [--modes paper,permutation,full]
        [--out /work/big7b/aligned] [--rounds 8] [--fold] [--no-verify] [--device cpu|cuda] [--json FILE --key NAME]

SOURCE is aligned to ANCHOR. Each stage runs in a process of its own, one after the other, so that its peak RSS
(``wait4``'s ``ru_maxrss``) is its own: ``read`` reads every tensor of both checkpoints once (the floor, as in
``bench_stream_merge.py``), then per mode what ``symgraph align SOURCE ANCHOR --stream --mode M`` runs
(``symgraph.align_streamed``: analysis on the meta device, the residual stream from the embeddings and head, each
block read, aligned and written, then the written model checked against SOURCE in float64 block by block), with a
line on stderr per solve (seconds, stage, group, peak RSS so far). The time of each stage comes from the run's
stats (inside the process: Python start-up left out; the wall time with it is reported too) and is divided by
the floor. ``--device cuda`` solves each block on the GPU (``align --stream --device cuda``; reads, writes
and the float64 check stay on the CPU). With ``--json`` the result is stored under ``--key`` in that file (other
keys kept), written atomically. The page cache is not dropped: a 24 GB machine cannot cache two 12 GB checkpoints anyway.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_stream_merge import READ_BOTH, _stage  # noqa: E402

from symgraph.files import write_text_atomic  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("anchor")
    parser.add_argument("--modes", default="paper,permutation,full")
    parser.add_argument("--out", type=Path, default=Path("/work/big7b/aligned"))
    parser.add_argument("--rounds", type=int, default=None, help="descent rounds inside each block (default 8)")
    parser.add_argument("--shard-size", default="5GB")
    parser.add_argument("--fold", action="store_true", help="read both models folded (align --stream --fold)")
    parser.add_argument("--no-verify", action="store_true", help="skip the float64 check (not offered by the CLI)")
    parser.add_argument("--no-floor", action="store_true", help="do not measure the read floor again")
    parser.add_argument("--json", type=Path, help="store the result in this file under --key")
    parser.add_argument("--key", default=None, help="default: SOURCE-ANCHOR folder names")
    parser.add_argument("--device", default="cpu", help="where each block is solved (cpu, cuda)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"source": args.source, "anchor": args.anchor, "cpu_count": os.cpu_count(),
              "torch_threads": os.environ.get("OMP_NUM_THREADS"), "device": _device_name(args.device), "modes": {}}
    if not args.no_floor:
        read = _stage([sys.executable, "-c", READ_BOTH, args.source, args.anchor])
        size, floor = read["stdout"].split()
        result.update(read_gb=round(int(size) / 1e9, 2), floor_read_both_s=round(float(floor), 1),
                      floor_peak_rss_mb=read["peak_rss_mb"])
    elif args.json is not None and args.json.is_file():
        previous = json.loads(args.json.read_text()).get(args.key or _key(args), {})
        result.update({k: previous[k] for k in ("read_gb", "floor_read_both_s", "floor_peak_rss_mb") if k in previous})
    for mode in args.modes.split(","):
        result["modes"][mode] = _align(args, mode, result.get("floor_read_both_s"))
        result["load_average"] = os.getloadavg()
        _store(args, result)
    return result


# One streamed alignment, as `symgraph align SOURCE ANCHOR -o OUT --stream` runs it, with a line on stderr per
# solve (seconds since start, stage, group, peak RSS so far): a run that cannot finish shows how far it got.
ALIGN = """
import json, resource, sys, time
import symgraph
from symgraph.cli import _parse_size as parse_size
source, anchor, out, mode, rounds, stats, fold, device, verify, shard = sys.argv[1:]
start = time.perf_counter()
def log(stage, group, done, total):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{time.perf_counter() - start:9.1f} s  {stage:>12}  {done:3d}/{total:<3d}  {group.id}  peak {rss:.0f} MB",
          file=sys.stderr, flush=True)
r = symgraph.align_streamed(source, anchor, out, mode=mode, rounds=None if rounds == "None" else int(rounds),
                            verify=verify == "True", fold=fold == "True", overwrite=True, device=device,
                            shard_bytes=parse_size(shard), progress=log)
open(stats, "w").write(json.dumps(r.to_json()))
"""


def _align(args, mode: str, floor: float | None) -> dict:
    stats_file = args.out.parent / f".{args.out.name}-{mode}-stats.json"
    print(f"== {mode}: {args.source} -> {args.anchor}", file=sys.stderr, flush=True)
    run = _stage([sys.executable, "-c", ALIGN, args.source, args.anchor, str(args.out), mode, str(args.rounds),
                  str(stats_file), str(args.fold), args.device, str(not args.no_verify), args.shard_size])
    stats = json.loads(stats_file.read_text())
    stats_file.unlink()
    shutil.rmtree(args.out, ignore_errors=True)
    timings = {k: round(v, 1) for k, v in stats["timings_s"].items()}
    solver = {}
    for s in stats["solves"]:
        solver[s["kind"]] = round(solver.get(s["kind"], 0.0) + s["seconds"], 1)
    out = {"folded": stats["folded"], "distance_before": stats["distance_before"],
           "distance_after": stats["distance_after"],
           "verified_relative_error": stats["verified_relative_error"],
           "verified_tolerance": stats["verified_tolerance"], "unsolved": stats["unsolved"],
           "solves": len(stats["solves"]), "timings_s": timings, "solver_s_by_kind": solver,
           "peak_rss_mb": run["peak_rss_mb"], "wall_with_python_start_s": run["seconds"]}
    if floor:
        out["over_floor"] = {k: round(v / floor, 2) for k, v in timings.items()}
        out["total_over_floor"] = round(run["seconds"] / floor, 2)
    return out


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else f"cpu ({device})"


def _key(args) -> str:
    return f"{Path(args.source).name}-{Path(args.anchor).name}"


def _store(args, result: dict) -> None:
    if args.json is None:
        return
    stored = json.loads(args.json.read_text()) if args.json.is_file() else {}
    stored[args.key or _key(args)] = result
    write_text_atomic(args.json, json.dumps(stored, indent=1) + "\n")


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
