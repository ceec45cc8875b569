"""What checking at several input shapes costs: the float64 check and the fuzz of tiny zoo models, with the probe
variants (``symgraph.probes``: the traced shape, a grown and a shrunk one, lengths 1 and 2) and without them (the
traced shape only), back to back in one process. Prints one JSON object to stdout.

Per family: ``probes`` (the shapes checked), ``check_ms`` (one ``Evaluator.check`` of a transformed state, best
of ``--repeats``), ``setup_s`` (building the evaluator: the float64 copy, and with probes, the forward passes that
find which shape changes the model accepts) and ``fuzz_s`` (``check_group`` over every group with ``--samples``
examples). ``ratio`` is every shape over one. Timings depend on the machine and its load; compare only figures
from the same run::

    python examples/bench_verify.py --families bert,llama --samples 10
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import symgraph
from symgraph import zoo
from symgraph.elements import apply
from symgraph.fuzz import check_group
from symgraph.probes import shape_summary
from symgraph.verify import Evaluator


def measure(family: str, shapes: bool, samples: int, repeats: int) -> dict:
    model = zoo.build(family)
    subject = symgraph.load(model, zoo.example_inputs_for(family, model))
    groups = subject.report.groups
    clock = time.perf_counter()
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs, shapes=shapes)
    setup = time.perf_counter() - clock
    moved = apply(evaluator.state, symgraph.sample_elements(subject.report, seed=0))
    checks = []
    for _ in range(repeats):
        clock = time.perf_counter()
        ok = evaluator.check(moved).ok
        checks.append(time.perf_counter() - clock)
    clock = time.perf_counter()
    verdicts = [check_group(evaluator, evaluator.state, g, samples=samples, seed=i) for i, g in enumerate(groups)]
    return {"probes": [shape_summary(p) for p in evaluator.probes], "setup_s": round(setup, 3),
            "check_ms": round(1000 * min(checks), 2), "fuzz_s": round(time.perf_counter() - clock, 2),
            "groups": len(groups), "all_invariant": ok and all(v.ok for v in verdicts)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="bert,gpt2,llama,t5,vit")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args(argv)
    out = {}
    for family in options.families.split(","):
        print(f"{family} ...", file=sys.stderr)
        one = measure(family, False, options.samples, options.repeats)
        every = measure(family, True, options.samples, options.repeats)
        out[family] = {"one_shape": one, "every_shape": every,
                       "ratio": {k: round(every[k] / max(one[k], 1e-9), 2) for k in ("check_ms", "fuzz_s")}}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
