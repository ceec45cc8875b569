"""An independent soundness sweep over hand-written PyTorch models (examples/handwritten_zoo.py). Prints JSON.

Each model of the zoo gets noise on every parameter (no norm weight 1, no bias 0), is reported by symgraph from
its float32 example inputs (batch 2, length 7), and every reported group is checked with the sweep over
transformers' model types' own checker (examples/sweep_architectures.py: ``Checker`` and ``judged``): two random
elements per group and one of every group at once, outputs compared in float64 at batch 1 and 3, lengths 5, 11
and 19 (a padding mask where the model takes one), then ``symgraph.transform``. Classes as in that sweep
(``sound``, ``nothing``, ``unsound``, ``refused``, ``crash``, ``unsupported``, ``timeout``); ``missing`` lists
the motifs whose groups obviously exist (the zoo's ``expect``) but were not found.

Each model runs in its own subprocess with a time limit::

    python examples/sweep_handwritten.py -o examples/results/sweep_handwritten.json
    python examples/sweep_handwritten.py --models alibi,attention_sinks --jsonl /tmp/after.jsonl \\
        --before /tmp/before.jsonl -o examples/results/sweep_handwritten.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_architectures import (Checker, elapsed, first_line, judged, last_frame, perturb, report_summary,  # noqa: E402
                                 run_all, run_script_isolated)

TRACED = (2, 7)  # (batch, length) of the example inputs symgraph traces; the checker's shapes are other ones


def float64_inputs(entry):
    """The checker's ``inputs_at``: the zoo entry's inputs at one shape, floating tensors in float64."""

    def inputs_at(model, batch: int, length: int, pad: bool) -> dict:
        return {k: v.double() if v.is_floating_point() else v for k, v in entry.inputs(batch, length, pad).items()}

    return inputs_at


def sweep_one(name: str) -> dict:
    import torch

    import symgraph
    from handwritten_zoo import BY_NAME
    from symgraph.errors import SymgraphError

    entry = BY_NAME[name]
    row = {"model": name, "expect": sorted(entry.expect)}
    clock = time.perf_counter()
    torch.manual_seed(0)
    model = entry.build().eval()
    perturb(model)
    row["params"] = sum(p.numel() for p in model.parameters())
    checker = Checker(model, float64_inputs(entry))
    row["shapes"] = [f"{b}x{n}{' padded' if p else ''}" for b, n, p, _ in checker.inputs]
    row["rejected_shapes"] = checker.rejected
    if not checker.inputs:
        return {**row, "class": "skipped", "reason": "runs at no sweep shape: " + "; ".join(checker.rejected)}
    try:
        subject = symgraph.load(model, entry.inputs(*TRACED, False))
        subject.report
    except SymgraphError as exc:
        return {**row, "class": "unsupported", "reason": first_line(exc), "seconds": elapsed(clock)}
    except Exception as exc:  # noqa: BLE001
        return {**row, "class": "crash", "reason": first_line(exc), "where": last_frame(exc),
                "seconds": elapsed(clock)}
    row["report_seconds"] = elapsed(clock)
    row.update(judged(subject, checker, clock))
    found = {key.split("/")[0] for key in row["groups"]}
    row["missing"] = sorted(entry.expect - found)
    return row


def run_isolated(name: str, timeout: float) -> dict:
    return run_script_isolated(__file__, name, timeout, {"model": name})


def summarize(rows: list[dict]) -> dict:
    from sweep_architectures import SHAPES, checker_settings, largest_errors

    rows = sorted({r["model"]: r for r in rows}.values(), key=lambda r: r["model"])
    return {
        **checker_settings(), "traced_shape": "x".join(map(str, TRACED)),
        "checked_shapes": [f"{b}x{n}{' padded' if p else ''}" for b, n, p in SHAPES],
        "models": len(rows), "counts": dict(Counter(r["class"] for r in rows)),
        "sound_with_every_expected_motif": sum(r["class"] == "sound" and not r.get("missing") for r in rows),
        "unsound_groups": sum(len(r.get("bad_groups", [])) for r in rows),
        **largest_errors(rows, "model"),
        "table": {r["model"]: {"class": r["class"], "groups": r.get("groups", {}), "missing": r.get("missing", []),
                               "max_error": r.get("max_error"), **{k: r[k] for k in ("reason", "bad_groups", "where")
                                                                    if k in r}} for r in rows},
        "rows": rows,
    }


def main(argv=None) -> None:
    from handwritten_zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one model in this process and print its JSON line")
    parser.add_argument("--models", help="comma-separated zoo names (default: the whole zoo)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    parser.add_argument("--jsonl", type=Path, help="append one line per model here (accumulates across runs)")
    parser.add_argument("--before", type=Path, action="append", default=[],
                        help="rows of an earlier run (JSON lines): the summary then shows 'before' and, as "
                             "'after', those rows updated by this run's rows")
    parser.add_argument("-o", "--output", type=Path, help="also write the summary JSON here (atomically)")
    args = parser.parse_args(argv)
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(sweep_one(args.one)))
        return
    names = args.models.split(",") if args.models else [e.name for e in ZOO]
    rows = run_all(names, lambda name: run_isolated(name, args.timeout),
                   ("model", "class", "missing", "reason", "bad_groups", "seconds"), args.jsonl)
    report_summary(rows, summarize, "model", args.before, args.output)

if __name__ == "__main__":
    main()
