"""Norm folding and the residual groups it opens: the rewrite keeps the function (at more than one input shape),
the folded graph gives O(D) (RMSNorm) or {Q : Q 1 = +-1} (LayerNorm) on the residual stream, soundly (fuzzed in
float64 at two input shapes; the unconstrained O(D) is caught on LayerNorm), the constrained Procrustes, exact
recovery on folded models, refusals that name the norm, and the command line."""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import re

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.elements import apply, sample
from symgraph.errors import InvarianceError
from symgraph.fold import FoldError, find_norms, fold, folded_subject, pays_off, untied, untied_by_fold
from symgraph.fuzz import fuzz
from symgraph.io import save_model
from symgraph.solve import kernels
from symgraph.verify import Evaluator, tie_aliases

from cli_runner import run, tree_digest

SHIPPED = symgraph.__path__[0] + "/data/models"
NORM_FAMILIES = {"llama": False, "vit": True}  # family -> LayerNorm (residual writers centred, Q 1 = +-1)
# every zoo family whose norms fold (the others are refused: post-LN, tied embeddings);
# the mixtures of experts' norms fold into their dense experts' einsums (and the routers)
FOLDABLE = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "phi": True, "vit": True,
            "gptj": True, "gpt-neox": True, "gpt2": True, "llama-tied": False,  # tied: untied to fold
            "mixtral": False, "qwen2-moe": False, "olmoe": False, "deepseek-v2": False, "gpt-oss": False}


def _subject(family, dtype=torch.float32):
    model = zoo.build(family, seed=0, dtype=dtype)
    return symgraph.load(model, zoo.example_inputs_for(family, model))


@functools.cache
def _folded64(family):
    """The folded float64 model of ``family`` (built, folded and analysed once; tests only read it)."""
    return folded_subject(_subject(family, torch.float64))


@pytest.mark.parametrize("family", list(NORM_FAMILIES))
def test_fold_keeps_the_function_at_two_shapes_and_leaves_unit_norms(family):
    subject = _subject(family)
    before = {k: v.clone() for k, v in subject.state_dict().items()}
    result = fold(subject)
    assert result.verified_error < 1e-4
    assert all(torch.equal(v, subject.state_dict()[k]) for k, v in before.items())  # the input is untouched
    assert result.norms and all(torch.equal(result.state[n.weight], torch.ones_like(before[n.weight]))
                                for n in result.norms)
    assert all(not result.state[n.bias].any() for n in result.norms if n.bias)
    assert any(not torch.equal(result.state[w], before[w]) for n in result.norms for w, *_ in n.readers)
    other = zoo.example_inputs_for(family, subject.model, batch=3, seq=11, seed=5)
    assert Evaluator(subject.model, *other).check(result.state).ok  # not only on the inputs it was checked on
    if NORM_FAMILIES[family]:  # every residual writer is mean-free along the stream
        assert len(result.centred) >= 5
        embedding = result.state["vit.embeddings.position_embeddings"].double()
        assert float(embedding.mean(-1).abs().max()) < 1e-6 < float(before[
            "vit.embeddings.position_embeddings"].double().mean(-1).abs().max())
    else:
        assert result.centred == []


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FOLDABLE))
def test_folded_residual_group_is_orthogonal_and_fuzzes_clean_at_two_shapes(family):
    subject = _folded64(family)
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert len(residual) == 1
    g = residual[0]
    assert g.kind == "orthogonal" and g.size == subject.model.config.hidden_size and g.copies == 1
    assert g.fixes_ones == FOLDABLE[family]
    assert not any(m.action == "permute" for m in g.members)  # norm weights are held at 1, not moved
    folded = {n.weight for n in find_norms(subject.capture)}  # no folded norm weight left to trade scale (in-block
    assert folded and not any(m.param in folded for x in subject.report.groups  # norms, as MLA's, keep theirs)
                              if x.motif == "scale_free" for m in x.members)
    other = symgraph.load(subject.model, zoo.example_inputs_for(family, subject.model, batch=3, seq=11, seed=2))
    for s in (subject, other):
        outcome = fuzz(s, groups=[g], samples=6)
        assert outcome.ok, outcome.failures


def test_the_layernorm_constraint_is_needed():
    """The full O(D) on a LayerNorm stream changes the function: the fuzz catches it, so Q 1 = +-1 is not decor."""
    subject = _folded64("vit")
    g = next(g for g in subject.report.groups if g.motif == "residual")
    outcome = fuzz(subject, groups=[dataclasses.replace(g, fixes_ones=False)], samples=6)
    assert not outcome.ok


def test_the_orthogonal_group_needs_the_folded_weights():
    """The folded model's O(D) applied to the unfolded model (norm weights not 1) changes its function."""
    subject = _subject("llama", torch.float64)
    g = next(g for g in _folded64("llama").report.groups if g.motif == "residual")
    element = sample(g, np.random.default_rng(0))
    assert not Evaluator(subject.model, subject.args, subject.kwargs).check(apply(subject.state_dict(),
                                                                                  [element])).ok


def test_unfolded_and_config_only_models_keep_permutations(tmp_path):
    subject = _subject("llama")
    kinds = {g.kind for g in subject.report.groups if g.motif == "residual"}
    assert kinds == {"signed_permutation"}
    assert any("norm weights are not 1" in n and "symgraph fold" in n for n in subject.report.notes)
    save_model(fold(subject).state, tmp_path / "folded", config=subject.config)
    with_weights = symgraph.load(tmp_path / "folded")
    assert {g.kind for g in with_weights.report.groups if g.motif == "residual"} == {"orthogonal"}
    meta = symgraph.load(tmp_path / "folded", config_only=True)  # no values: a weight of 1 cannot be known
    assert {g.kind for g in meta.report.groups if g.motif == "residual"} == {"signed_permutation"}
    assert any("without weights" in n for n in meta.report.notes)
    assert not any("residual stream" in n for n in with_weights.report.notes)


def test_constrained_procrustes_recovers_and_is_optimal():
    rng = np.random.default_rng(0)
    n = 6
    from symgraph.elements import random_orthogonal_fixing_ones

    q = random_orthogonal_fixing_ones(n, rng)
    assert np.allclose(q @ q.T, np.eye(n)) and np.allclose(np.abs(q @ np.ones(n)), np.ones(n))
    x = rng.standard_normal((n, 40))
    cross = x @ (q.T @ x).T  # anchor = Q^T x: Procrustes returns R with R^T x = anchor, so R = Q
    r = kernels.procrustes_fixing_ones(cross[None])[0]
    assert np.allclose(r, q, atol=1e-10)
    noisy = cross + rng.standard_normal((n, n))
    best = kernels.procrustes_fixing_ones(noisy[None])[0]
    assert np.allclose(np.abs(best @ np.ones(n)), np.ones(n))
    others = [random_orthogonal_fixing_ones(n, rng) for _ in range(200)]
    assert all(np.trace(best.T @ noisy) >= np.trace(o.T @ noisy) - 1e-9 for o in others)
    assert np.trace(kernels.procrustes(noisy[None])[0].T @ noisy) >= np.trace(best.T @ noisy) - 1e-9


