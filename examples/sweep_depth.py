"""The repeated-block fast path (symgraph.depth) against the full-depth analysis, over Hugging Face model types.

The sweeps' tiny models (``sweep_architectures.tiny_config``) have 2 layers, too few for the fast path. Here each
type is built with ``--depth`` layers (6 by default; per-layer config lists repeated to that length) and reported
twice: as ``symgraph report`` does (a shallow copy analysed and replicated where the blocks repeat) and with
``full_depth=True``. A row is ``same`` when both reports are equal (groups, ids, notes, pins, parameters),
``differs`` otherwise (a replication bug: the full-depth report is the reference), ``error`` when either raised,
``skipped`` when transformers cannot build the type at that depth; ``fast_path`` says whether the shallow copy was
used and ``why_not`` the reason it was not. Prints one JSON object; rows accumulate in ``--jsonl``::

    python examples/sweep_depth.py --types llama,t5 --jsonl /tmp/depth.jsonl
    python examples/sweep_depth.py --jsonl /tmp/depth.jsonl              # every type of sweep_pipeline's list
    python examples/sweep_depth.py --summarize --jsonl /tmp/depth.jsonl -o examples/results/sweep_depth.json
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_architectures import build, report_summary, run_all, run_script_isolated, tiny_config  # noqa: E402
from sweep_pipeline import OVERRIDES  # noqa: E402

STREAM_SWEEP = Path(__file__).resolve().parent / "results" / "sweep_pipeline_stream.json"  # the list of types


def deep_overrides(model_type: str, depth: int) -> dict:
    """The sweep's overrides with ``depth`` layers, and every per-layer config list repeated to that length."""
    base = dict(OVERRIDES.get(model_type, {}))
    config = tiny_config(model_type, base)
    layers = getattr(config, "num_hidden_layers", None)
    out = {**base, "num_hidden_layers": depth}
    for key, value in config.to_dict().items():
        if isinstance(value, list) and layers and len(value) == layers and key != "architectures":
            out[key] = [value[i % layers] for i in range(depth)]
    return out


def sweep_one(model_type: str, depth: int) -> dict:
    import symgraph
    from symgraph import depth as depth_module

    row = {"type": model_type, "depth": depth}
    try:
        model, _ = build(model_type, deep_overrides(model_type, depth))
    except Exception as exc:  # noqa: BLE001 -- transformers cannot build this type at this depth
        return {**row, "class": "skipped", "reason": f"{type(exc).__name__}: {str(exc)[:200]}"}
    reasons = []
    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(record.getMessage())
    depth_module.log.addHandler(handler)
    depth_module.log.setLevel(logging.INFO)
    try:
        clock = time.perf_counter()
        fast = symgraph.load(model).report.to_json()
        row["fast_s"] = round(time.perf_counter() - clock, 2)
        why = [r for r in reasons if r.startswith("analysing the full depth")]
        row["fast_path"], row["why_not"] = not why, (why[-1][:300] if why else "")
        clock = time.perf_counter()
        full = symgraph.load(model, full_depth=True).report.to_json()
        row["full_s"] = round(time.perf_counter() - clock, 2)
    except Exception as exc:  # noqa: BLE001 -- recorded; the sweep goes on
        return {**row, "class": "error", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    row["class"] = "same" if fast == full else "differs"
    if fast != full:
        ours, theirs = {g["id"] for g in fast["groups"]}, {g["id"] for g in full["groups"]}
        row["only_fast"], row["only_full"] = sorted(ours - theirs)[:10], sorted(theirs - ours)[:10]
    return row


def summarize(rows: list[dict]) -> dict:
    rows = list({r["type"]: r for r in rows}.values())
    compared = [r for r in rows if r["class"] in ("same", "differs")]
    why_not = Counter(r["why_not"].split(": ", 1)[-1].split(" (")[0][:80] for r in compared if not r["fast_path"])
    return {"types": len(rows), "counts": dict(Counter(r["class"] for r in rows)),
            "fast_path": sum(r["fast_path"] for r in compared), "why_not_fast": dict(why_not.most_common()),
            "failures": {r["type"]: r for r in rows if r["class"] in ("differs", "error")},
            "rows": sorted(rows, key=lambda r: r["type"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type of the stream sweep)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--jsonl", type=Path, help="append each row here")
    parser.add_argument("--summarize", action="store_true", help="summarize --jsonl instead of running")
    parser.add_argument("-o", "--output", type=Path, help="write the summary here too")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(sweep_one(args.one, args.depth)))
        return
    if args.summarize:
        rows = [json.loads(line) for line in args.jsonl.read_text().splitlines()]
        report_summary(rows, summarize, "type", [], args.output)
        return
    types = args.types.split(",") if args.types else \
        [r["name"].split("+")[0] for r in json.loads(STREAM_SWEEP.read_text())["rows"]]

    def run(model_type: str) -> dict:
        return run_script_isolated(__file__, model_type, args.timeout, {"type": model_type, "depth": args.depth},
                                   ("--depth", str(args.depth)))

    rows = run_all(types, run, ("type", "class", "fast_path"), args.jsonl)
    report_summary(rows, summarize, "type", [], args.output)


if __name__ == "__main__":
    main()
