"""Where a loss barrier comes from: the midpoint loss when only one family of parameters is mixed; prints JSON.

B is aligned to A (``--mode``, folded where ``barrier`` folds); then, for each family of parameters (the
embeddings, each layer's attention, MLP and norms, the head), the loss on the test split is measured at
``t = 0.5`` with only that family mixed (every other parameter A's) and with every family but that one mixed.
A family whose mixing alone raises the loss most is where alignment failed.

    python examples/barrier_sources.py vit-digits --mode full
    python examples/barrier_sources.py vit-digits --mode full --split vit.layers.0   # one layer, per parameter
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys

import torch

import symgraph
from symgraph.datasets import evaluate, load_data
from symgraph.fold import folded_subject, pays_off
from paper_experiments import PAIRS, WIDE_PAIRS, shipped_pair, wide_pair  # examples/

HEADS = ("classifier", "lm_head", "score")


def family(name: str, split: str | None) -> str:
    """The family of a parameter: ``L<i>.attn|mlp|norm`` inside layer i, else ``embed`` or ``head``; under
    ``split``, the parameter's own module."""
    if split and name.startswith(split):
        return name.rsplit(".", 1)[0]
    layer = re.search(r"\.(\d+)\.", name)
    if layer is None:
        return "head" if name.startswith(HEADS) or re.search(r"(^|\.)(norm|layernorm|pooler)\.", name) else "embed"
    part = "norm" if re.search(r"norm", name, re.I) else "attn" if re.search(r"attn|attention", name) else "mlp"
    return f"L{layer.group(1)}.{part}"


def midpoint_loss(model, a: dict, b: dict, data, mixed) -> float:
    state = {k: (0.5 * (v.double() + b[k].double())).to(v.dtype) if v.is_floating_point() and mixed(k) else v
             for k, v in a.items()}
    model.load_state_dict(state)
    return evaluate(model, data).loss


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", choices=sorted(PAIRS))
    parser.add_argument("--mode", default="full", choices=("none", "permutation", "paper", "full"))
    parser.add_argument("--split", help="a parameter-name prefix whose parameters are mixed one module at a time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    a, b = (symgraph.load(f) for f in (wide_pair if args.pair in WIDE_PAIRS else shipped_pair)(args.pair))
    data = load_data(PAIRS[args.pair], model=a, split="test", batch_size=64)
    fold = pays_off(a)
    anchor = folded_subject(a) if fold else a
    other = (folded_subject(b) if fold else b).state_dict() if args.mode == "none" else \
        symgraph.align(b, a, mode=args.mode, fold=fold).state
    state, model = anchor.state_dict(), copy.deepcopy(anchor.model)
    base = evaluate(anchor.model, data).loss
    families = sorted({family(k, args.split) for k, v in state.items() if v.is_floating_point()})
    rows = {f: {"only_mixed": midpoint_loss(model, state, other, data, lambda k: family(k, args.split) == f) - base,
                "all_but": midpoint_loss(model, state, other, data, lambda k: family(k, args.split) != f) - base}
            for f in families}
    print(json.dumps({"pair": args.pair, "mode": args.mode, "folded": fold, "loss_A": base,
                      "all_mixed": midpoint_loss(model, state, other, data, lambda k: True) - base,
                      "families": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
