"""Patterns found by trying models outside the zoo: nn.EmbeddingBag (a tuple-valued lookup that sums, averages or
takes the largest of each bag), ops no spec describes that return tuples (their outputs keep their shapes, so what
reads them is analysed as usual), outputs a model masks with -inf (verification compares them where they are
finite and requires the mask unchanged), hyper-connections (an einsum with a selected row of a parameter,
whose coordinates the contraction sums away: it crashed the analysis), expert weights gathered per token by the
routed ids, vector norms, and models that cannot run in float64 (refused as unverifiable, exit status 2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.errors import UnverifiableError
from symgraph.fuzz import fuzz
from symgraph.verify import relative_change
from symgraph.zoo import _perturb

from cli_runner import run
from group_checks import assert_fuzzed_at_two_shapes

V = 30


def token_ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, V, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


class Bags(nn.Module):
    """EmbeddingBag over each row of ids, a linear between, a ReLU MLP head."""

    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, 12, mode=mode, padding_idx=0)
        self.mix = nn.Linear(12, 12)
        self.up, self.head = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(F.relu(self.up(self.mix(self.bag(ids)))))


def subject_of(model: nn.Module):
    torch.manual_seed(0)
    model = model.eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return symgraph.load(model, (token_ids(2, 7),))


def kinds(subject) -> dict[str, str]:
    return {g.id: g.kind for g in subject.report.groups}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_columns_move_with_the_linear_that_reads_them(mode):
    subject = subject_of(Bags(mode))
    assert "aten.embedding_bag.padding_idx" not in subject.report.unknown_ops
    on_columns = [g for g in subject.report.groups if "bag.weight" in g.params]
    assert len(on_columns) == 1
    # sums and averages pass any linear map of the columns; the largest of a bag only permutations and scales > 0
    assert on_columns[0].kind == ("permutation" if mode == "max" else "general_linear")
    assert any(g.kind == "permutation" and "up.weight" in g.params and "bag.weight" not in g.params
               for g in subject.report.groups)  # the MLP's hidden units
    assert_fuzzed_at_two_shapes(subject, samples=3)


class SortedTokens(nn.Module):
    """Tokens sorted per channel along the sequence (``sort``, which no spec describes, returns a tuple), then an
    MLP whose hidden units are free whatever happened before."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.up, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(F.relu(self.up(self.emb(ids).sort(dim=1).values)))


def test_an_unknown_op_with_several_outputs_keeps_their_shapes():
    subject = subject_of(SortedTokens())
    assert "aten.sort.default" in subject.report.unknown_ops
    hidden = [g for g in subject.report.groups if "up.weight" in g.params and "head.weight" in g.params]
    assert hidden and hidden[0].kind == "permutation", [p.reason for p in subject.report.pinned]
    assert_fuzzed_at_two_shapes(subject, samples=3)


class MaskedLogits(nn.Module):
    """A language-model head whose logits of some tokens are always -inf (a banned part of the vocabulary)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.up, self.down, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, V)
        self.register_buffer("banned", torch.arange(V) % 5 == 0)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x).masked_fill(self.banned, float("-inf"))


def test_outputs_masked_with_minus_infinity_are_checked_where_finite():
    subject = subject_of(MaskedLogits())
    assert any(g.motif == "ffn" for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject, samples=3)  # inf - inf made every check NaN before
    new, outcome = symgraph.api.transformed(subject)
    assert outcome.ok and outcome.relative_error < 1e-6  # weights rounded back to float32


def test_a_changed_mask_or_a_nan_is_a_change():
    ref = torch.tensor([1.0, float("-inf"), 2.0, float("nan")])
    assert relative_change(ref.clone(), ref) == 0.0
    assert relative_change(torch.tensor([1.0, 5.0, 2.0, float("nan")]), ref) == float("inf")  # unmasked
    assert relative_change(torch.tensor([1.0, float("inf"), 2.0, float("nan")]), ref) == float("inf")  # sign
    assert relative_change(torch.tensor([1.0, float("-inf"), 2.0, 0.0]), ref) == float("inf")  # NaN gone
    assert relative_change(torch.tensor([1.0, float("-inf"), 2.0 + 1e-3, float("nan")]), ref) == pytest.approx(
        1e-3 / 5 ** 0.5, rel=1e-3)  # float32


class HyperConnections(nn.Module):
    """Three residual streams, read by a learned mix (``alpha[i]``, one row per layer) and rewritten by a learned
    stream-mixing matrix plus the layer's output spread by ``gamma[i]`` (Zhu et al., hyper-connections)."""

    def __init__(self, streams: int = 3, layers: int = 2):
        super().__init__()
        self.streams = streams
        self.emb = nn.Embedding(V, 8)
        self.alpha, self.gamma = nn.Parameter(torch.rand(layers, streams)), nn.Parameter(torch.rand(layers, streams))
        self.beta = nn.Parameter(torch.eye(streams).repeat(layers, 1, 1) + 0.1 * torch.randn(layers, streams, streams))
        self.up = nn.ModuleList(nn.Linear(8, 16) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(16, 8) for _ in range(layers))
        self.norm = nn.ModuleList(nn.RMSNorm(8) for _ in range(layers))
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        x = self.emb(ids)[:, :, None].expand(-1, -1, self.streams, -1)
        for i in range(len(self.up)):
            h = torch.einsum("s,bnsd->bnd", self.alpha[i], x)
            out = self.down[i](F.gelu(self.up[i](self.norm[i](h))))
            x = torch.einsum("st,bntd->bnsd", self.beta[i], x) + out[:, :, None] * self.gamma[i][None, None, :, None]
        return self.head(x.sum(2))