@pytest.mark.parametrize("family", list(FOLDABLE))
def test_a_reparametrised_folded_model_is_recovered_exactly(family):
    subject = _folded64(family)
    anchor = subject.state_dict()
    source = apply(anchor, [sample(g, np.random.default_rng(3)) for g in subject.report.groups])
    result = align_states(subject.report.groups, source, anchor, mode="full")
    assert result.distance_before > 0.2
    assert result.distance_after < 1e-6, result.distance_after


def test_permutation_mode_aligns_a_folded_residual_by_its_permutations():
    subject = _folded64("vit")
    g = next(g for g in select_groups(subject.report.groups, "permutation") if g.motif == "residual")
    assert g.kind == "permutation" and g.global_sign
    outcome = fuzz(subject, groups=[g], samples=6)
    assert outcome.ok


@pytest.mark.parametrize("family,overrides,needle", [
    ("bert", {}, "bert.embeddings.LayerNorm"),  # post-LN: the norm's output is the residual stream
    ("llama-tied", {}, "tied"),  # lm_head is the embedding table: one fold cannot serve both
    ("torch-relu-mlp", {}, "nothing to fold"),  # no norm at all
])
def test_unfoldable_norms_are_refused_by_name(family, overrides, needle):
    subject = _subject(family)
    before = {k: v.clone() for k, v in subject.state_dict().items()}
    with pytest.raises(FoldError, match=needle):
        fold(subject, untie=False)  # a tied model folds once untied, as it is by default
    assert all(torch.equal(v, subject.state_dict()[k]) for k, v in before.items())
    if family == "bert":  # the report says why the residual stream keeps permutations
        assert any("cannot be folded" in n and "post-LN" in n for n in subject.report.notes)


def test_cli_fold_writes_a_loadable_equivalent_model_and_refuses_post_ln(tmp_path):
    import transformers

    source = f"{SHIPPED}/llama-chars-a"
    digest = tree_digest(source)
    res = run("fold", source, "-o", tmp_path / "folded", "--json", tmp_path / "fold.json")
    assert res.returncode == 0, res.stderr
    assert tree_digest(source) == digest
    summary = json.loads((tmp_path / "fold.json").read_text())
    assert len(summary["norms"]) == 7 and summary["centred"] == []  # 3 layers x 2 + the final norm; RMSNorm
    original = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded").eval()
    assert type(folded) is type(original)
    assert torch.equal(folded.model.norm.weight, torch.ones_like(folded.model.norm.weight))
    ids = torch.randint(3, 99, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(folded(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)

    refused = run("fold", f"{SHIPPED}/bert-topics-a", "-o", tmp_path / "bert")
    assert refused.returncode == 2 and "bert.embeddings.LayerNorm" in refused.stderr
    assert "post-LN" in refused.stderr and not (tmp_path / "bert").exists()


def test_cli_align_fold_recovers_a_transformed_folded_model(tmp_path):
    source = f"{SHIPPED}/vit-digits-a"
    assert run("fold", source, "-o", tmp_path / "folded").returncode == 0
    assert run("transform", tmp_path / "folded", "-o", tmp_path / "moved", "--seed", "2").returncode == 0
    res = run("align", tmp_path / "moved", source, "-o", tmp_path / "aligned", "--fold", "--quiet",
              "--stats", tmp_path / "stats.json")
    assert res.returncode == 0, res.stderr
    assert "folded" in res.stdout
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["distance_before"] > 0.3 and stats["distance_after"] < 1e-5
    assert any(v["kind"] == "orthogonal" and k.startswith("residual") for k, v in stats["groups"].items())


def test_an_aligning_merge_folds_by_default_and_keeps_the_first_models_function():
    a, b = (symgraph.load(zoo.build("llama", seed=s)) for s in (0, 1))
    result = symgraph.merge([a, b], weights=[1, 0], align="permutation", frame="reference",  # default: fold
                            progress=False)
    assert all(name.endswith("(folded)") for name in result.models)
    assert torch.equal(result.state["model.norm.weight"], torch.ones_like(result.state["model.norm.weight"]))
    assert Evaluator(a.model, a.args, a.kwargs).check(result.state).ok  # weight 1 on A: A's function
    assert pays_off(a) and pays_off(_subject("vit")) and not pays_off(_subject("bert"))  # post-LN cannot fold


class _AffineFreeNorm(torch.nn.Module):
    """A residual stream read only through a LayerNorm without weights: its group is {Q : Q 1 = +-1}, unfolded."""

    def __init__(self):
        super().__init__()
        self.inp, self.fc, self.out = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.norm = torch.nn.LayerNorm(8, elementwise_affine=False)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.fc(self.norm(h))
        return self.out(self.norm(h))


def test_a_layernorm_without_weights_gives_the_constrained_group_and_it_is_sound():
    """Before Group.fixes_ones the constraint was only a note, and the sampled full O(D) broke such models."""
    torch.manual_seed(0)
    model = _AffineFreeNorm().double()
    subject = symgraph.load(model, (torch.randn(4, 6, dtype=torch.float64),))
    g = next(g for g in subject.report.groups if g.motif == "residual")
    assert g.kind == "orthogonal" and g.fixes_ones and g.dof == 7 * 6 // 2
    for x in (torch.randn(4, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)):
        assert fuzz(symgraph.load(model, (x,)), groups=[g], samples=8).ok


# -- tied tensors: fold, its check, and merge's default ------------------------------------------------------------
@functools.cache
def _xlmr_xl(seed: int) -> torch.nn.Module:
    """A tiny XLMRobertaXLForCausalLM: its word embedding (a residual writer) is also the LM head's decoder, which
    reads the head's own LayerNorm, not the stream; norms and biases perturbed so nothing is trivially 1 or 0."""
    import transformers

    config = transformers.AutoConfig.for_model("xlm-roberta-xl", vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=32,
                                               max_position_embeddings=40, is_decoder=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 if p.dim() >= 2 else 0.1) * torch.randn(p.shape, generator=generator))
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    return model


def _difference(subject, state) -> float:
    """Relative float64 output change of ``subject``'s model when ``state`` is loaded into a fresh copy of it (as a
    user would: one tensor per tie, whichever name load_state_dict writes last)."""
    other = copy.deepcopy(subject.model).double()
    other.load_state_dict(state)
    reference = copy.deepcopy(subject.model).double()
    with torch.no_grad():
        out, ref = (m(*subject.args, **subject.kwargs).logits for m in (other, reference))
    return float((out - ref).norm() / ref.norm())


def test_a_tied_embedding_read_by_the_head_is_not_centred():
    """The centring path refuses a tied tensor with a use that is no residual write (before, fold centred the
    decoder's name alone and its check ran the unchanged embedding for both: 1.8e-2 on xlm-roberta-xl)."""
    model = _xlmr_xl(0)
    subject = symgraph.load(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        result = fold(subject)
    except FoldError as exc:
        assert "tied" in exc.message and "word_embeddings.weight" in exc.message and "decoder" in exc.message
    else:  # untied first (the default), folding it is fine too, as long as the model a user loads computes the same
        assert result.untied == ["lm_head.decoder.weight", "lm_head.decoder.bias"]
        assert _difference(untied(subject)[0], result.state) < 1e-6  # float32 weights, rounded once
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_fold_check_sees_a_centred_tied_head(monkeypatch):
    """Without the refusal, fold's own float64 check catches the change: the tied names hold the centred tensor
    both, as a loaded model would."""
    model = _xlmr_xl(0)
    monkeypatch.setattr(importlib.import_module("symgraph.fold"), "_check_only_writes", lambda cap, writes: None)
    with pytest.raises(InvarianceError, match="folded model differs"):
        fold(symgraph.load(model))


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_the_check_runs_the_changed_name_of_a_tie_and_refuses_names_changed_differently(name):
    """A model ties the names to one tensor: the name a state changed speaks for both. Before, once a float32 state
    was copied to float64 the check ran the first name's tensor for both, whichever was changed, and missed a change
    made under the second."""
    model = zoo.build("llama-tied", seed=0)
    evaluator = Evaluator(model, *zoo.example_inputs_for("llama-tied", model))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[name] += 0.5
    assert not evaluator.check(state).ok
    other = "model.embed_tokens.weight" if name == "lm_head.weight" else "lm_head.weight"
    differently = {**state, other: state[other] - 0.5}
    with pytest.raises(InvarianceError, match="tied names different values"):
        evaluator.check(differently)
    with pytest.raises(InvarianceError, match="tied names different values"):
        tie_aliases(model, differently)
    tied = tie_aliases(model, state)  # one name changed: the other follows
    assert tied[other] is tied[name] and not evaluator.check(tied).ok


class _SharedEmbedding(torch.nn.Module):
    """A pre-LN stack whose inputs are two lookups in one embedding table under two names (tied): every use of it
    writes into the residual stream, so it can be centred, under both names."""

    def __init__(self):
        super().__init__()
        self.tokens, self.pairs = torch.nn.Embedding(20, 8), torch.nn.Embedding(20, 8)
        self.pairs.weight = self.tokens.weight
        self.ln1, self.ln2 = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
        self.fc, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 5)

    def forward(self, ids, other):
        h = self.tokens(ids) + self.pairs(other)
        h = h + self.fc(self.ln1(h))
        return self.head(self.ln2(h))


def test_a_tied_tensor_used_only_as_residual_writes_is_centred_under_every_name():
    torch.manual_seed(0)
    model = _SharedEmbedding().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    inputs = (torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5)))
    result = fold(symgraph.load(model, inputs))
    assert torch.equal(result.state["tokens.weight"], result.state["pairs.weight"])
    assert float(result.state["tokens.weight"].mean(-1).abs().max()) < 1e-12
    loaded = copy.deepcopy(model)
    loaded.load_state_dict(result.state)
    with torch.no_grad():
        assert torch.allclose(loaded(*inputs), model(*inputs), rtol=1e-9, atol=1e-9)


