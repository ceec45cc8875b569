"""How a simple merge made without data should choose its frame: for each shipped pair, `symgraph.merge([A, B],
method="simple", align="full")` (folded where `merge` folds) with `--frame best`, and for every frame it tries
(onto either model, the common frame) the three scores a choice could use: the aligned models' weighted mean
distance to their mean (the rule before `symgraph.synthetic.merge_examples`), the merged model's loss on those 64
synthetic examples, and its loss on the pair's test split (what the choice is for). Prints one JSON object.
``--by-weights`` aligns by weights alone (``judge_starts=False``: the merge before it aligned as ``align`` does);
wide pairs come from examples/train_models.py; ``--test-limit N`` scores on the first N test examples.

    python examples/study_merge_frames.py                          # every shipped pair
    python examples/study_merge_frames.py --pairs vit-digits --json examples/results/merge_frames.json
    python examples/study_merge_frames.py --pairs vit-digits-wide --by-weights
    python examples/study_merge_frames.py --pairs llama-chars-wide --test-limit 64
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


def frames_scored(pair: str, judge_starts: bool = True, test_limit: int | None = None) -> dict:
    """Every frame the merge tried, with its three scores, and which frame each score would keep."""
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
        merged = symgraph.merge([a, b], method="simple", align="full", progress=False, judge_starts=judge_starts)
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
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"command": "python examples/study_merge_frames.py" + (
        f" --pairs {args.pairs}" if args.pairs != ",".join(SHIPPED_PAIRS) else "") + (
        " --by-weights" if args.by_weights else "") + (f" --test-limit {args.test_limit}" if args.test_limit else ""),
        "pairs": {pair: frames_scored(pair, not args.by_weights, args.test_limit) for pair in args.pairs.split(",")}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
