r"""Matchings decided on low-precision costs, kept only when provably the matching the working-precision costs give.

A permutation group's cost is a sum of member products: an FFN's is three (5632 x 2048) x (2048 x 5632) GEMMs
per solve at 0.85B, three (11008 x 4096) x (4096 x 11008) at 7B, most of a descent's arithmetic. The same
products run several times faster in low precision where the CPU has the units for it:

* ``bfloat16`` on bfloat16 matrix units (AMX): bfloat16 copies of the members, accumulated in float32 (0.18 s
  against 0.85 s per 0.85B product, one core).
* ``int8`` on int8 dot-product units (AVX-512 VNNI, no AMX): each unit's slice rounded to integers -127..127 on
  a scale of its own (its largest entry maps to 127), multiplied exactly in int32 (``torch._int_mm``; 4x the
  float32 rate here: 0.24 s against 0.94 s for a 2048 x 4096 x 2048 product).

Their answer is used only when it is provably the working costs' answer. With :math:`\alpha_i` anchor unit
:math:`i`'s norm and :math:`\sigma_j` source unit :math:`j`'s (over all the members, float64), every entry of the
screened cost differs from the working one by at most :math:`E_{ij} = \epsilon\,\alpha_i\sigma_j + \tau`
(Cauchy-Schwarz, member by member, then over members), with :math:`\epsilon` the kernel's error plus the working
products' own rounding (:func:`symgraph.solve.certify.rounding`) and :math:`\tau` for subnormals. The
``bfloat16`` error is a priori: the rounding of both inputs and of the output and the float32 accumulation. The
``int8`` error follows from each unit's scale: with :math:`e_i` unit :math:`i`'s rounding error (its slices minus
scale times integers: at most half a step per entry, :math:`\|e_i\| \le \tfrac12 s_i \sqrt{f}`) and :math:`r =
\max_i \|e_i\| / \|x_i\|` per model, :math:`|\langle a, b\rangle - \langle \hat a, \hat b\rangle| \le
\|e_a\|\|b\| + \|\hat a\|\|e_b\|`, so :math:`\epsilon \le r_a + (1 + r_a) r_b` plus the float32 rounding of the
int32 sums and their scaling. When every row's best entry beats the rest of its
row by more than :math:`E_{i\beta_i} + \max_j E_{ij}` and the rows' best columns are distinct, the working costs
have their row maxima in the same distinct columns, which is exactly what :func:`~symgraph.solve.kernels.hungarian`
returns (and a signed matching's signs hold where the chosen entry exceeds its own bound). Otherwise nothing is
returned and the working costs are computed as before. The rows are screened a chunk at a time and a row that
cannot be proven stops the screen at once: a hard matching (two independent models) wastes one chunk's products,
not a whole low-precision GEMM. Normalised costs (cosines) are bounded by :math:`\epsilon` per side. The margins
handed to the certificate of :mod:`symgraph.solve.certify` are lowered by the same bounds, so they stay lower
bounds of the working margins.
"""
from __future__ import annotations

import numpy as np
import torch

from ..groups import Group, Member
from . import certify
from .reduce import CHUNK
from .sums import layer_of
from .workspace import COPY_BUDGET

BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits), rounding to nearest
FP32 = 2.0 ** -24
SUBNORMAL = 2.0 ** -100  # per unit pair, far above what subnormal inputs and float32 underflow can add
FINITE = 1e37  # below float32's largest value (3.4e38) by more than any rounding
MIN_SIZE = 1024  # smaller groups: the working costs are cheap, screening them saves nothing
INT8_LEVELS = 127  # integers -127..127: a product of two fits in 2^14, a sum of 2^17 of them in int32
INT8_MAX_FEATURES = (2 ** 31 - 1) // INT8_LEVELS ** 2  # int32 accumulation stays exact below this
# |x / scale - q| <= 1/2 + the float32 rounding of x / scale (|x / scale| <= 127 (1 + 2^-23)): 1/2 (1 + 2^-14)
HALF_STEP = 0.5 * (1 + 2.0 ** -14)
CHUNK_ENTRIES = 1 << 24  # screened cost entries per chunk of rows (64 MiB of float32)