def test_hyper_connections_keep_one_residual_map_for_every_stream():
    subject = subject_of(HyperConnections())
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert len(residual) == 1 and {"emb.weight", "head.weight"} <= set(residual[0].params)
    assert sum(g.motif == "ffn" for g in subject.report.groups) == 2
    assert_fuzzed_at_two_shapes(subject, samples=3)


class GatheredExperts(nn.Module):
    """Each token's top-2 experts' weights gathered by the routed ids (``w1[idx]``), then einsums."""

    def __init__(self, experts: int = 4, hidden: int = 12):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.gate = nn.Linear(8, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, 8) / 3)
        self.w2 = nn.Parameter(torch.randn(experts, 8, hidden) / 3)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        x = self.emb(ids)
        weight, idx = self.gate(x).softmax(-1).topk(2, -1)
        h = F.silu(torch.einsum("bnd,bnkfd->bnkf", x, self.w1[idx]))
        y = torch.einsum("bnkf,bnkdf->bnkd", h, self.w2[idx])
        return self.head(x + (y * weight[..., None]).sum(2))


def test_expert_weights_gathered_by_routed_ids_keep_what_the_pick_does_not_choose():
    """Which expert a token's ids pick must not move (the router's expert axis is pinned), but the hidden units
    every expert shares a position for, and the residual stream, are free (everything was pinned before)."""
    subject = subject_of(GatheredExperts())
    kinds_by_motif = {(g.motif, g.kind) for g in subject.report.groups}
    assert ("ffn", "permutation") in kinds_by_motif and ("residual", "general_linear") in kinds_by_motif
    assert any("gate.weight" in p.params and "pick another tensor" in p.reason for p in subject.report.pinned)
    assert_fuzzed_at_two_shapes(subject, samples=3)


FLOAT32_ONLY = """
import torch
from torch import nn


class Float32Kernel(nn.Module):
    \"\"\"An MLP around a kernel with no float64 implementation (as flex attention on CPU, or torch.cond run
    eagerly under a dispatch mode): symgraph analyses it, but cannot run it in float64 to check anything.\"\"\"

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise NotImplementedError("this kernel supports float32 only")
        return self.down(torch.relu(self.up(x)))


def build():
    return Float32Kernel(), (torch.randn(2, 3, 4),)
"""


@pytest.fixture
def float32_only(tmp_path):
    path = tmp_path / "float32_only.py"
    path.write_text(FLOAT32_ONLY)
    return path


def test_a_model_that_cannot_run_in_float64_is_refused_with_the_reason(float32_only):
    subject = symgraph.load(f"{float32_only}:build")
    assert subject.report.groups  # analysed: the MLP's hidden units
    with pytest.raises(UnverifiableError, match="cannot be checked: it does not run in float64") as caught:
        fuzz(subject, samples=1)
    assert "float32 only" in caught.value.message and "set_attn_implementation" in caught.value.hint



class NormalisedStream(nn.Module):
    """``F.normalize`` where LayerNorms would be (a norm, ``clamp_min``, ``expand_as``, a division): before the MLP
    and before the head, and on each head's queries and keys (cosine attention) with a learned temperature."""

    def __init__(self, p: float = 2.0, expand: bool = False):
        super().__init__()
        self.p, self.expand = p, expand
        self.emb = nn.Embedding(V, 8)
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        x = self.emb(ids)
        b, n, _ = x.shape
        q, k, v = self.qkv(F.normalize(x, p=self.p, dim=-1)).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, p=self.p, dim=-1), F.normalize(k, p=self.p, dim=-1)
        a = torch.softmax(5.0 * q @ k.transpose(-1, -2), -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, n, 8))
        x = x + self.down(F.gelu(self.up(self.normalize(x))))
        return self.head(self.normalize(x))

    def normalize(self, x):
        """F.normalize (``expand_as(x)``: x carries channels), or by hand with ``expand(x.shape)`` (the norm alone)."""
        if not self.expand:
            return F.normalize(x, p=self.p, dim=-1)
        return x / torch.linalg.vector_norm(x, self.p, -1, True).clamp_min(1e-12).expand(x.shape)


@pytest.mark.parametrize("p, kind, expand", [(2.0, "orthogonal", False), (1.0, "signed_permutation", False),
                                             (2.0, "orthogonal", True)])
def test_vector_norms_pass_what_keeps_the_norm(p, kind, expand):
    """An L2 norm keeps orthogonal maps, any other norm signed permutations: the residual stream and each head's
    queries and keys get them. linalg_vector_norm and clamp_min had no spec, and the expanded norm was no longer
    known to be invariant: everything they touched was pinned."""
    subject = subject_of(NormalisedStream(p, expand))
    assert not subject.report.unknown_ops
    stream = [g for g in subject.report.groups if g.motif == "residual"]
    assert len(stream) == 1 and stream[0].kind == kind
    assert any(g.motif == "qk" and g.kind == kind for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject, samples=3)


def test_the_cli_says_a_model_cannot_be_checked_and_exits_2_not_1(float32_only):
    """Exit status 1 means a violation was found; a model that cannot run in float64 is input it cannot take."""
    code, out, err = run("fuzz", f"{float32_only}:build", "--samples", "1")
    assert code == 2, (out, err)
    assert "cannot be checked: it does not run in float64" in out + err