def test_default_fold_falls_back_on_a_model_whose_norms_cannot_be_folded():
    """pays_off finds the norms; centring is refused only when fold runs: fold=None (not asked) then merges and
    aligns unfolded, saying why, while fold=True still refuses (ties kept: untied, the default, it folds)."""
    a, b = (symgraph.load(_xlmr_xl(s)) for s in (0, 1))
    assert pays_off(a, untie=False)
    result = symgraph.merge([a, b], weights=[1, 0], align="permutation", frame="reference", progress=False,
                            untie=False)
    assert not any(name.endswith("(folded)") for name in result.models)
    assert "norms not folded" in result.fold_note and "tied" in result.fold_note
    assert result.to_json()["fold_note"] == result.fold_note
    assert Evaluator(a.model, a.args, a.kwargs).check(result.state).ok  # weight 1 on A: A's function
    aligned = symgraph.align(b, a, mode="permutation", fold=None, untie=False)
    assert not aligned.folded and "tied" in aligned.fold_note
    with pytest.raises(FoldError, match="tied"):
        symgraph.merge([a, b], align="none", fold=True, progress=False, untie=False)
    aligned = symgraph.align(b, a, mode="permutation", fold=None)
    assert aligned.folded and aligned.untied == ["lm_head.decoder.bias", "lm_head.decoder.weight"]
    assert "lm_head.decoder.weight" in aligned.fold_note


def test_cli_merge_says_why_it_did_not_fold(tmp_path):
    """The fallback reaches the CLI: merge writes the unfolded merge, prints why and puts the note in --json."""
    for seed, name in ((0, "a"), (1, "b")):
        _xlmr_xl(seed).save_pretrained(tmp_path / name)
    code, stdout, stderr = run("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "out", "--align",
                               "permutation", "--frame", "reference", "--json", tmp_path / "merge.json", "--no-untie",
                               "--no-progress")
    assert code == 0, stderr
    assert "norms not folded" in stdout and "tied" in stdout
    assert "norms not folded" in json.loads((tmp_path / "merge.json").read_text())["fold_note"]
    assert (tmp_path / "out" / "config.json").exists()


# -- who reads the residual stream: through pass-throughs, and metadata only ---------------------------------------
class _SideReadStream(torch.nn.Module):
    """Pre-LN blocks whose final stream is read twice: by the final LayerNorm and, through a clone, by a linear
    with no norm in between (so centring the stream's writers would change that reader's output)."""

    def __init__(self, d: int = 8, vocab: int = 12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(2))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(2))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(2))
        self.final, self.head, self.side = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab), torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h))))
        return self.head(self.final(h)) + self.side(h.clone())


