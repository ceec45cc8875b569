"""Groups that leaked through the analysis without being symmetries (issue 10): an unknown op on the query/key
path, a full-width q/k norm, a LayerNorm bias shared by heads, zero-padded input pieces, channels dropped by an
elementwise product, weights gathered by indices computed from parameters. Each architecture is checked
independently of the analysis: every reported group, sampled at random, must leave the float64 outputs unchanged
at input lengths other than the traced one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel

import symgraph
from symgraph.elements import apply, sample
from symgraph.fuzz import fuzz
from symgraph.verify import Evaluator

from cli_runner import assert_fuzzed, report_json

BASE = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=60,
            pad_token_id=0, eos_token_id=1, bos_token_id=2, max_position_embeddings=64)
MOE = dict(experts_implementation="batched_mm")  # the default grouped_mm kernel has no float64 version
ARCHITECTURES = {
    "xglm": (dict(d_model=32, attention_heads=4, ffn_dim=64, num_layers=2), {}),  # aten.max.other on scores
    "roformer": (dict(embedding_size=32), {}),  # reshape_as; RoPE table read from a parameter
    "persimmon": (dict(), {}),  # per-head LayerNorm on q/k with one weight and bias for all heads
    # full-width q/k norm; experts gathered by router indices the analysis cannot know
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=2), MOE),
    "mobilebert": (dict(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                        num_feedforward_networks=2), {}),  # zero-padded embedding pieces
    "mamba": (dict(state_size=4, expand=2, conv_kernel=4, time_step_rank=4), {}),  # A_log * dt, depthwise conv
    "llama4_text": (dict(num_key_value_heads=2, head_dim=8, intermediate_size_mlp=64, num_local_experts=2,
                         interleave_moe_layer_step=2), MOE),  # view_as_complex RoPE
    "doge": (dict(num_key_value_heads=2, head_dim=8), {}),  # dt_proj reads every head's values (dynamic mask)
}
LENGTHS = (7, 4, 12)  # the traced length first


def build(model_type: str) -> torch.nn.Module:
    extra, kwargs = ARCHITECTURES[model_type]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**BASE, **extra})
    try:
        model = AutoModel.from_config(config, attn_implementation="sdpa", **kwargs)
    except ValueError:  # no SDPA path (XGLM)
        config = AutoConfig.for_model(model_type, **{**BASE, **extra})
        model = AutoModel.from_config(config, attn_implementation="eager", **kwargs)
    with torch.no_grad():  # no norm weight exactly 1, no bias exactly 0
        for p in model.parameters():
            p.add_((0.02 if p.dim() >= 2 else 0.1) * torch.randn_like(p))
    return model.eval()


def token_inputs(model, length: int) -> dict:
    ids = torch.randint(3, 60, (2, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, **({"use_cache": False} if getattr(model.config, "use_cache", None) is not None
                                 else {})}


def violations(model, groups, make_inputs, lengths=LENGTHS, draws: int = 2) -> list[str]:
    """Groups for which a random element changes the float64 output at some input length."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # XGLM builds its mask minimum with the default dtype
    try:
        evaluators = [Evaluator(model, *make_inputs(n)) for n in lengths]
        rng = np.random.default_rng(0)
        bad = []
        for group in groups:
            for evaluator in evaluators:
                outcomes = [evaluator.check(apply(evaluator.state, [sample(group, rng)])) for _ in range(draws)]
                if not all(o.ok for o in outcomes):
                    bad.append(f"{group.id} ({max(o.relative_error for o in outcomes):.1e})")
                    break
        return bad
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def subjects():
    cache = {}

    def get(model_type):
        if model_type not in cache:
            model = build(model_type)
            cache[model_type] = symgraph.load(model, token_inputs(model, LENGTHS[0]))
        return cache[model_type]

    return get


def group_params(subject) -> list[tuple[str, set[str]]]:
    return [(g.id, {m.param for m in g.members}) for g in subject.report.groups]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_reported_group_is_a_symmetry_at_several_lengths(model_type, subjects):
    subject = subjects(model_type)
    assert subject.report.groups
    bad = violations(subject.model, subject.report.groups, lambda n: ((), token_inputs(subject.model, n)))
    assert not bad, bad


