"""Does norm folding pay off? Loss barriers on the shipped pairs with and without ``--fold``; prints one JSON object.

For each shipped pair (model A, model B, its test data) ``symgraph.barrier`` runs once on the models as trained and
once on their folded forms (:func:`symgraph.fold`), for the modes ``none``, ``permutation``, ``paper`` and
``full``, and ``full`` with QK/VO aligned in GL(d_head) (``general_linear``). A pair
whose norms cannot be folded (post-LN BERT) records the refusal instead. The numbers decide the default of
``--fold`` (see ``symgraph/fold.py``, :func:`symgraph.fold.pays_off`), so rerun this after changing the aligner.

Options: ``--pairs`` (comma-separated, default all three), ``--limit N`` test examples (default: the whole test
split), ``--steps`` points on the path (default 21), ``--out FILE`` also writes the JSON there (atomically).
Progress goes to stderr; stdout carries exactly one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import symgraph
from symgraph.fold import FoldError

MODELS = Path(symgraph.__file__).parent / "data" / "models"
PAIRS = {"llama-chars": "pydoc-chars", "vit-digits": "digits", "bert-topics": "pydoc-topics"}
MODES = ("none", "permutation", "paper", "full")


def measure(pair: str, data: str, fold: bool, steps: int, limit: int | None) -> dict:
    clock = time.perf_counter()
    a, b = MODELS / f"{pair}-a", MODELS / f"{pair}-b"
    try:
        result = symgraph.barrier(a, b, data, steps=steps, aligns=MODES, limit=limit, fold=fold, progress=False)
    except FoldError as exc:
        return {"refused": exc.message}
    curves = dict(result.curves)
    wide = symgraph.barrier(a, b, data, steps=steps, aligns=("full",), limit=limit, fold=fold, progress=False,
                            align_options={"general_linear": True})
    curves["full+general_linear"] = wide.curves["full"]
    return {"seconds": round(time.perf_counter() - clock, 1),
            **{mode: {"loss_barrier": round(c.loss_barrier, 4), "distance": round(c.distance, 4),
                      "align_seconds": round(c.align_seconds, 1)} for mode, c in curves.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--limit", type=int)
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = {"steps": args.steps, "limit": args.limit, "torch_threads": 1, "pairs": {}}
    for pair in args.pairs.split(","):
        out["pairs"][pair] = {}
        for fold in (False, True):
            print(f"{pair} fold={fold} ...", file=sys.stderr, flush=True)
            out["pairs"][pair]["folded" if fold else "as_trained"] = measure(pair, PAIRS[pair], fold, args.steps,
                                                                             args.limit)
    text = json.dumps(out, indent=1)
    if args.out is not None:
        from symgraph.io import write_text_atomic

        write_text_atomic(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