def _side_read(seed: int):
    torch.manual_seed(seed)
    model = _SideReadStream().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "final" in name:
                p.add_(0.2 * torch.randn_like(p))  # norm weights not 1, biases not 0: something to fold
    return symgraph.load(model, (torch.randint(0, 12, (2, 5)),))


def test_a_stream_read_through_a_pass_through_is_not_centred():
    """The readers of the stream are followed through casts and clones: until then the clone passed the check,
    centring went ahead and only the float64 check stopped it (InvarianceError), so merge's default crashed."""
    _refused_and_merged_unfolded(_side_read(0), _side_read(1), r"read by aten\.linear\.default .* without a LayerNorm")


def _refused_and_merged_unfolded(a, b, reason: str) -> None:
    """``fold`` refuses ``a`` for ``reason`` (a regex), and merge's default fold falls back: the merge with weights
    1, 0 is unfolded, says why, and computes what ``a`` computes."""
    with pytest.raises(FoldError, match=reason):
        fold(a)
    result = symgraph.merge([a, b], weights=[1, 0], align="permutation", frame="reference", progress=False)
    assert "norms not folded" in result.fold_note and re.search(reason, result.fold_note)
    assert Evaluator(a.model, a.args, a.kwargs).check(result.state).ok


class _MaxPooledStream(torch.nn.Module):
    """A pre-LN stream written by max pooling (Hiera pools its stream so): the values of an op with two outputs."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.norm, self.final = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
        self.mlp, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h.unflatten(1, (h.shape[1] // 2, 2)).max(dim=2).values
        h = h + self.mlp(self.norm(h))
        return self.head(self.final(h))


def _max_pooled(seed):
    torch.manual_seed(seed)
    model = _MaxPooledStream().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "final" in name:
                p.add_(0.2 * torch.randn_like(p))
    return symgraph.load(model, (torch.randn(2, 6, 4),))


def test_a_stream_written_by_one_output_of_a_multi_output_op_is_refused_not_crashed():
    """Hiera (sweep): fold read the rank of max's (values, indices) tuple and crashed with an AttributeError, and
    merge's default fold with it; max does not commute with centring, so the fold is refused and merge goes on."""
    _refused_and_merged_unfolded(_max_pooled(0), _max_pooled(1), r"written by .*getitem.*no parameter to centre")


def test_a_fold_failing_its_own_check_falls_back_unless_asked(monkeypatch):
    """A fold that its float64 check finds unsound (a bug, simulated here by a wrong centring) is refused like
    one that cannot be done: fold=None merges unfolded and says why; fold=True raises."""
    fold_module = importlib.import_module("symgraph.fold")  # symgraph.fold is also the function
    models = [zoo.build("vit", seed=seed) for seed in (0, 1)]
    a, b = (symgraph.load(model, zoo.example_inputs_for("vit", model)) for model in models)
    centred = fold_module._centred
    generator = torch.Generator().manual_seed(0)  # noise, not a constant: the LayerNorms would remove a constant
    monkeypatch.setattr(fold_module, "_centred", lambda state, targets: {
        name: value + 0.1 * torch.randn(value.shape, generator=generator)
        for name, value in centred(state, targets).items()})
    result = symgraph.merge([a, b], weights=[1, 0], align="permutation", frame="reference", progress=False)
    assert "norms not folded" in result.fold_note and "differs from" in result.fold_note
    assert Evaluator(a.model, a.args, a.kwargs).check(result.state).ok
    with pytest.raises(InvarianceError, match="folded model differs"):
        symgraph.merge([a, b], align="none", fold=True, progress=False)


@pytest.mark.parametrize("model_type", ["olmo", "olmo2"])
def test_readers_of_metadata_only_do_not_stop_a_fold(model_type):
    """OLMo's stream, and OLMo2's final norm output, are also read by aten._assert_tensor_metadata (a dtype
    assert: specs/ops.yaml rule ignore); those reads do not see values, so the norms fold and the folded model
    computes the same function (fold's float64 check, and here at a second shape)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, vocab_size=40, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                               max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    subject = symgraph.load(model, (torch.randint(0, 40, (2, 6)),))
    graph = subject.capture.graph
    assert any(str(n.target) == "aten._assert_tensor_metadata.default" for n in graph.nodes)
    result = fold(subject)
    assert result.norms and result.verified_error < 1e-5
    assert Evaluator(model, (torch.randint(0, 40, (3, 9)),), {}).check(result.state).ok


def _tiny_decoder(model_type: str, **overrides):
    """A tiny causal LM of ``model_type`` (2 layers, width 32, untied head), every parameter moved by noise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{
        **dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
               num_hidden_layers=2, vocab_size=60, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
               bos_token_id=2), **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _gemma():
    """A tiny untied Gemma in float64 (multi-query): its RMSNorms multiply by 1 + w, and the first one reads the
    embeddings scaled by sqrt(width)."""
    return _tiny_decoder("gemma", num_key_value_heads=1).double()


def _token_inputs(batch: int, seq: int, seed: int) -> dict:
    return {"input_ids": torch.randint(3, 60, (batch, seq), generator=torch.Generator().manual_seed(seed)),
            "use_cache": False}


def test_cli_folds_a_one_plus_w_model_whose_folder_reports_the_orthogonal_stream(tmp_path):
    model = _gemma().float()
    model.save_pretrained(tmp_path / "gemma")
    res = run("fold", tmp_path / "gemma", "-o", tmp_path / "folded", "--json", tmp_path / "fold.json")
    assert res.returncode == 0, res.stderr
    assert [n["weight"] for n in json.loads((tmp_path / "fold.json").read_text())["norms"]][-1] == "model.norm.weight"
    folded = symgraph.load(tmp_path / "folded")
    assert not folded.state_dict()["model.norm.weight"].any()
    assert {g.kind for g in folded.report.groups if g.motif == "residual"} == {"orthogonal"}


def test_one_plus_w_norms_fold_to_zero_weights_and_open_the_orthogonal_stream():
    model = _gemma()
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    assert {g.kind for g in subject.report.groups if g.motif == "residual"} == {"signed_permutation"}
    result = fold(subject)
    assert len(result.norms) == 2 * 2 + 1 and {n.offset for n in result.norms} == {1.0}  # the first one too
    assert all(not result.state[n.weight].any() for n in result.norms)  # 1 + 0: the norm multiplies by 1
    other = _token_inputs(3, 11, 5)
    assert Evaluator(model, (), other).check(result.state).ok
    folded = folded_subject(subject)
    residual = [g for g in folded.report.groups if g.motif == "residual"]
    assert [(g.kind, g.size) for g in residual] == [("orthogonal", 32)]
    for s in (folded, symgraph.load(folded.model, other)):
        outcome = fuzz(s, groups=residual, samples=6)
        assert outcome.ok, outcome.failures


