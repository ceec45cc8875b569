"""Which model types `symgraph fold` folds, and why the others are refused. Prints one JSON object.

For each model type of ``examples/sweep_architectures.py`` (its tiny config and noise, ``build``), the model is
loaded with the inputs symgraph makes from its config and folded (``symgraph.fold``, which checks the folded model
in float64 against the original before it returns); a fold refused because weights are tied is tried again with
``untie=True``. A row's class is ``ok``, ``ok_untied`` (folds once untied), ``refused`` (symgraph's own
:class:`symgraph.fold.FoldError`, with the first line of its reason), ``unsupported`` (another
:class:`symgraph.errors.SymgraphError`: the model cannot be captured), ``crash`` (any other exception) or
``skipped`` (transformers could not build the tiny model). The summary counts classes and groups refusals by what
stopped them (the text before the first graph-node detail). Each type runs in its own process with a time limit;
rows accumulate in ``--jsonl``::

    python examples/sweep_fold.py --jsonl fold.jsonl            # every type (about 15 minutes on 2 cores)
    python examples/sweep_fold.py --summarize --jsonl fold.jsonl -o examples/results/sweep_fold.json
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_architectures as sweep  # noqa: E402  (the model list and the tiny builds)


def fold_one(model_type: str, engine: bool = False) -> dict:
    """One row; with ``engine`` a model that folds is also analysed folded, and every group the engine reports on
    it is checked independently (``sweep_architectures.judged``: random elements, float64, every sweep shape)."""
    import symgraph
    from symgraph.errors import SymgraphError
    from symgraph.fold import FoldError, TiedFoldError, folded_subject

    row = {"type": model_type}
    clock = time.perf_counter()
    try:
        model, head = sweep.build(model_type)
    except Exception as exc:  # noqa: BLE001 -- transformers could not build the tiny model
        return {**row, "class": "skipped", "reason": sweep.first_line(exc)}
    row["head"] = head
    try:
        subject = symgraph.load(model)
        try:
            result, row["class"] = symgraph.fold(subject, untie=False), "ok"
        except TiedFoldError as exc:
            row["tied_reason"] = sweep.first_line(exc)
            result, row["class"] = symgraph.fold(subject, untie=True), "ok_untied"
        row.update(norms=len(result.norms), centred=len(result.centred), untied=result.untied,
                   verified_error=result.verified_error)
        if engine:
            folded = folded_subject(subject, untie=bool(result.untied))
            judged = sweep.judged(folded, sweep.Checker(folded.model), time.perf_counter())
            row["engine"] = {k: judged[k] for k in ("class", "groups", "max_error", "tolerance", "bad_groups",
                                                    "reason") if k in judged}
    except FoldError as exc:
        row.update({"class": "refused", "reason": sweep.first_line(exc)})
    except SymgraphError as exc:  # the model cannot be captured (torch.export), as the engine sweep says too
        row.update({"class": "unsupported", "reason": sweep.first_line(exc)})
    except Exception as exc:  # noqa: BLE001
        row.update({"class": "crash", "reason": sweep.first_line(exc), "where": sweep.last_frame(exc)})
    return {**row, "seconds": sweep.elapsed(clock)}


def why(reason: str) -> str:
    """What stopped a fold, without the names of the norm, node and module."""
    reason = re.sub(r"\(graph node [^)]*\)|\(tied: [^)]*\)|graph node \S+", "", reason)
    reason = re.sub(r"norm \S+|\b[\w.]+\.(weight|bias)\b|`[^`]*`", "X", reason)
    return re.sub(r"\s+", " ", reason).split(";")[0].strip()[:160]


def summarize(rows: list[dict]) -> dict:
    latest = {r["type"]: r for r in rows}
    counts = collections.Counter(r["class"] for r in latest.values())
    reasons = collections.Counter(why(r["reason"]) for r in latest.values() if r["class"] == "refused")
    return {"types": len(latest), "counts": dict(counts),
            "folded": sorted(t for t, r in latest.items() if r["class"] == "ok"),
            "folded_once_untied": sorted(t for t, r in latest.items() if r["class"] == "ok_untied"),
            "refusals": dict(reasons.most_common()),
            "unsupported": {t: r["reason"][:200] for t, r in latest.items() if r["class"] == "unsupported"},
            "crashes": {t: r["reason"] for t, r in latest.items() if r["class"] == "crash"},
            "largest_verified_error": max((r["verified_error"] for r in latest.values()
                                           if r.get("verified_error") is not None), default=None),
            **_engine_summary([r for r in latest.values() if "engine" in r])}


def _engine_summary(rows: list[dict]) -> dict:
    """With ``--engine``: the classes of the folded models' groups, the unsound ones, and the residual groups."""
    if not rows:
        return {}
    return {"engine_on_folded": dict(collections.Counter(r["engine"]["class"] for r in rows)),
            "engine_unsound": {r["type"]: r["engine"].get("bad_groups") for r in rows
                               if r["engine"]["class"] == "unsound"},
            "engine_residual_groups": dict(collections.Counter(
                group for r in rows for group in r["engine"].get("groups", {}) if group.startswith("residual"))),
            "engine_largest_error": max(r["engine"].get("max_error") or 0.0 for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="fold one type in this process and print its JSON line")
    parser.add_argument("--types", help="comma-separated model types (default: the sweep's whole list)")
    parser.add_argument("--skip-done", action="store_true", help="leave out types already in --jsonl")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per type")
    parser.add_argument("--jsonl", type=Path, help="append one line per type here")
    parser.add_argument("--engine", action="store_true",
                        help="also check the engine's groups on every folded model (minutes more)")
    parser.add_argument("--summarize", action="store_true", help="only summarize --jsonl")
    parser.add_argument("-o", "--output", type=Path, help="also write the summary JSON here (atomically)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(fold_one(args.one, args.engine)))
        return
    done = [json.loads(ln) for ln in args.jsonl.read_text().splitlines()] if args.jsonl and \
        args.jsonl.exists() else []
    if not args.summarize:
        names = args.types.split(",") if args.types else list(sweep.TYPES)
        if args.skip_done:
            names = [n for n in names if n not in {r["type"] for r in done}]
        options = ("--engine",) if args.engine else ()
        done += sweep.run_all(names, lambda n: sweep.run_script_isolated(__file__, n, args.timeout, {"type": n},
                                                                         options),
                              ("type", "class", "reason"), args.jsonl)
    sweep.report_summary(done, summarize, "type", [], args.output)


if __name__ == "__main__":
    main()
