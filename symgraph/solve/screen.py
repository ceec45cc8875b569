r"""Matchings decided on bfloat16 costs, kept only when provably the matching the working-precision costs give.

A permutation group's cost is a sum of member products: an FFN's is three (5632 x 2048) x (2048 x 5632) GEMMs
per solve at 0.85B, most of a descent's arithmetic. On a CPU with bfloat16 matrix units (AMX) the same products
from bfloat16 copies of the members, accumulated in float32, run about 5x faster (0.18 s against 0.85 s each,
one core). Their answer is used only when it is provably the working costs' answer:

With :math:`\alpha_i` anchor unit :math:`i`'s norm and :math:`\sigma_j` source unit :math:`j`'s (over all the
members, float64), every entry of the screened cost differs from the working one by at most
:math:`E_{ij} = \epsilon\,\alpha_i\sigma_j + \tau` (Cauchy-Schwarz, member by member, then over members):
:math:`\epsilon` sums the bfloat16 rounding of both inputs and of the output, the float32 accumulation, and the
working products' own rounding (:func:`symgraph.solve.certify.rounding`); :math:`\tau` covers subnormals. When
every row's best entry beats the rest of its row by more than :math:`E_{i\beta_i} + \max_j E_{ij}` and the rows'
best columns are distinct, the working costs have their row maxima in the same distinct columns, which is
exactly what :func:`~symgraph.solve.kernels.hungarian` returns (and a signed matching's signs hold where the
chosen entry exceeds its own bound). Otherwise nothing is returned and the working costs are computed as before.
Normalised costs (cosines) are bounded by :math:`\epsilon` per side. The margins handed to the certificate of
:mod:`symgraph.solve.certify` are lowered by the same bounds, so they stay lower bounds of the working margins.
"""
from __future__ import annotations

import numpy as np
import torch

from ..groups import Group, Member
from . import certify
from .sums import layer_of

BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits), rounding to nearest
FP32 = 2.0 ** -24
SUBNORMAL = 2.0 ** -100  # per unit pair, far above what subnormal inputs and float32 underflow can add
FINITE = 1e37  # below float32's largest value (3.4e38) by more than any rounding
MIN_SIZE = 1024  # smaller groups: the working costs are cheap, screening them saves nothing


def pays_off(ws, g: Group, members: list[Member]) -> bool:
    """Screen ``g`` when its costs are large GEMMs read afresh (members in one layer: the residual stream keeps
    per-layer sums instead), on a CPU whose bfloat16 matrix units make them faster than float32."""
    x = next(iter(ws.src.values()))
    layers = {layer_of(p) for m in members for p in m.params}
    return (g.size >= MIN_SIZE and x.device.type == "cpu" and len(layers) == 1 and not g.global_sign
            and bf16_matrix_units())


def bf16_matrix_units() -> bool:
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx())


def certified_matching(ws, g: Group, members: list[Member], *, signed: bool, normalise: bool):
    """``(perms, signs, margins, signed_entries)`` per copy as the working costs would give them (``margins``
    and ``signed_entries`` lower bounds of that solve's), or None when the screened costs cannot prove it."""
    moving = [m for m in members if m.action != "permute"]
    following = [m for m in members if m.action == "permute"]
    if not moving:  # the working costs are then the followers' alone, signs read from zeros: not screened
        return None
    bound = 1.01 * _epsilon(ws, members)
    parts, alpha_sq, sigma_sq, eps = [], 0.0, 0.0, 0.0
    for part in (moving, following):
        if not part:
            continue
        sim, alpha, sigma = _screened(ws, g, part)
        if normalise:
            sim /= np.maximum(alpha, 1e-30)[:, :, None]
            sim /= np.maximum(sigma, 1e-30)[:, None, :]
            eps += bound + 1e-6  # a cosine's bound, plus the float32 rounding of the screened sums and divisions
        alpha_sq, sigma_sq = alpha_sq + alpha ** 2, sigma_sq + sigma ** 2
        parts.append(sim)
    # Cauchy-Schwarz over the two parts: one bound with the norms over all members. Below FINITE no product of
    # either computation overflows float32, so the working costs are finite, as kernels.hungarian's exit needs.
    alpha, sigma = np.sqrt(alpha_sq), np.sqrt(sigma_sq)
    if not (alpha.max(initial=0.0) * sigma.max(initial=0.0) < FINITE):
        return None
    a = parts[0]
    cost = np.abs(a) if signed else a
    if len(parts) > 1:
        cost = cost + parts[1]
    perms, signs, margins, entries = [], [], [], []
    for c in range(g.copies):
        best = np.argmax(cost[c], axis=1)
        if np.unique(best).size != best.size:
            return None
        rows = np.arange(best.size)
        if normalise:
            err_best = err_other = eps
        else:  # summing k member products in float32 adds k x 2^-24 of alpha sigma at most
            err_best = (bound + len(members) * FP32) * alpha[c] * sigma[c][best] + SUBNORMAL
            err_other = (bound + len(members) * FP32) * alpha[c] * sigma[c].max() + SUBNORMAL
        margin = certify.margins(cost[c], best) - err_best - err_other
        entry = np.abs(a[c][rows, best]) - err_best
        if not (margin > 0).all() or (signed and not (entry > 0).all()):
            return None
        perms.append(best.astype(np.int64))
        signs.append(np.where(a[c][rows, best] < 0, -1.0, 1.0) if signed else np.ones(best.size))
        margins.append(margin)
        entries.append(entry)
    return np.stack(perms), np.stack(signs), np.stack(margins), np.stack(entries)


def _screened(ws, g: Group, members: list[Member]):
    """(bfloat16 similarity [copy, anchor unit, source unit] summed over ``members`` in float32, anchor and
    source unit norms over them, float64)."""
    sim = None
    alpha_sq, sigma_sq = np.zeros((g.copies, g.size)), np.zeros((g.copies, g.size))
    for m in members:
        anc, src = ws.flat("anc", m), ws.flat("src", m)
        product = torch.bmm(anc.to(torch.bfloat16), src.to(torch.bfloat16).transpose(1, 2))
        sim = product.float() if sim is None else sim.add_(product)
        del product
        alpha_sq += ws.unit_sums(m, "anc")
        sigma_sq += ws.unit_sums(m, "src")
    return sim.numpy(), np.sqrt(alpha_sq), np.sqrt(sigma_sq)


def _epsilon(ws, members: list[Member]) -> float:
    r"""Bound on |screened - working| / (alpha_i sigma_j) of one cost entry: each input rounded to bfloat16
    (:math:`2u + u^2`), products exact in float32 and summed there (features x float32 roundoff), the result
    rounded to bfloat16 (:math:`u`), and the working computation's own rounding."""
    features = max(ws.features(m) for m in members)
    inputs = 2 * BF16 + BF16 ** 2
    accumulate = 1.01 * features * FP32 * (1 + BF16) ** 2
    return (1 + BF16) * (inputs + accumulate) + BF16 + certify.rounding(ws, members)