def test_cli_folds_a_mixture_of_experts_folder_into_its_experts(tmp_path):
    """`symgraph fold` on a saved Mixtral: the norms fold into the dense experts and the routers, the folder loads
    with transformers and computes what the original does at another shape."""
    model = zoo.build("mixtral", seed=0)
    model.save_pretrained(tmp_path / "moe")
    res = run("fold", tmp_path / "moe", "-o", tmp_path / "folded", "--json", tmp_path / "fold.json")
    assert res.returncode == 0, res.stderr
    norms = json.loads((tmp_path / "fold.json").read_text())["norms"]
    assert len(norms) == 2 * 2 + 1
    folded = symgraph.load(tmp_path / "folded")
    state = folded.state_dict()
    assert all(torch.equal(state[n["weight"]], torch.ones_like(state[n["weight"]])) for n in norms)
    assert {g.kind for g in folded.report.groups if g.motif == "residual"} == {"orthogonal"}
    other = zoo.example_inputs_for("mixtral", model, batch=3, seq=11, seed=5)
    assert Evaluator(model, *other).check(state).ok


@pytest.mark.parametrize("family,axis", [("mixtral", 2), ("gpt-oss", 1)])
def test_dense_experts_absorb_the_norm_along_the_axis_their_einsum_contracts(family, axis):
    """(experts, out, in) for Mixtral, (experts, in, out) for GPT-OSS: the fold scales the contracted axis."""
    subject = _subject(family)
    readers = {r.weight: r.axis for n in find_norms(subject.capture) for r in n.readers}
    experts = [w for w in readers if w.endswith("experts.gate_up_proj")]
    assert len(experts) == 2 and all(readers[w] == axis for w in experts)
    result = fold(subject)
    other = zoo.example_inputs_for(family, subject.model, batch=3, seq=11, seed=5)
    assert result.verified_error < 1e-4 and Evaluator(subject.model, *other).check(result.state).ok


def test_a_norm_weight_cast_before_its_product_folds():
    """Helium's RMSNorm computes ``weight.to(float32) * x``: the cast weight is found (the report's note about the
    residual stream crashed on it before) and folds."""
    model = _tiny_decoder("helium")
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    assert any("symgraph fold" in n for n in subject.report.notes)
    result = fold(subject)
    assert len(result.norms) == 2 * 2 + 1 and result.verified_error < 1e-4
    assert Evaluator(model, (), _token_inputs(3, 11, 5)).check(result.state).ok


