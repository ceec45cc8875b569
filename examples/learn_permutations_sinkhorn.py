"""Permutations learned by the loss (a remedy tried for issue 9, not a mode): a shipped pair folded and aligned by
``full+learn`` (as ``barrier --align full+learn`` does: the direct method moves every continuous group, never a
permutation), then the permutation groups of the kinds named (``ffn``, ``heads``) learned on the interpolated loss
through a Sinkhorn relaxation: each group's permutation becomes a doubly stochastic matrix ``sinkhorn(L / tau)`` of
learned logits ``L`` (starting at ``init * I``: the start's permutation), applied to its members as a permutation
would be, and Adam moves ``L`` on the loss of ``(1 - t) A + t B''`` at a random ``t`` each step on the training
split. The result is rounded to the nearest permutation (Hungarian method), which moves B' within its orbit, so it
computes what B computes (checked: the test loss at t = 1). Prints the loss barriers (test split, 11 points) before
and after, and how many units each group moved, as one JSON object.

    python examples/learn_permutations_sinkhorn.py llama-chars --steps 300 --lr 0.5 --init 5
    python examples/learn_permutations_sinkhorn.py llama-chars --steps 300 --lr 1.0 --init 10 --kinds ffn,heads
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

import symgraph
from symgraph.alignment import check_same_architecture
from symgraph.api import folded_pair, load
from symgraph.connectivity import _Path, barrier_height
from symgraph.consensus import shared_float_names
from symgraph.datasets import load_data
from symgraph.demo import SHIPPED_PAIRS, shipped_pair
from symgraph.learn import LearnOptions, _InterpolatedLoss, training_data


def sinkhorn(logits: torch.Tensor, tau: float, iterations: int = 30) -> torch.Tensor:
    """The doubly stochastic matrix of ``logits / tau`` (log-domain row and column normalisation)."""
    x = logits / tau
    for _ in range(iterations):
        x = x - torch.logsumexp(x, dim=1, keepdim=True)
        x = x - torch.logsumexp(x, dim=0, keepdim=True)
    return x.exp()


def mixed(state: dict, groups, matrices) -> dict:
    """``state`` with each group's coordinates mixed by its matrix (row i of the result takes row j with weight
    P[i, j]); a permutation matrix gives the permuted state, which computes the same function."""
    state = dict(state)
    for group, matrix in zip(groups, matrices):
        for member in group.members:
            index = torch.as_tensor(member.index[0].reshape(group.size, -1))  # (size, block): one copy
            moved = state[member.param].movedim(member.axis, 0)
            rows = moved[index.reshape(-1)].reshape(group.size, index.shape[1], *moved.shape[1:])
            out = moved.clone()
            out[index.reshape(-1)] = torch.einsum("ij,jb...->ib...", matrix.to(rows.dtype), rows).reshape(
                -1, *moved.shape[1:])
            state[member.param] = out.movedim(0, member.axis)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair", choices=tuple(SHIPPED_PAIRS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tau", type=float, default=1.0)
    parser.add_argument("--init", type=float, default=5.0, help="the logits start at init * I")
    parser.add_argument("--kinds", default="ffn", help="comma-separated group id prefixes (ffn, heads)")
    args = parser.parse_args()
    torch.manual_seed(0)
    clock = time.perf_counter()
    a, b = (str(p) for p in shipped_pair(args.pair))
    source, anchor, _, _ = folded_pair(load(b, None), load(a, None), True, check_same_architecture)
    spec = SHIPPED_PAIRS[args.pair]
    start = symgraph.align(source, anchor, learn=LearnOptions(), learn_data=spec, progress=False).state
    anchor_state = anchor.state_dict()
    ts = [i / 10 for i in range(11)]
    path = _Path(anchor, load_data(spec, model=anchor, split="test"), ts, False)

    def barrier(state) -> tuple[float, list[float]]:
        losses = [m.loss for m in path.metrics(state, "")]
        return barrier_height(ts, losses), losses

    kinds = set(args.kinds.split(","))
    groups = [g for g in anchor.report.groups
              if g.kind == "permutation" and g.id.split(":")[0] in kinds and g.copies == 1]
    data = training_data(spec, source, LearnOptions(), (start, anchor_state))
    loss_at = _InterpolatedLoss(anchor.model, anchor_state, shared_float_names(anchor_state, frozenset()), data.task)
    start32 = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in start.items()}
    logits = [(args.init * torch.eye(g.size)).requires_grad_(True) for g in groups]
    optimiser = torch.optim.Adam(logits, lr=args.lr)
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        t, batch = float(rng.uniform()), data.batches[int(rng.integers(len(data.batches)))]
        loss = loss_at(mixed(start32, groups, [sinkhorn(x, args.tau) for x in logits]), t, batch)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    rounded = [linear_sum_assignment(-sinkhorn(x, args.tau).detach().numpy())[1] for x in logits]
    final = mixed(start, groups, [torch.eye(g.size, dtype=torch.float64)[torch.as_tensor(r)]
                                  for g, r in zip(groups, rounded)])
    before, after = barrier(start), barrier(final)
    print(json.dumps({"pair": args.pair, "options": vars(args), "groups": [g.id for g in groups],
                      "units_moved": [int((r != np.arange(len(r))).sum()) for r in rounded],
                      "barrier_before": before[0], "barrier_after": after[0],
                      "loss_at_t1_before_after": [before[1][-1], after[1][-1]],
                      "losses_before": before[1], "losses_after": after[1],
                      "seconds": time.perf_counter() - clock}, indent=1))


if __name__ == "__main__":
    main()
