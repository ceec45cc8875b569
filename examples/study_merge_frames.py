"""How a merge should choose its frame: for each shipped pair, `symgraph.merge([A, B], method="simple",
align="full")` (folded where `merge` folds; `--method fisher` or `regmean` for those) with `--frame best`, and for
every frame it tries (onto either model, the common frame; with data each also aligned by weights alone) the three
scores a choice could use: the aligned models' weighted mean distance to their mean (the rule before
`symgraph.synthetic.merge_examples`), the merged model's loss on those 64 synthetic examples (with `--method fisher`
or `regmean`: on their 256 training examples), and its loss on the pair's test split (what the choice is for).
Prints one JSON object.
``--by-weights`` aligns by weights alone (``judge_starts=False``: the merge before it aligned as ``align`` does);
wide pairs come from examples/train_models.py; ``--test-limit N`` scores on the first N test examples.

    python examples/study_merge_frames.py                          # every shipped pair
    python examples/study_merge_frames.py --pairs vit-digits --json examples/results/merge_frames.json
    python examples/study_merge_frames.py --pairs vit-digits-wide --by-weights
    python examples/study_merge_frames.py --pairs llama-chars-wide --test-limit 64
    python examples/study_merge_frames.py --method regmean --json examples/results/merge_frames_regmean.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import symgraph
import symgraph.merging
from symgraph.datasets import evaluate, load_data
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.files import write_text_atomic
from train_models import WIDE_PAIRS, wide_pair

PAIRS = {**SHIPPED_PAIRS, **WIDE_PAIRS}


def frames_scored(pair: str, judge_starts: bool = True, test_limit: int | None = None, method: str = "simple",
                  stats_limit: int = 256) -> dict:
    """Every frame the merge tried, with its three scores, and which frame each score would keep. Fisher and
    RegMean merges take their statistics from the first ``stats_limit`` training examples (batches of 64), which
    also score the frames (their "synthetic" score is then the merged loss on those)."""
    rows, original, test = {}, symgraph.merging._frame_score, []

    def scored(state, subjects, consensus, w, datasets, head_from, learned):
        score = original(state, subjects, consensus, w, datasets, head_from, learned)  # datasets: the synthetic
        model = symgraph.merging._model_with(subjects[consensus.reference], state)
        if not test:
            test.append(load_data(PAIRS[pair], model=model, batch_size=32, split="test",
                                  limit=test_limit))
        rows[len(rows)] = {"distance": float(np.dot(consensus.distances, w) / np.sum(w)),
                           "synthetic": evaluate(model, datasets[0]).loss if datasets else None,
                           "test": evaluate(model, test[0]).loss, "score": score}
        return score

    symgraph.merging._frame_score = scored
    try:
        a, b = (str(p) for p in (wide_pair(pair) if pair in WIDE_PAIRS else shipped_pair(pair)))
        clock = time.perf_counter()
        data = None if method == "simple" else load_data(PAIRS[pair], model=a, split="train", limit=stats_limit,
                                                          batch_size=64)  # as examples/paper_experiments.py
        merged = symgraph.merge([a, b], method=method, align="full", data=data, progress=False,
                                judge_starts=judge_starts)
    finally:
        symgraph.merging._frame_score = original
    frames = {label: rows[i] for i, label in enumerate(merged.frames)}
    kept_by = {what: min(frames, key=lambda f: frames[f][what]) for what in ("distance", "synthetic", "test")}
    return {"frames": frames, "kept_by": kept_by, "kept": merged.frame, "frame_note": merged.frame_note,
            "alignments": merged.alignments, "seconds": time.perf_counter() - clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS), help="comma-separated shipped pairs")
    parser.add_argument("--by-weights", action="store_true", help="first alignments by weights alone")
    parser.add_argument("--test-limit", type=int, help="score on the first N test examples (default: all)")
    parser.add_argument("--method", default="simple", choices=("simple", "fisher", "regmean"),
                        help="merge method; fisher and regmean on the first 256 training examples")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = [f"--pairs {args.pairs}"] if args.pairs != ",".join(SHIPPED_PAIRS) else []
    options += ["--by-weights"] if args.by_weights else []
    options += [f"--test-limit {args.test_limit}"] if args.test_limit else []
    options += [f"--method {args.method}"] if args.method != "simple" else []
    result = {"command": " ".join(["python examples/study_merge_frames.py", *options]),
              "pairs": {pair: frames_scored(pair, not args.by_weights, args.test_limit, args.method)
                        for pair in args.pairs.split(",")}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