def _tiny_causal_lm(model_type: str, tie: bool = False, **config):
    """A tiny causal LM in float64 (untied unless ``tie``) with every parameter moved by noise (LayerNorm weights
    and biases too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type, vocab_size=60, tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        **config)).eval().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


UNUSUAL_READERS = {  # norms read through Conv1D's addmm, x @ W.T, or linears without the bias a LayerNorm bias needs
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bias=False),
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     rotary_pct=0.5, max_position_embeddings=64),
}


@pytest.mark.parametrize("model_type", list(UNUSUAL_READERS))
def test_norms_read_by_conv1d_matmul_or_bias_free_linears_fold_to_the_constrained_stream(model_type):
    model = _tiny_causal_lm(model_type, **UNUSUAL_READERS[model_type])
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    result = fold(subject)
    assert result.verified_error < 1e-10 and len(result.norms) >= 3, result.to_json()
    kept = [n for n in result.norms if n.keeps_bias]
    if model_type != "gpt2":  # bias-free readers: the LayerNorm keeps its bias (over its weight), not zeros
        assert kept and all(result.state[n.bias].abs().max() > 0 for n in kept)
    assert all(torch.all(result.state[n.weight] == 1) for n in result.norms)
    folded = folded_subject(subject)
    stream = [g for g in folded.report.groups if g.motif == "residual"]
    assert [(g.kind, g.fixes_ones) for g in stream] == [("orthogonal", True)], stream
    if kept:
        assert {n.bias for n in kept} <= {m.param for m in stream[0].members}  # the kept biases move with it
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


def test_a_kept_layernorm_bias_over_a_zero_weight_is_refused_and_nothing_changes():
    model = _tiny_causal_lm("gpt_neox", **UNUSUAL_READERS["gpt_neox"])
    with torch.no_grad():
        model.gpt_neox.final_layer_norm.weight[3] = 0.0  # read by the bias-free head: its bias stays
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    before = {k: v.clone() for k, v in subject.state_dict().items()}
    with pytest.raises(FoldError, match="final_layer_norm.*has zeros"):
        fold(subject)
    assert all(torch.equal(v, subject.state_dict()[k]) for k, v in before.items())


TIED = {"gpt2": UNUSUAL_READERS["gpt2"],  # LayerNorm: the tied embedding is centred once untied
        "llama": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)}


@pytest.mark.parametrize("model_type", list(TIED))
def test_untie_lets_the_final_norm_fold_into_a_tied_head_and_opens_the_stream(model_type):
    model = _tiny_causal_lm(model_type, tie=True, **TIED[model_type])
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    with pytest.raises(FoldError, match="tied") as refused:
        fold(subject, untie=False)
    assert "--untie" in refused.value.hint
    result = fold(subject)  # untied by default where the tie keeps the final norm from folding
    assert result.untied == ["lm_head.weight"] and result.verified_error < 1e-10
    assert result.config.tie_word_embeddings is False and model.config.tie_word_embeddings is True
    assert not torch.equal(result.state["lm_head.weight"], result.state[next(
        k for k in result.state if k.endswith(("wte.weight", "embed_tokens.weight")))])
    assert head is embedding and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    folded = folded_subject(subject)
    assert untied_by_fold(model, folded.model) == ["lm_head.weight"]
    stream = [g for g in folded.report.groups if g.motif == "residual"]
    assert [(g.kind, g.fixes_ones) for g in stream] == [("orthogonal", model_type == "gpt2")], stream
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


def test_cli_fold_unties_by_default_writes_an_untied_equivalent_folder_and_with_no_untie_says_how(tmp_path):
    import transformers

    model = _tiny_causal_lm("gpt2", tie=True, **TIED["gpt2"]).float()
    model.save_pretrained(tmp_path / "gpt2")
    digest = tree_digest(tmp_path / "gpt2")
    refused = run("fold", tmp_path / "gpt2", "-o", tmp_path / "refused", "--no-untie")
    assert refused.returncode == 2 and "--untie" in refused.stderr and not (tmp_path / "refused").exists()
    res = run("fold", tmp_path / "gpt2", "-o", tmp_path / "folded", "--json", tmp_path / "fold.json")
    assert res.returncode == 0, res.stderr
    assert "tied weights untied: lm_head.weight;" in res.stdout and tree_digest(tmp_path / "gpt2") == digest
    assert json.loads((tmp_path / "fold.json").read_text())["untied"] == ["lm_head.weight"]
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded").eval()
    assert folded.config.tie_word_embeddings is False
    assert folded.lm_head.weight.data_ptr() != folded.transformer.wte.weight.data_ptr()
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(folded(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def _tied_gpt2_pair(tmp_path):
    for seed in (0, 1):
        model = _tiny_causal_lm("gpt2", tie=True, **TIED["gpt2"]).float()
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(tmp_path / f"m{seed}")
    return tmp_path / "m0", tmp_path / "m1"


def test_cli_merge_unties_and_folds_tied_models_by_default_and_writes_an_untied_merge(tmp_path):
    import transformers

    a, b = _tied_gpt2_pair(tmp_path)
    code, stdout, stderr = run("merge", a, b, "-o", tmp_path / "tied", "--align", "permutation", "--no-untie")
    assert code == 0 and "norms not folded" in stdout and "--untie" in stdout, stderr
    kept = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    assert kept.config.tie_word_embeddings is True and kept.lm_head.weight is kept.transformer.wte.weight
    # without alignment nothing gains from untying or folding: a soup of tied models keeps its ties and norms
    code, stdout, stderr = run("merge", a, b, "-o", tmp_path / "soup", "--align", "none")
    assert code == 0 and "folded" not in stdout and "untied" not in stdout, stderr
    soup = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "soup")
    assert soup.config.tie_word_embeddings is True
    code, stdout, stderr = run("merge", a, b, "-o", tmp_path / "out", "--align", "permutation")
    assert code == 0 and "norms folded first" in stdout, stderr
    assert "tied weights untied so the norm they read folds: lm_head.weight" in stdout
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert merged.config.tie_word_embeddings is False
    assert not torch.equal(merged.lm_head.weight, merged.transformer.wte.weight)
    assert torch.all(merged.transformer.ln_f.weight == 1)
    refused = run("merge", a, b, "-o", tmp_path / "refused", "--untie", "--no-fold")
    assert refused.returncode == 2 and "--no-fold" in refused.stderr and not (tmp_path / "refused").exists()


def test_cli_align_fold_untie_writes_an_untied_folded_model_that_loads_and_computes_the_same(tmp_path):
    import transformers

    a, b = _tied_gpt2_pair(tmp_path)
    digests = [tree_digest(path) for path in (a, b)]
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--fold", "--untie", "--mode", "permutation",
                               "--stats", tmp_path / "stats.json")
    assert code == 0, stderr
    assert "folded, tied weights untied: lm_head.weight" in stdout
    assert [tree_digest(path) for path in (a, b)] == digests
    assert json.loads((tmp_path / "stats.json").read_text())["untied"] == ["lm_head.weight"]
    aligned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert aligned.config.tie_word_embeddings is False and torch.all(aligned.transformer.ln_f.weight == 1)
    assert not torch.equal(aligned.lm_head.weight, aligned.transformer.wte.weight)
    ids = torch.randint(3, 60, (2, 11), generator=torch.Generator().manual_seed(0))
    source = transformers.AutoModelForCausalLM.from_pretrained(b).eval()
    with torch.no_grad():
        assert torch.allclose(aligned(ids).logits, source(ids).logits, atol=1e-4, rtol=1e-4)
    refused = run("align", b, a, "-o", tmp_path / "refused", "--untie")
    assert refused.returncode == 2 and "--fold" in refused.stderr and not (tmp_path / "refused").exists()


def test_barrier_unties_by_default_and_runs_between_the_folded_untied_models(tmp_path):
    from symgraph.connectivity import barrier
    from symgraph.datasets import Batch, Dataset

    a, b = _tied_gpt2_pair(tmp_path)
    ids = torch.randint(3, 60, (4, 9), generator=torch.Generator().manual_seed(0))
    data = Dataset("tokens", "causal_lm", (Batch({"input_ids": ids, "labels": ids}),))
    result = barrier(a, b, data, steps=3, aligns=("none",), untie=True, progress=False)
    assert all(name.endswith("(folded)") for name in result.models) and not result.fold_note
    by_default = barrier(a, b, data, steps=3, aligns=("none",), progress=False)
    assert by_default.models == result.models and "lm_head.weight" in by_default.fold_note
    assert np.allclose(by_default.curves["none"].losses, result.curves["none"].losses)
    ends = result.curves["none"].losses
    reference = [float(transformers_loss(path, ids)) for path in (a, b)]
    assert np.allclose([ends[0], ends[-1]], reference, rtol=1e-4)


def transformers_loss(path, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss


def test_a_norm_read_through_a_number_folds_into_the_linear_after_it():
    """MiniCPM3 divides the final norm's output by a number before the LM head: the norm's weight still folds."""
    model = _tiny_causal_lm("minicpm3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=64, q_lora_rank=16, kv_lora_rank=8,
                            qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64)
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    assert any(str(n.target) == "aten.div.Tensor" and "lm_head" not in n.name for n in subject.capture.graph.nodes)
    result = fold(subject)
    assert "model.norm.weight" in [n.weight for n in result.norms] and result.verified_error < 1e-10
    folded = folded_subject(subject)
    assert [g.kind for g in folded.report.groups if g.motif == "residual"] == ["orthogonal"]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


class _ScaledHead(torch.nn.Module):
    """An embedding, one norm (LayerNorm with a bias, or RMSNorm) and a head reading the norm's output / 4."""

    def __init__(self, norm):
        super().__init__()
        self.emb, self.norm, self.head = torch.nn.Embedding(12, 8), norm, torch.nn.Linear(8, 12)
        with torch.no_grad():
            for p in self.norm.parameters():
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)) / 4.0)


def test_a_number_between_norm_and_reader_folds_a_weight_but_never_a_bias():
    torch.manual_seed(0)
    ids = (torch.randint(0, 12, (2, 5)),)
    rms = symgraph.load(_ScaledHead(torch.nn.RMSNorm(8)).double(), ids)
    assert fold(rms).verified_error < 1e-12
    layer_norm = symgraph.load(_ScaledHead(torch.nn.LayerNorm(8)).double(), ids)
    with pytest.raises(FoldError, match="aten.div.Tensor"):  # its bias would need dividing by the number too
        fold(layer_norm)