@pytest.mark.parametrize("model_type,head_dim", [("xglm", 8), ("roformer", 8), ("llama4_text", 8)])
def test_unknown_op_on_the_query_key_path_keeps_values_per_head(model_type, head_dim, subjects):
    report = subjects(model_type).report
    value_groups = [g for g in report.groups if any(("v_proj" in m.param or ".value." in m.param) and m.axis == 0
                                                    for m in g.members)]
    assert value_groups
    for g in value_groups:  # on value rows: per-head GL (or a permutation of whole heads), never across heads
        assert g.kind == "permutation" or (g.motif == "vo" and g.size == head_dim), (g.id, g.kind, g.size)


def test_float64_checks_run_code_that_builds_constants_in_the_default_dtype(subjects):
    # XGLM clamps scores with torch.full((), finfo(scores.dtype).min): a float64 minimum in a default-dtype
    # (float32) tensor overflowed, so transform and fuzz crashed instead of checking
    subject = subjects("xglm")
    assert torch.get_default_dtype() == torch.float32
    state = symgraph.transform(subject, seed=0)
    assert set(state) == set(subject.state_dict()) and torch.get_default_dtype() == torch.float32
    assert fuzz(subject, samples=2).ok


def test_full_width_qk_norm_moves_with_the_heads(subjects):
    heads = [params for gid, params in group_params(subjects("olmoe")) if gid.startswith("heads")]
    assert len(heads) == 4  # KV groups and query heads within them, two layers
    assert all(any(p.endswith("q_norm.weight") for p in params) for params in heads)
    assert all(any(p.endswith("k_norm.weight") for p in params) for gid, params in
               group_params(subjects("olmoe")) if gid.startswith("heads:"))


def test_layernorm_shared_by_heads_gets_no_per_pair_sign(subjects):
    for g in subjects("persimmon").report.groups:  # centering over the head dim allows one global sign only
        if any(m.param.endswith("query_key_value.weight") for m in g.members):
            assert (g.kind, g.scale) != ("scale", "sign"), g.id


def test_columns_that_read_zero_padded_pieces_move_with_the_embeddings(subjects):
    # the input columns read [shifted | embeddings | shifted] (zero-padded along the sequence): a map of the
    # embedding axis must act on all three pieces alike, never on the middle one alone
    width = 16
    for g in subjects("mobilebert").report.groups:
        for m in g.members:
            if m.param == "embeddings.embedding_transformation.weight" and m.axis == 1:
                pieces = m.index.reshape(-1, 3)
                assert (pieces[:, 1] == pieces[:, 0] + width).all() and (pieces[:, 2] == pieces[:, 0] + 2 * width).all()
                assert any(o.param == "embeddings.word_embeddings.weight" for o in g.members), g.id


def test_a_linear_reading_each_heads_values_moves_with_the_heads(subjects):
    # Doge's dynamic mask: dt_proj reads the values of KV head g through columns [8 g, 8 g + 8); permuting
    # heads without those columns changed the outputs (relative error 1e-3 in the sweep)
    heads = [g for g in subjects("doge").report.groups if g.id.startswith("heads:")]
    assert len(heads) == 2
    for g in heads:
        columns = next(m for m in g.members if m.param.endswith("dt_proj.weight") and m.axis == 1)
        assert columns.index[0].tolist() == [list(range(8)), list(range(8, 16))]


def test_mamba_state_permutation_moves_a_log_columns_with_b_and_c_rows(subjects):
    report = subjects("mamba").report
    state = [g for g in report.groups if any(m.param.endswith("A_log") and m.axis == 1 for m in g.members)]
    assert len(state) == 2 and all(g.kind == "permutation" and g.size == 4 for g in state)
    for g in state:
        rows = sorted(int(i) for m in g.members if m.param.endswith("x_proj.weight") for i in m.index.ravel())
        assert rows == list(range(4, 12))  # x_proj rows [dt | B | C] = [4 | 4 | 4]: B and C move, dt does not
    # the depthwise conv's channels move with everything else that is indexed by the mixer's inner channel:
    # both halves of in_proj (x and the gate z), A_log and D rows, dt_proj rows, x_proj and out_proj columns
    inner = [g for g in report.groups if any("conv1d.weight" in m.param for m in g.members)]
    assert len(inner) == 2
    for g in inner:
        moved = {(m.param.split("mixer.")[1], m.axis) for m in g.members}
        assert {("conv1d.weight", 0), ("conv1d.bias", 0), ("A_log", 0), ("D", 0), ("dt_proj.weight", 0),
                ("in_proj.weight", 0), ("x_proj.weight", 1), ("out_proj.weight", 1)} <= moved
        halves = next(m for m in g.members if m.param.endswith("in_proj.weight")).index.reshape(-1, 2)
        assert (halves[:, 1] == halves[:, 0] + g.size).all()  # x channel i and gate channel i together


