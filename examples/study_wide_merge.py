"""The wide ViT's learned merge, seed by seed: how the merged model (B aligned onto A, both folded, the alignment
learned at the midpoint as `merge --method simple --learn` does) scores on the test split at every check of
learning, against the loss on the batches learning checks.

    python examples/study_wide_merge.py                                   # seeds 0 and 1, default options
    python examples/study_wide_merge.py --seeds 0,1,2 --options '{"general_linear": false}'
    python examples/study_wide_merge.py --options '{"holdout": true, "eval_batches": 8}' --json out.json

Prints one JSON object (and writes it to ``--json``): the endpoints' test losses, their mean (issue 9's merge bar:
the merged loss within 1.20x of it) and the loss of their ensemble (mean probabilities: what a merge that computed
both models at once would score); per seed, every check (step, loss on the checked batches, test loss at the
midpoint and along the path) and the kept alignment's test loss at the midpoint with its ratio to the endpoints'
mean. The wide pair is trained by examples/train_models.py when it is not cached. Measured: examples/RESULTS.md
(the wide pairs' section) and examples/results/wide_merge_seeds.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace

import torch

import symgraph
import symgraph.learn
from symgraph.datasets import batch_logits, evaluate, load_data
from symgraph.files import write_text_atomic
from symgraph.learn import LearnOptions
# examples/: the wide pairs are trained, not shipped
from train_models import wide_pair

PAIR = "vit-digits-wide"


@torch.no_grad()
def ensemble_loss(models, data) -> float:
    """Cross-entropy of the models' mean predicted probabilities over ``data``."""
    total, count = 0.0, 0
    for batch in data.batches:
        p = torch.stack([torch.softmax(batch_logits(m.eval(), batch), -1) for m in models]).mean(0)
        total += float(torch.nn.functional.nll_loss(p.log(), batch.labels, reduction="sum"))
        count += len(batch.labels)
    return total / count


def learn_with_test_checks(a, b, options: LearnOptions, test) -> list[dict]:
    """Learn B's alignment onto A (full mode, folded, digits' training split) and score every checked candidate on
    ``test`` too: the candidate kept is the best checked, so its test loss is the one at its check."""
    checks, checked_better = [], symgraph.learn._Run.checked_better

    def scored(run, state, step):
        better = checked_better(run, state, step)
        checks.append({"step": step + 1, "checked_loss": run.record.checks[-1], "better": better,
                       "test_midpoint": run.loss_at.evaluate(state, test.batches, (0.5,)),
                       "test_path": run.loss_at.evaluate(state, test.batches)})
        return better

    symgraph.learn._Run.checked_better = scored
    try:
        result = symgraph.align(b, a, mode="full", fold=True, data="digits", learn=options, progress=False)
    finally:
        symgraph.learn._Run.checked_better = checked_better
    return checks, result.learned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1", help="comma-separated learning seeds (batch order and t)")
    parser.add_argument("--options", default="{}", help="LearnOptions fields as JSON (t defaults to 0.5)")
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    a, b = (symgraph.load(p) for p in wide_pair(PAIR))
    test = load_data("digits", model=a, split="test", batch_size=64)
    ends = [evaluate(s.model, test).loss for s in (a, b)]
    mean = sum(ends) / 2
    out = {"command": "python " + " ".join(sys.argv), "pair": PAIR, "endpoint_test_losses": ends,
           "mean_endpoint_loss": mean, "ensemble_test_loss": ensemble_loss([a.model, b.model], test), "runs": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        options = replace(LearnOptions(t=0.5), **json.loads(args.options), seed=seed)
        clock = time.perf_counter()
        checks, record = learn_with_test_checks(a, b, options, test)
        kept = [c for c in checks if c["better"]]
        midpoint = kept[-1]["test_midpoint"] if kept else None
        out["runs"].append({"seed": seed, "options": asdict(options), "checks": checks, "kept_test_midpoint": midpoint,
                            "ratio": None if midpoint is None else midpoint / mean, "stopped": record["stopped"],
                            "backtracks": len(record["backtracks"]), "seconds": time.perf_counter() - clock})
        print(f"seed {seed}: " + ("no check beat the start" if midpoint is None else
                                  f"merged test loss {midpoint:.4f} ({midpoint / mean:.2f}x)"), file=sys.stderr)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        write_text_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