def pays_off(ws, g: Group, members: list[Member]) -> bool:
    """Screen ``g`` when its costs are large GEMMs read afresh (members in one layer: the residual stream keeps
    per-layer sums instead), on a CPU whose low-precision units (:func:`kernel`) make them faster than float32."""
    x = next(iter(ws.src.values()))
    layers = {layer_of(p) for m in members for p in m.params}
    chosen = kernel()
    copies = 2 * (1 if chosen == "int8" else 2) * ws.elements(g, members)  # both models' members, kept throughout
    return (g.size >= MIN_SIZE and x.device.type == "cpu" and len(layers) == 1 and not g.global_sign
            and chosen is not None and copies <= COPY_BUDGET
            and (chosen != "int8" or max(ws.features(m) for m in members) <= INT8_MAX_FEATURES))


def kernel() -> str | None:
    """The low-precision product this CPU runs fastest: ``bfloat16`` on AMX tiles, ``int8`` on VNNI (AVX-512
    integer dot products), None without either (screening would cost more than it saves)."""
    if _cpu_has("_is_amx_tile_supported"):
        return "bfloat16"
    if _cpu_has("_is_vnni_supported") and hasattr(torch, "_int_mm"):
        return "int8"
    return None


def _cpu_has(probe: str) -> bool:
    check = getattr(torch.cpu, probe, None)
    return bool(check and check())


