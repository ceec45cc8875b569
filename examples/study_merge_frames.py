"""How a simple merge made without data should choose its frame: for each shipped pair, `symgraph.merge([A, B],
method="simple", align="full")` (folded where `merge` folds) with `--frame best`, and for every frame it tries
(onto either model, the common frame) the three scores a choice could use: the aligned models' weighted mean
distance to their mean (the rule before `symgraph.synthetic.merge_examples`), the merged model's loss on those 64
synthetic examples, and its loss on the pair's test split (what the choice is for). Prints one JSON object.

    python examples/study_merge_frames.py                          # every shipped pair
    python examples/study_merge_frames.py --pairs vit-digits --json examples/results/merge_frames.json
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


def frames_scored(pair: str) -> dict:
    """Every frame the merge tried, with its three scores, and which frame each score would keep."""
    rows, original, test = {}, symgraph.merging._frame_score, []

    def scored(state, subjects, consensus, w, datasets, head_from, learned):
        score = original(state, subjects, consensus, w, datasets, head_from, learned)  # datasets: the synthetic
        model = symgraph.merging._model_with(subjects[consensus.reference], state)
        if not test:
            test.append(load_data(SHIPPED_PAIRS[pair], model=model, batch_size=32, split="test"))
        rows[len(rows)] = {"distance": float(np.dot(consensus.distances, w) / np.sum(w)),
                           "synthetic": evaluate(model, datasets[0]).loss if datasets else None,
                           "test": evaluate(model, test[0]).loss, "score": score}
        return score

    symgraph.merging._frame_score = scored
    try:
        a, b = (str(p) for p in shipped_pair(pair))
        clock = time.perf_counter()
        merged = symgraph.merge([a, b], method="simple", align="full", progress=False)
    finally:
        symgraph.merging._frame_score = original
    frames = {label: rows[i] for i, label in enumerate(merged.frames)}
    kept_by = {what: min(frames, key=lambda f: frames[f][what]) for what in ("distance", "synthetic", "test")}
    return {"frames": frames, "kept_by": kept_by, "kept": merged.frame, "frame_note": merged.frame_note,
            "seconds": time.perf_counter() - clock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(SHIPPED_PAIRS), help="comma-separated shipped pairs")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"command": "python examples/study_merge_frames.py" + (
        f" --pairs {args.pairs}" if args.pairs != ",".join(SHIPPED_PAIRS) else ""),
        "pairs": {pair: frames_scored(pair) for pair in args.pairs.split(",")}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
