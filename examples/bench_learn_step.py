"""Seconds of learned matching (direct method) in this tree against another source tree of symgraph (e.g. main),
in alternating runs on the same machine, so that both see the same load: the ratio is what a change to a learning
step is worth.

    mkdir /tmp/base && git archive main symgraph specs | tar -x -C /tmp/base && ln -s ../specs /tmp/base/symgraph/specs
    python examples/bench_learn_step.py --base /tmp/base --pairs vit-digits,llama-chars --steps 60 --rounds 3
    python examples/bench_learn_step.py --base /tmp/base --pairs untrained:vit-wide,untrained:llama-wide --steps 12

Each run is a fresh process (``symgraph.align`` with ``learn``, weight-matched start, learning on the pair's
training split, one thread, ``patience`` 0 where the tree has it, so both run every step); the base tree's runs
import symgraph from ``--base``, this tree's from the installed package. A pair is a shipped pair, a wide pair of
``examples/train_models.py`` (trained first if missing), or ``untrained:vit-wide`` / ``untrained:llama-wide``: two
seeds of a wide architecture, untrained (the time of a step does not depend on the weights; written to a temporary
folder). Prints one JSON object (and writes it to ``--json``): per pair, the learning seconds of every run, their
means, base / this, the end path loss of each tree (the same steps and seed: close, not equal, where the trees
learn differently) and the load average before and after. Measured: examples/results/bench_learn_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

UNTRAINED = "untrained:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the other source tree (symgraph/ and its specs)")
    parser.add_argument("--pairs", default="vit-digits,llama-chars", help="comma-separated pairs (see above)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checks", type=int, default=10, help="checks of the path loss (each costs float64 passes)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree, alternating")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    parser.add_argument("--one", nargs=4, metavar=("A", "B", "DATA", "STEPS_CHECKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_learn_once(*args.one)))
        return
    if not (args.base / "symgraph" / "specs").is_dir():
        parser.error(f"{args.base} has no symgraph/specs: link it (ln -s ../specs {args.base}/symgraph/specs)")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in args.pairs.split(","):
            a, b, data = _pair(pair, Path(scratch))
            runs.append(_compare(pair, a, b, data, args))
    out = json.dumps({"command": " ".join(sys.argv), "base": str(args.base.resolve()), "runs": runs}, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from symgraph.files import write_text_atomic  # late: symgraph is imported where it is used
        write_text_atomic(args.json, out)
    print(out)


def _compare(pair: str, a: str, b: str, data: str, args) -> dict:
    load_before = os.getloadavg()
    seen = {"base": [], "this": []}
    for _ in range(args.rounds):
        for tree in seen:
            seen[tree].append(_run(tree, a, b, data, args))
    means = {tree: mean(r["seconds"] for r in rs) for tree, rs in seen.items()}
    return {"pair": pair, "steps": args.steps, "checks": args.checks,
            "seconds": {tree: [r["seconds"] for r in rs] for tree, rs in seen.items()}, "mean_seconds": means,
            "base_over_this": means["base"] / means["this"],
            "end_path_loss": {tree: rs[0]["end_path_loss"] for tree, rs in seen.items()},
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def _run(tree: str, a: str, b: str, data: str, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if tree == "base":
        env["PYTHONPATH"] = str(args.base.resolve())
    else:
        env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, __file__, "--base", str(args.base), "--one", a, b, data,
                           f"{args.steps},{args.checks}"], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = args.base.resolve() if tree == "base" else Path(__file__).resolve().parents[1]
    if not Path(result["symgraph"]).is_relative_to(expected):
        raise SystemExit(f"the {tree} run imported symgraph from {result['symgraph']}, not from {expected}")
    return result


def _learn_once(a: str, b: str, data: str, steps_checks: str) -> dict:
    import torch

    import symgraph
    from symgraph.learn import LearnOptions

    torch.set_num_threads(1)
    steps, checks = (int(x) for x in steps_checks.split(","))
    stop_rule = {"patience": 0} if "patience" in LearnOptions.__dataclass_fields__ else {}
    learned = symgraph.align(b, a, learn=LearnOptions(steps=steps, checks=checks, **stop_rule), learn_data=data,
                             progress=None).learned
    return {"symgraph": symgraph.__file__, "steps": learned["steps"], "seconds": learned["seconds"],
            "end_path_loss": learned["end_path_loss"]}


def _pair(pair: str, scratch: Path) -> tuple[str, str, str]:
    """Folders A and B of ``pair`` and the dataset it learns on."""
    from symgraph.demo import SHIPPED_PAIRS, shipped_pair
    # examples/: the wide pairs are trained, not shipped
    from train_models import FOLDERS, WIDE_FAMILIES, WIDE_PAIRS, save, wide_pair

    if pair in SHIPPED_PAIRS:
        return *(str(p) for p in shipped_pair(pair)), SHIPPED_PAIRS[pair]
    if pair in WIDE_PAIRS:
        return *(str(p) for p in wide_pair(pair)), WIDE_PAIRS[pair]
    name = pair.removeprefix(UNTRAINED)
    if not pair.startswith(UNTRAINED) or name not in WIDE_FAMILIES:
        raise SystemExit(f"unknown pair {pair}: a shipped pair ({', '.join(SHIPPED_PAIRS)}), a wide pair "
                         f"({', '.join(WIDE_PAIRS)}) or {UNTRAINED}NAME for NAME in {', '.join(WIDE_FAMILIES)}")
    import torch

    family, folders = WIDE_FAMILIES[name], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folder = scratch / f"{FOLDERS[name]}-untrained-{seed}"
        save(family.build(), folder, char_tokenizer=family.kind == "llama")
        folders.append(str(folder))
    return folders[0], folders[1], family.data


if __name__ == "__main__":
    main()
