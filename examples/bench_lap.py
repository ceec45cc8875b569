"""Exact linear-assignment (LAP) solvers at FFN widths: seconds per solve and a check of the optimal value; prints JSON.

The permutation solver (:func:`symgraph.solve.kernels.hungarian`) maximises a similarity ``S[anchor, source]``.
This script times every exact solver that installs here as a wheel against ``scipy.optimize.linear_sum_assignment``
on the same float64 matrices, and checks that each reaches scipy's optimal value (relative difference <= 1e-12;
different sums of the same optimum differ only in rounding).

Matrix kinds (``--kinds``):

``gaussian``     i.i.d. standard normal similarities (dense random).
``correlation``  ``S = A B^T / k`` with independent Gaussian ``A, B`` of shape ``(n, k)``, ``k = 1024``: the
                 shape of a weight-matching similarity between two independently initialised FFNs (rank k, no
                 planted answer; the hard case the coordinate descent meets in its first sweep).

Solvers (``--solvers``), each skipped with a note when its package is missing:
``scipy`` (scipy), ``lapx.lapjv`` / ``lapx.lapjvx`` / ``lapx.lapjvc`` (PyPI ``lapx``, module ``lap``; PyPI ``lap``
installs the same module with the same ``lapjv``), ``lapjv`` (PyPI ``lapjv``), ``fastlap`` (PyPI ``fastlap``).

To keep a run within minutes, a solver other than scipy runs at a width only if it beat scipy at the previous
width of the same kind (the row says ``pruned``), and no solver runs where the cube-law extrapolation of its
previous width exceeds ``--budget`` seconds (``skipped``, with the extrapolated time). Widths above 8192 run once
(``--repeats`` applies below). Run with ``OMP_NUM_THREADS=1`` for steadier figures on a shared machine.

Examples::

    OMP_NUM_THREADS=1 python examples/bench_lap.py --widths 1024 2048          # smoke run, seconds
    OMP_NUM_THREADS=1 python examples/bench_lap.py --out lap.json              # 4096 .. 14336, a few minutes
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time

import numpy as np

from symgraph.files import write_text_atomic

WIDTHS = (4096, 8192, 11008, 14336)
RANK = 1024
TOLERANCE = 1e-12


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- matrices ---------------------------------------------------------------------------------------------------
def similarity(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal((n, n))
    if kind == "correlation":
        a, b = rng.standard_normal((n, RANK)), rng.standard_normal((n, RANK))
        return a @ b.T / RANK
    raise SystemExit(f"unknown matrix kind {kind!r}; choose from gaussian, correlation")


# -- solvers: each maps a similarity to perm with row i assigned to column perm[i], maximising the sum -----------
def _scipy(s):
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(s, maximize=True)[1]


def _lapx(function):
    def solve(s):
        lap = importlib.import_module("lap")
        if function == "lapjv":
            return lap.lapjv(-s, return_cost=False)[0]
        rows, cols = getattr(lap, function)(-s, return_cost=False)
        perm = np.empty(len(rows), dtype=np.int64)
        perm[rows] = cols
        return perm
    return solve


def _lapjv(s):
    return importlib.import_module("lapjv").lapjv(-s)[0]


def _fastlap(s):
    return importlib.import_module("fastlap").linear_sum_assignment(s, maximize=True)[1]


SOLVERS = {"scipy": ("scipy", _scipy), "lapx.lapjv": ("lap", _lapx("lapjv")), "lapx.lapjvx": ("lap", _lapx("lapjvx")),
           "lapx.lapjvc": ("lap", _lapx("lapjvc")), "lapjv": ("lapjv", _lapjv), "fastlap": ("fastlap", _fastlap)}


def package_version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except ImportError:
        return None


def assignment_value(s: np.ndarray, perm: np.ndarray) -> float:
    perm = np.asarray(perm, dtype=np.int64)
    if np.unique(perm).size != s.shape[0]:
        return float("nan")  # not a permutation
    return float(s[np.arange(s.shape[0]), perm].sum())


def time_solver(solve, s: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    best, perm = float("inf"), None
    for _ in range(repeats):
        clock = time.perf_counter()
        perm = np.asarray(solve(s))
        best = min(best, time.perf_counter() - clock)
    return best, perm


def run(widths, kinds, solvers, repeats: int, budget: float, seed: int) -> list[dict]:
    rows, last, dropped = [], {}, set()
    for kind in kinds:
        last.clear()
        dropped.clear()
        for n in widths:
            s = similarity(kind, n, seed)
            reference = None
            for name in solvers:
                row = {"kind": kind, "width": n, "solver": name}
                if name in dropped:
                    rows.append({**row, "status": "pruned"})
                    log(f"{kind} n={n} {name}: pruned (slower than scipy at a smaller width)")
                    continue
                previous = last.get(name)
                predicted = previous[1] * (n / previous[0]) ** 3 if previous else 0.0
                if predicted > budget:
                    rows.append({**row, "status": "skipped", "extrapolated_seconds": round(predicted, 1)})
                    log(f"{kind} n={n} {name}: skipped (~{predicted:.0f} s)")
                    continue
                seconds, perm = time_solver(SOLVERS[name][1], s, repeats if n <= 8192 else 1)
                value = assignment_value(s, perm)
                reference = value if name == "scipy" else reference
                last[name] = (n, seconds)
                rows.append({**row, "status": "ok", "seconds": round(seconds, 3), "optimal_value": value,
                             "same_optimum_as_scipy": None if reference is None else
                             bool(abs(value - reference) <= TOLERANCE * abs(reference))})
                log(f"{kind} n={n} {name}: {seconds:.2f} s  value {value:.6f}")
            scipy_seconds = last.get("scipy", (None, 0.0))
            dropped.update(name for name, (width, seconds) in last.items()
                           if width == n == scipy_seconds[0] and seconds >= scipy_seconds[1] and name != "scipy")
            del s
    return rows


def speedups(rows: list[dict]) -> list[dict]:
    """Each solver's speed-up over scipy where both ran on the same matrix."""
    scipy_seconds = {(r["kind"], r["width"]): r["seconds"] for r in rows
                     if r["solver"] == "scipy" and r["status"] == "ok"}
    return [{"kind": r["kind"], "width": r["width"], "solver": r["solver"],
             "speedup_over_scipy": round(scipy_seconds[(r["kind"], r["width"])] / r["seconds"], 2)}
            for r in rows if r["status"] == "ok" and r["solver"] != "scipy"
            and (r["kind"], r["width"]) in scipy_seconds and r["seconds"] > 0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--kinds", nargs="+", default=["gaussian", "correlation"])
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=list(SOLVERS))
    parser.add_argument("--repeats", type=int, default=2, help="best of this many solves at widths <= 8192")
    parser.add_argument("--budget", type=float, default=150.0, help="skip a solve extrapolated to take longer (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if "scipy" in args.solvers:  # the reference optimum comes first
        args.solvers = ["scipy"] + [s for s in args.solvers if s != "scipy"]
    missing = {name: SOLVERS[name][0] for name in args.solvers if package_version(SOLVERS[name][0]) is None}
    solvers = [name for name in args.solvers if name not in missing]
    clock = time.perf_counter()
    rows = run(sorted(args.widths), args.kinds, solvers, args.repeats, args.budget, args.seed)
    result = {"machine": {"python": platform.python_version(), "processor": platform.machine()},
              "packages": {module: package_version(module) for module in {SOLVERS[n][0] for n in args.solvers}},
              "missing": {name: f"module {module!r} not installed" for name, module in missing.items()},
              "rows": rows, "speedups": speedups(rows), "total_seconds": round(time.perf_counter() - clock, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        write_text_atomic(args.out, text + "\n")


if __name__ == "__main__":
    main()