# -- the same mechanisms on plain torch modules, through the CLI ------------------------------------------------
FACTORY = '''
import torch


class ClampedAttention(torch.nn.Module):
    """Attention whose scores pass through an op no spec describes before the softmax."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.h, d // self.h).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = torch.asinh(q @ k.transpose(-1, -2))
        out = torch.softmax(scores, -1) @ v
        return self.o(out.transpose(1, 2).flatten(2))


def clamped():
    torch.manual_seed(0)
    return ClampedAttention(), (torch.randn(2, 5, 16),)


class SubLayerNormAttention(ClampedAttention):
    """A LayerNorm over each head's output (one weight and bias for all heads) before the output projection."""

    def __init__(self, d=16, heads=4):
        super().__init__(d, heads)
        self.norm = torch.nn.LayerNorm(d // heads)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(self.norm(out).transpose(1, 2).flatten(2))


class EmptyPiece(torch.nn.Module):
    """Concatenates a class token with positions past the input's length (empty at the probe length)."""

    def __init__(self, d=16):
        super().__init__()
        self.cls = torch.nn.Parameter(torch.randn(1, 1, d))
        self.inner, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.inner(x)
        joined = torch.cat([self.cls.expand(x.shape[0], 1, -1), h[:, 8:]], dim=1)
        return self.out(torch.relu(joined + h[:, :1]))


def empty_piece():
    torch.manual_seed(0)
    return EmptyPiece(), (torch.randn(2, 5, 16),)


class QKLayerNormAttention(ClampedAttention):
    """A LayerNorm over each head's queries and keys, one weight and bias shared by all heads, no RoPE."""

    def __init__(self, d=16, heads=4):
        super().__init__(d, heads)
        self.q_norm, self.k_norm = torch.nn.LayerNorm(d // heads), torch.nn.LayerNorm(d // heads)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q_norm(self.q(x).view(b, n, self.h, -1)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, n, self.h, -1)).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, self.split(self.v(x)))
        return self.o(out.transpose(1, 2).flatten(2))


def qk_layer_norm():
    torch.manual_seed(0)
    model = QKLayerNormAttention()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model, (torch.randn(2, 5, 16),)


def sub_layer_norm():
    torch.manual_seed(0)
    model = SubLayerNormAttention()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model, (torch.randn(2, 5, 16),)
'''