def certified_matching(ws, g: Group, members: list[Member], *, signed: bool, normalise: bool):
    """``(perms, signs, margins, signed_entries)`` per copy as the working costs would give them (``margins``
    and ``signed_entries`` lower bounds of that solve's), or None when the screened costs cannot prove it."""
    moving = [m for m in members if m.action != "permute"]
    following = [m for m in members if m.action == "permute"]
    if not moving:  # the working costs are then the followers' alone, signs read from zeros: not screened
        return None
    chosen = kernel()
    parts = [_Part(ws, part, chosen) for part in (moving, following) if part]
    error = _bf16_error(ws, members) if chosen == "bfloat16" else max(p.error for p in parts)
    bound = 1.01 * (error + certify.rounding(ws, members))
    # Cauchy-Schwarz over the two parts: one bound with the norms over all members. Below FINITE no product of
    # either computation overflows float32, so the working costs are finite, as kernels.hungarian's exit needs.
    alpha = np.sqrt(sum(p.alpha ** 2 for p in parts))
    sigma = np.sqrt(sum(p.sigma ** 2 for p in parts))
    if not (alpha.max(initial=0.0) * sigma.max(initial=0.0) < FINITE):
        return None
    eps = len(parts) * (bound + 1e-6)  # a cosine's bound per part, plus the float32 rounding of the divisions
    scale = bound + len(members) * FP32  # summing k member products in float32 adds k x 2^-24 of alpha sigma
    step = max(1, CHUNK_ENTRIES // max(g.copies * g.size, 1))
    found = [np.empty((g.copies, g.size)) for _ in range(4)]  # perms, signs, margins, signed entries
    for lo in range(0, g.size, step):
        rows = slice(lo, min(lo + step, g.size))
        sims = [p.rows(rows, normalise) for p in parts]
        a = sims[0]
        cost = np.abs(a) if signed else a
        if len(sims) > 1:
            cost = cost + sims[1]
        for c in range(g.copies):
            best = np.argmax(cost[c], axis=1)
            index = np.arange(best.size)
            if normalise:
                err_best = err_other = eps
            else:
                err_best = scale * alpha[c, rows] * sigma[c][best] + SUBNORMAL
                err_other = scale * alpha[c, rows] * sigma[c].max() + SUBNORMAL
            margin = certify.margins(cost[c], best) - err_best - err_other
            entry = np.abs(a[c][index, best]) - err_best
            if not (margin > 0).all() or (signed and not (entry > 0).all()):
                return None  # this row's maximum is not proven: the working costs decide
            found[0][c, rows], found[2][c, rows], found[3][c, rows] = best, margin, entry
            found[1][c, rows] = np.where(a[c][index, best] < 0, -1.0, 1.0) if signed else 1.0
    perms = found[0].astype(np.int64)
    if any(np.unique(p).size != p.size for p in perms):
        return None
    return perms, found[1], found[2], found[3]


class _Part:
    """One part of the cost (the members that move with signs and scales, or those that only follow the
    permutation) in the kernel's precision, with its float64 unit norms and, for ``int8``, its error bound."""

    def __init__(self, ws, members: list[Member], kernel_name: str):
        self.kernel, self.ws, self.members = kernel_name, ws, members
        self.alpha = np.sqrt(sum(ws.unit_sums(m, "anc") for m in members))
        self.sigma = np.sqrt(sum(ws.unit_sums(m, "src") for m in members))
        if kernel_name == "bfloat16":
            self.anc = [ws.flat("anc", m).to(torch.bfloat16) for m in members]
            self.src = [ws.flat("src", m).to(torch.bfloat16) for m in members]
            self.error = None
            return
        self.anc, anc_err = zip(*(_quantised(ws.flat("anc", m)) for m in members))  # squared error bounds
        self.src, src_err = zip(*(_quantised(ws.flat("src", m)) for m in members))
        r_anc = _relative(np.sqrt(sum(anc_err)), self.alpha)
        r_src = _relative(np.sqrt(sum(src_err)), self.sigma)
        # int32 sums exact; their float32 conversion, two scalings and the sum over members round (4 + k) times
        self.error = r_anc + (1 + r_anc) * r_src + (4 + len(members)) * FP32 * (1 + r_anc) * (1 + r_src)

    def rows(self, rows: slice, normalise: bool) -> np.ndarray:
        """Screened similarities of anchor units ``rows`` with every source unit (copies, rows, size), float32."""
        sim = None
        for anc, src in zip(self.anc, self.src):
            product = (torch.bmm(anc[:, rows], src.transpose(1, 2)).float() if self.kernel == "bfloat16"
                       else _int8_product(anc, src, rows))
            sim = product if sim is None else sim.add_(product)
            del product
        out = sim.numpy()
        if normalise:
            out /= np.maximum(self.alpha[:, rows], 1e-30)[:, :, None]
            out /= np.maximum(self.sigma, 1e-30)[:, None, :]
        return out


def _quantised(x: torch.Tensor):
    """``x`` (copies, units, features) as ((integers int8, per-unit scales float32), per-unit bound on the squared
    norm of the rounding error ``x - scale * q``, float64): each unit's largest magnitude maps to 127, and each
    entry is off by at most half a step (:data:`HALF_STEP` scales), so the error of a unit is at most
    ``features * (HALF_STEP * scale)^2`` (nothing is read again to measure it). Each chunk of units is made
    contiguous first (a down projection's units are its columns)."""
    copies, units, features = x.shape
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty((copies, units, 1), dtype=torch.float32)
    step = max(1, CHUNK // max(features, 1))
    for c in range(copies):
        for lo in range(0, units, step):
            part = x[c, lo:lo + step].detach().contiguous()
            low, high = torch.aminmax(part, dim=-1, keepdim=True)
            top = torch.maximum(-low, high).to(torch.float32)
            s = torch.where(top > 0, top / INT8_LEVELS, torch.ones_like(top))
            q[c, lo:lo + step] = torch.div(part, s.to(part.dtype)).round_().clamp_(-INT8_LEVELS, INT8_LEVELS)
            scales[c, lo:lo + step] = s
    bound = features * (HALF_STEP * scales.double().squeeze(-1)) ** 2
    return (q, scales), bound.numpy()


def _int8_product(anc, src, rows: slice) -> torch.Tensor:
    """(copies, rows, size) float32: the exact int32 products of the integers, times both units' scales."""
    (qa, sa), (qs, ss) = anc, src
    out = []
    for c in range(qa.shape[0]):
        exact = torch._int_mm(qa[c, rows], qs[c].transpose(0, 1))
        out.append(exact.to(torch.float32).mul_(sa[c, rows]).mul_(ss[c].reshape(1, -1)))
    return torch.stack(out) if len(out) > 1 else out[0][None]


def _relative(err: np.ndarray, norms: np.ndarray) -> float:
    """The largest rounding error relative to its unit's norm (a zero unit rounds to zero exactly)."""
    ratio = np.where(norms > 0, err / np.maximum(norms, 1e-300), 0.0)
    return float(ratio.max(initial=0.0)) * (1 + 1e-9)


def _bf16_error(ws, members: list[Member]) -> float:
    r"""Bound on |screened - exact| / (alpha_i sigma_j) of one bfloat16 cost entry: each input rounded to bfloat16
    (:math:`2u + u^2`), products exact in float32 and summed there (features x float32 roundoff), the result
    rounded to bfloat16 (:math:`u`)."""
    features = max(ws.features(m) for m in members)
    inputs = 2 * BF16 + BF16 ** 2
    accumulate = 1.01 * features * FP32 * (1 + BF16) ** 2
    return (1 + BF16) * (inputs + accumulate) + BF16


def _epsilon(ws, members: list[Member]) -> float:
    """The bfloat16 kernel's bound plus the working computation's own rounding."""
    return _bf16_error(ws, members) + certify.rounding(ws, members)