class _PowRMSNorm(torch.nn.Module):
    """Gemma 4's RMSNorm: ``x * pow(mean(x^2) + eps, -0.5) * w`` (pow, not rsqrt, to match JAX)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * self.weight


class _RMSNormBlocks(torch.nn.Module):
    """Pre-norm residual blocks normed by ``norm`` (torch.nn.RMSNorm, the aten.rms_norm op, or a hand-written one)."""

    def __init__(self, norm=torch.nn.RMSNorm, d: int = 8, vocab: int = 12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(norm(d) for _ in range(2))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(2))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(2))
        self.final, self.head = norm(d), torch.nn.Linear(d, vocab)
        with torch.no_grad():
            for p in [*self.norms.parameters(), *self.final.parameters()]:
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        h = self.emb(ids)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h))))
        return self.head(self.final(h))


@pytest.mark.parametrize("norm,op", [(torch.nn.RMSNorm, "aten.rms_norm.default"),
                                     (_PowRMSNorm, "aten.pow.Tensor_Scalar")])
def test_rms_norm_ops_and_pow_norms_fold_and_open_the_orthogonal_stream(norm, op):
    torch.manual_seed(0)
    subject = symgraph.load(_RMSNormBlocks(norm).double(), (torch.randint(0, 12, (2, 5)),))
    ops = [n for n in subject.capture.graph.nodes if str(n.target) == op]
    assert len([n for n in ops if n.args[-1] == -0.5 or op != "aten.pow.Tensor_Scalar"]) == 3
    assert [g.kind for g in subject.report.groups if g.motif == "residual"] != ["orthogonal"]
    result = fold(subject)
    assert len(result.norms) == 3 and result.verified_error < 1e-12
    folded = folded_subject(subject)
    assert all(bool((folded.model.state_dict()[n.weight] == 1).all()) for n in result.norms)
    assert [g.kind for g in folded.report.groups if g.motif == "residual"] == ["orthogonal"]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


class _SandwichBlocks(_RMSNormBlocks):
    """Gemma's sandwich norms: each block's output is normed (a weight, no linear after it) before the residual add."""

    def __init__(self):
        super().__init__(_PowRMSNorm)
        self.posts = torch.nn.ModuleList(_PowRMSNorm(8) for _ in range(2))
        with torch.no_grad():
            for p in self.posts.parameters():
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        h = self.emb(ids)
        for norm, up, down, post in zip(self.norms, self.ups, self.downs, self.posts):
            h = h + post(down(torch.relu(up(norm(h)))))
        return self.head(self.final(h))


def test_a_folded_model_whose_stream_stays_permutations_is_not_told_to_fold_again():
    torch.manual_seed(0)
    subject = symgraph.load(_SandwichBlocks().double(), (torch.randint(0, 12, (2, 5)),))
    assert any("norm weights are not 1" in n for n in subject.report.notes)
    folded = folded_subject(subject)
    assert [g.kind for g in folded.report.groups if g.motif == "residual"] != ["orthogonal"]
    note = next(n for n in folded.report.notes if n.startswith("residual stream"))
    assert "although its norms are folded" in note and "limited by" in note and "symgraph fold" not in note
    assert fuzz(folded, samples=4).ok


class _WeightlessRMSNorm(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _GatedStreamNorm(_RMSNormBlocks):
    """Norms with weights that read a gated product of the stream, never the stream itself."""

    def forward(self, ids):
        h = self.emb(ids)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h * torch.sigmoid(h)))))
        return self.head(self.final(h * torch.sigmoid(h)))


class _InPlaceEmbeddingSum(_RMSNormBlocks):
    """Megatron-BERT's embeddings: ``h = words + types; h += positions`` (an in-place sum) read by the first norm."""

    def __init__(self, norm):
        super().__init__(norm)
        self.pos = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        h = self.emb(ids) + 0.5 * self.emb(ids.flip(-1))
        h += self.pos(torch.arange(ids.shape[-1]))
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h))))
        return self.head(self.final(h))


def test_a_norm_reading_embeddings_summed_in_place_folds_and_the_stream_is_centred():
    torch.manual_seed(0)
    subject = symgraph.load(_InPlaceEmbeddingSum(torch.nn.LayerNorm).double(), (torch.randint(0, 12, (2, 5)),))
    assert any(str(n.target) == "aten.add_.Tensor" for n in subject.capture.graph.nodes)
    result = fold(subject)
    assert len(result.norms) == 3 and result.verified_error < 1e-12 and {"emb.weight", "pos.weight"} <= set(
        result.centred)
    folded = folded_subject(subject)
    assert [(g.kind, g.fixes_ones) for g in folded.report.groups if g.motif == "residual"] == [("orthogonal", True)]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


@pytest.mark.parametrize("model,needle", [
    (lambda: _RMSNormBlocks(_WeightlessRMSNorm), "without a weight to fold"),
    (lambda: _GatedStreamNorm(_PowRMSNorm), "has norms with weights (3, the first norms.0.weight, graph node"),
    (lambda: torch.nn.Sequential(torch.nn.Embedding(12, 8), torch.nn.Linear(8, 12)), "has no norm on a residual"),
])
def test_nothing_to_fold_says_which_case_it_is(model, needle):
    torch.manual_seed(0)
    with pytest.raises(FoldError) as caught:
        fold(symgraph.load(model().double(), (torch.randint(0, 12, (2, 5)),)))
    assert needle in caught.value.message and "nothing" in caught.value.message


class _WrittenLayerNorm(torch.nn.Module):
    """Cohere's LayerNorm, written out: ``(x - mean(x)) * rsqrt(var(x) + eps) * w``, no bias."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(variance + 1e-5))


class _MeanReadStream(_RMSNormBlocks):
    """The stream's mean also reaches the output directly: centring the writers would change it."""

    def forward(self, ids):
        h = self.emb(ids)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h))))
        return self.head(self.final(h)) + h.mean(-1, keepdim=True)


def test_a_written_out_layernorm_folds_and_centres_the_stream_it_reads():
    torch.manual_seed(0)
    subject = symgraph.load(_RMSNormBlocks(_WrittenLayerNorm).double(), (torch.randint(0, 12, (2, 5)),))
    result = fold(subject)
    assert len(result.norms) == 3 and all(n.centres for n in result.norms) and result.verified_error < 1e-12
    assert set(result.centred) == {"emb.weight", "downs.0.weight", "downs.0.bias", "downs.1.weight", "downs.1.bias"}
    folded = folded_subject(subject)
    state = folded.model.state_dict()
    assert float(state["emb.weight"].mean(-1).abs().max()) < 1e-12 and abs(float(state["downs.1.bias"].mean())) < 1e-12
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2
    torch.manual_seed(0)
    with pytest.raises(FoldError, match="Cannot centre the residual stream"):
        fold(symgraph.load(_MeanReadStream(_WrittenLayerNorm).double(), (torch.randint(0, 12, (2, 5)),)))