def load_factory(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("leak_factories", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "leak_factories.py"
    path.write_text(FACTORY)
    return path


def test_cli_reports_values_per_head_after_an_unknown_score_op(factory, tmp_path):
    data = report_json(f"{factory}:clamped")
    assert data["summary"]["unknown_ops"] == {"aten.asinh.default": 1}
    value_groups = [g for g in data["groups"] if any(m["param"] == "v.weight" for m in g["members"])]
    assert [(g["motif"], g["size"], g["copies"]) for g in value_groups] == [("vo", 4, 4)]
    assert not any(g["motif"] == "heads" for g in data["groups"])  # the unknown op pins the heads' order
    assert_fuzzed(f"{factory}:clamped", tmp_path, samples=5)


@pytest.mark.parametrize("name", ["clamped", "sub_layer_norm", "qk_layer_norm", "empty_piece"])
def test_torch_modules_groups_hold_at_other_lengths(factory, name):
    model, args = getattr(load_factory(factory), name)()
    report = symgraph.analyze(model, inputs=args)
    assert report.groups
    assert not violations(model, report.groups, lambda n: ((torch.randn(2, n, 16),), {}))


def test_a_layernorm_bias_shared_by_heads_allows_one_global_sign(factory):
    model, args = load_factory(factory).qk_layer_norm()
    qk = [g for g in symgraph.analyze(model, inputs=args).groups if g.motif == "qk"]
    assert [(g.kind, g.size, g.copies, g.global_sign) for g in qk] == [("permutation", 4, 1, True)]


def test_head_blocks_pass_a_norm_of_each_head_output(factory):
    """The norm's weight meets the value coordinates; the head blocks beside them must still reach the output
    projection, whose columns move with the heads."""
    model, args = load_factory(factory).sub_layer_norm()
    heads = [g for g in symgraph.analyze(model, inputs=args).groups if g.motif == "heads"]
    assert len(heads) == 1 and {m.param for m in heads[0].members} >= {"q.weight", "k.weight", "v.weight", "o.weight"}


# -- found nothing where theory says there is something ------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_base_model_keeps_each_norm_weight_scale_trade(family):
    """A base model outputs hidden states, which pins the residual stream; the pin reaches each norm's output
    through the product with its weight, but only its permutation: the weight still trades scale with the
    linears that read the norm."""
    from symgraph import zoo

    torch.manual_seed(0)
    model = AutoModel.from_config(zoo.tiny_config(family), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 if p.dim() >= 2 else 0.1) * torch.randn_like(p))
    report = symgraph.analyze(model, inputs=token_inputs(model, LENGTHS[0]))
    trades = [g for g in report.groups if g.motif == "scale_free"]
    assert len(trades) == 4  # two norms in each of two blocks; the final norm feeds the output and stays
    for g in trades:  # one norm (weight, and bias where it has one) against the linears after it
        assert len({m.param.rsplit(".", 1)[0] for m in g.members if "norm" in m.param or "ln_" in m.param}) == 1
    assert not violations(model, report.groups, lambda n: ((), token_inputs(model, n)))


# -- errors and pins that say where they come from ----------------------------------------------------------------
def test_pinned_spaces_name_the_model_source_line(factory):
    model, args = load_factory(factory).clamped()
    pinned = symgraph.analyze(model, inputs=args).pinned
    query = next(p for p in pinned if p.params == ("q.weight",))  # its input columns read the data x
    assert query.node == "linear" and query.source.startswith("leak_factories.py:") and "self.q(x)" in query.source


def test_a_failing_rule_raises_analysis_error_with_node_rule_and_source(factory, monkeypatch):
    from symgraph.analysis import rules
    from symgraph.errors import AnalysisError

    def broken(w, node, spec):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(rules, "rule_contract", broken)
    model, args = load_factory(factory).clamped()
    with pytest.raises(AnalysisError) as info:
        symgraph.analyze(model, inputs=args)
    message = str(info.value)
    assert "'contract' rule" in message and "aten.linear.default" in message and "graph node linear " in message
    assert "self.q(x)" in message
    assert "leak_factories.py:" in message and "IndexError" in message and "What to try" in message


class RowsChosenAtRunTime(torch.nn.Module):
    """A linear layer fed the rows a mask picks (``x[mask]``: a row count known only at run time), as JetMoE
    feeds each expert the tokens routed to it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))[x[..., 0] > 0]).sum(0)


def test_a_contraction_with_a_run_time_shape_keeps_the_units_the_pick_does_not_choose():
    """The mask picks rows (tokens), not hidden units: the units of ``a`` and ``b`` still permute (the pick is one by
    unknown indices, ``rules._counted_at_run_time``), and the contraction of the picked rows does not fail."""
    from group_checks import assert_fuzzed_at_two_shapes

    torch.manual_seed(0)
    subject = symgraph.load(RowsChosenAtRunTime().eval(), (torch.randn(2, 5, 4),))
    [group] = subject.report.groups
    assert group.motif == "ffn" and group.size == 6
    assert {(m.param, m.axis) for m in group.members} >= {("a.weight", 0), ("b.weight", 1)}
    assert_fuzzed_at_two_shapes(subject)


class RotaryAfterPrefix(torch.nn.Module):
    """Self-attention with rotary embeddings on every token but the first (DINOv3 leaves its class and register
    tokens unrotated): rotated and plain queries are concatenated along the token axis."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def rotate(self, x):
        n = x.shape[2]
        angles = torch.arange(n, dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, self.dh // 2, dtype=x.dtype)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        half = self.dh // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return torch.cat([x[:, :, :1], (x * cos + rotated * sin)[:, :, 1:]], dim=2)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, self.dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def test_rotated_and_plain_tokens_side_by_side_give_only_the_rotary_query_key_group():
    # the plain tokens once left the queries and keys an orthogonal group (outputs moved by 3e-3); they now see
    # the identity beside the rotations (tests/test_rotary_prefix_tokens.py)
    torch.manual_seed(0)
    subject = symgraph.load(RotaryAfterPrefix().eval(), (torch.randn(2, 6, 16),))
    assert [g.kind for g in subject.report.groups if g.motif == "qk"] == ["rotary"]
    assert [g.motif for g in subject.report.groups if g.motif == "vo"] == ["vo"]
    assert fuzz(subject, samples=3).ok