def test_a_layernorm_mixture_of_experts_centres_its_experts_down_projections():
    """PhiMoE (LayerNorm, dense experts): the stream is written by the einsum mixing the experts' outputs, which
    the down projections' einsum writes; centring those centres the mixture."""
    model = _tiny_causal_lm("phimoe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=64)
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    result = fold(subject)
    assert result.verified_error < 1e-10
    assert [c for c in result.centred if c.endswith("experts.down_proj")] == [
        f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)]
    folded = folded_subject(subject)
    assert [(g.kind, g.fixes_ones) for g in folded.report.groups if g.motif == "residual"] == [("orthogonal", True)]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


class _EinsumWriter(torch.nn.Module):
    """Pre-LN blocks whose stream is written by an einsum: ``btf,df->btd`` (linear in the weight along d) or
    ``btd,d->btd`` (a product: both operands vary along d, so centring one would not centre the output)."""

    def __init__(self, equation: str, d: int = 8, vocab: int = 12):
        super().__init__()
        self.equation = equation
        self.emb, self.norm, self.final = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.up, self.head = torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)
        self.w = torch.nn.Parameter(torch.randn(d, d) / 3 if "df" in equation else torch.rand(d) + 0.5)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + torch.einsum(self.equation, torch.relu(self.up(self.norm(h))), self.w)
        return self.head(self.final(h))


@pytest.mark.parametrize("equation,centred", [("btf,df->btd", True), ("btd,d->btd", False)])
def test_an_einsum_writer_is_centred_only_where_the_output_is_linear_in_one_operand(equation, centred):
    torch.manual_seed(0)
    subject = symgraph.load(_EinsumWriter(equation).double(), (torch.randint(0, 12, (2, 5)),))
    if centred:
        result = fold(subject)
        assert "w" in result.centred and result.verified_error < 1e-12
    else:
        with pytest.raises(FoldError, match="aten.einsum.default"):
            fold(subject)


class _ScaledEmbeddings(torch.nn.Module):
    """Pre-LN blocks whose embeddings are multiplied by sqrt(width) (Pegasus, BioGPT) and have 0 added where a
    model has no token types (CTRL): centring the embedding table centres what is written."""

    def __init__(self, d: int = 8, vocab: int = 12):
        super().__init__()
        self.emb, self.norm, self.final = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.up, self.down, self.head = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d), torch.nn.Linear(d, vocab)
        with torch.no_grad():
            for p in [*self.norm.parameters(), *self.final.parameters()]:
                p.add_(0.3 * torch.randn_like(p))

    def forward(self, ids):
        h = self.emb(ids) * 8 ** 0.5 + 0
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(self.final(h))


def test_embeddings_scaled_by_a_number_are_centred_and_an_added_zero_is_no_constant():
    torch.manual_seed(0)
    subject = symgraph.load(_ScaledEmbeddings().double(), (torch.randint(0, 12, (2, 5)),))
    result = fold(subject)
    assert {"emb.weight", "down.weight", "down.bias"} <= set(result.centred) and result.verified_error < 1e-12
    folded = folded_subject(subject)
    assert [(g.kind, g.fixes_ones) for g in folded.report.groups if g.motif == "residual"] == [("orthogonal", True)]
    assert fuzz(folded, samples=4).ok


def test_a_per_head_norm_after_rotary_is_no_stream_norm():
    """Hunyuan normalises queries and keys per head after the rotary embedding, whose halves are summed: that sum
    is no residual stream, so the norm stays (it was taken for a stream norm and refused the fold)."""
    model = _tiny_causal_lm("hunyuan_v1_dense", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, head_dim=8, max_position_embeddings=64)
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    result = fold(subject)
    assert not any("layernorm" in n.weight and "self_attn" in n.weight for n in result.norms)
    assert len(result.norms) == 5 and result.verified_error < 1e-10  # 2 per layer and the final one
    folded = folded_subject(subject)
    assert [g.kind for g in folded.report.groups if g.motif == "residual"] == ["orthogonal"]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


def test_dbrx_experts_stacked_in_rows_absorb_the_norm_and_centre_the_stream():
    """DBRX keeps each expert's rows of w1, v1, w2 in one 2-D weight, viewed per expert by the dense layout
    (symgraph.moe): the view keeps the contracted axis, so the weight absorbs the norm along it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("dbrx", d_model=32, n_heads=4, n_layers=2, vocab_size=60, max_seq_len=64,
                                  attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                  ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))
    model = AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    subject = symgraph.load(model, _token_inputs(2, 7, 0))
    result = fold(subject)
    readers = {r.weight.rsplit(".", 1)[-1] for n in result.norms for r in n.readers}
    assert {"w1", "v1"} <= readers and result.verified_error < 1e-10
    assert any(c.endswith("mlp.w2") for c in result.centred)
    folded = folded_subject(subject)
    assert [(g.kind, g.fixes_ones) for g in folded.report.groups if g.motif == "residual"] == [("orthogonal", True)]
    checked = fuzz(folded, samples=4)
    assert checked.ok and len(set(checked.shapes)) >= 2


def test_an_unaligned_merge_averages_the_weights_as_stored_as_the_streamed_merge_does(tmp_path):
    """Without alignment a fold's larger group serves nothing and would change what is averaged (W diag(g), not W
    and g apart): merge --align none leaves the norms in place, equal to --stream's plain average; --fold still
    folds when asked."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(tmp_path / f"m{seed}")
        folders.append(tmp_path / f"m{seed}")
    for out, extra in (("soup", []), ("streamed", ["--stream"]), ("folded", ["--fold"])):
        code, stdout, stderr = run("merge", *folders, "-o", tmp_path / out, "--align", "none", "--no-progress", *extra)
        assert code == 0, stderr
        assert ("folded" in stdout) == (out == "folded"), stdout
    a, b, soup, streamed, folded = (load_file(f / "model.safetensors") for f in (
        *folders, tmp_path / "soup", tmp_path / "streamed", tmp_path / "folded"))
    for name in a:
        torch.testing.assert_close(soup[name], (a[name] + b[name]) / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(soup[name], streamed[name], rtol=0, atol=1e-6)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(soup[norm], torch.ones_like(soup[norm])) and torch.all(folded[norm] == 1)
