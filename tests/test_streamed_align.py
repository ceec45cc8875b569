"""Streamed, block-by-block alignment (symgraph.streamed_align): the same result as the in-memory aligner where
the two algorithms coincide, exact recovery of a reparametrised copy, atomic output, inputs left unchanged."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import symgraph
from symgraph import streamed_align, zoo
from symgraph.alignment import align_states, select_groups
from symgraph.errors import InvarianceError, MismatchError
from symgraph.fold import FoldError
from symgraph.lazy_state import LazyState
from symgraph.verify import Outcome

from cli_runner import run, tree_digest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import make_llama_7b_pair  # noqa: E402

TINY = ["--hidden-size", "64", "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
        "--intermediate-size", "96", "--vocab-size", "64", "--shard-gb", "0.00005"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A (norms 1: orthogonal residual stream), B1 (A moved by a random group element, no noise), B2 (independent),
    float64, sharded."""
    out = tmp_path_factory.mktemp("gen") / "pair"
    make_llama_7b_pair.main(["--out", str(out), "--dtype", "float64", "--noise", "0", *TINY])
    return out


@pytest.fixture(scope="module")
def zoo_pair(tmp_path_factory):
    """Two independent zoo LLaMAs (norm weights not 1: signed-permutation residual stream), float32, one file."""
    from symgraph.io import model_config, save_model

    root = tmp_path_factory.mktemp("zoo")
    return [save_model(m.state_dict(), root / f"m{i}", config=model_config(m))
            for i, m in enumerate(zoo.build("llama", seed=s) for s in (0, 1))]


def in_memory(source, anchor, mode):
    """The in-memory aligner's first pass (no descent, one start): what the streamed path runs per block."""
    src, anc = symgraph.load(source), symgraph.load(anchor)
    groups = select_groups(src.report.groups, mode)
    return align_states(groups, src.state_dict(), anc.state_dict(), mode=mode, rounds=0, matching_start=False)


def same_elements(a, b) -> bool:
    key = lambda e: e.group.id  # noqa: E731
    if sorted(map(key, a)) != sorted(map(key, b)):
        return False
    by_id = {e.group.id: e for e in b}
    for e in a:
        f = by_id[e.group.id]
        for x, y in ((e.matrices, f.matrices), (e.perm, f.perm), (e.diag, f.diag)):
            if (x is None) != (y is None) or (x is not None and not np.allclose(x, y, atol=1e-9)):
                return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("partner, mode", [("B2", "full"), ("B2", "paper"), ("B1", "permutation")])
def test_streamed_alignment_equals_the_in_memory_first_pass(tmp_path, pair, partner, mode):
    result = streamed_align.align_streamed(pair / partner, pair / "A", tmp_path / "out", mode=mode, rounds=0)
    expected = in_memory(pair / partner, pair / "A", mode)
    assert same_elements(result.elements, expected.elements)
    assert result.distance_before == pytest.approx(expected.distance_before, rel=1e-12)
    assert result.distance_after == pytest.approx(expected.distance_after, rel=1e-9)
    written = LazyState(result.path)
    for name in written:
        assert torch.allclose(written[name], expected.state[name], atol=1e-12), name
    assert result.verified_error < result.verified_tolerance


@pytest.mark.slow
def test_paper_mode_equals_the_in_memory_paper_mode_on_a_zoo_model(tmp_path, zoo_pair):
    b, a = zoo_pair[1], zoo_pair[0]
    result = streamed_align.align_streamed(b, a, tmp_path / "out", mode="paper")
    expected = symgraph.align(b, a, mode="paper")
    assert same_elements(result.elements, expected.elements)
    assert result.distance_after == pytest.approx(expected.distance_after, rel=1e-6)
    assert result.distance_after < result.distance_before


@pytest.mark.slow
def test_full_mode_brings_a_reparametrised_copy_back_exactly(tmp_path, pair):
    result = streamed_align.align_streamed(pair / "B1", pair / "A", tmp_path / "out", mode="full")
    assert result.distance_before > 0.1
    assert result.distance_after < 1e-12
    assert not result.unsolved and any(s.group.startswith("residual") for s in result.stats)


@pytest.fixture(scope="module")
def noisy_pair(tmp_path_factory):
    """A and B1 = A moved by a group element plus 1% noise on every tensor (norm weights too: B1 is not folded)."""
    out = tmp_path_factory.mktemp("noisy") / "pair"
    make_llama_7b_pair.main(["--out", str(out), "--dtype", "float64", "--models", "A,B1", *TINY])
    return out


@pytest.mark.slow
def test_folded_streaming_equals_in_memory_folding_and_reaches_the_noise_floor(tmp_path, noisy_pair):
    """B1's norm weights carry noise, so only folding gives its stream the orthogonal group that undoes the
    rotation; read folded, the streamed first pass is the in-memory one after symgraph.fold."""
    b1, a = noisy_pair / "B1", noisy_pair / "A"
    with pytest.raises(MismatchError, match="fold both"):  # unfolded, B1 has a smaller group than A
        streamed_align.align_streamed(b1, a, tmp_path / "plain", mode="full", rounds=0)
    result = streamed_align.align_streamed(b1, a, tmp_path / "out", mode="full", rounds=0, fold=True)
    expected = symgraph.align(b1, a, mode="full", fold=True, refine_rounds=0, matching_start=False)
    assert result.folded and same_elements(result.elements, expected.elements)
    assert result.distance_after == pytest.approx(expected.distance_after, rel=1e-9)
    assert result.distance_after < 0.03 < 0.3 < result.distance_before  # 1% noise per tensor: the noise floor
    written = LazyState(result.path)
    assert all(bool((written[k] == 1).all()) for k in written if k.endswith("norm.weight"))
    assert result.verified_error < result.verified_tolerance


@pytest.mark.slow
def test_bf16_checkpoints_stay_bf16_and_the_descent_never_ends_farther(tmp_path, pair):
    """Stored dtype kept; descent inside each block only lowers the distance; a permutation-mode run on
    independent models is verified with bf16's tolerance."""
    root = tmp_path / "bf16"
    make_llama_7b_pair.main(["--out", str(root), "--dtype", "bfloat16", "--models", "A,B2", *TINY])
    first = streamed_align.align_streamed(root / "B2", root / "A", tmp_path / "o0", mode="permutation", rounds=0)
    descended = streamed_align.align_streamed(root / "B2", root / "A", tmp_path / "o8", mode="permutation")
    assert {info.dtype for info in LazyState(descended.path).infos()} == {torch.bfloat16}
    assert descended.distance_after <= first.distance_after < first.distance_before
    assert descended.verified_error < descended.verified_tolerance


def test_a_failed_check_leaves_nothing_at_out_and_the_inputs_unchanged(tmp_path, pair, monkeypatch):
    import symgraph.streamed_verify as streamed_verify

    before = [tree_digest(pair / name) for name in ("A", "B2")]
    monkeypatch.setattr(streamed_verify, "verify_streamed", lambda *_, **__: Outcome(0.5, 1e-6))
    with pytest.raises(InvarianceError, match="nothing was written"):
        streamed_align.align_streamed(pair / "B2", pair / "A", tmp_path / "out", mode="paper")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert [tree_digest(pair / name) for name in ("A", "B2")] == before


def test_a_bf16_result_past_its_tolerance_passes_only_as_an_exact_result_rounded(tmp_path, monkeypatch):
    """A model more sensitive to rounding than bf16's fixed 3e-2 allows (the tolerance lowered here, as such a
    checkpoint would meet it): its exact folded alignment passes because its elements applied in float64 compute
    what the source computes and every written tensor is within two roundings of theirs; a written tensor moved
    by three roundings, or elements missing one group's, are refused."""
    from safetensors.torch import load_file, save_file

    from symgraph.streamed_verify import _block_list, verify_streamed
    from symgraph.verify import ROUNDINGS, TOLERANCE

    root = tmp_path / "bf16"
    make_llama_7b_pair.main(["--out", str(root), "--dtype", "bfloat16", "--models", "A,B1", *TINY])
    source, anchor = root / "B1", root / "A"
    fixed = streamed_align.align_streamed(source, anchor, tmp_path / "fixed", mode="full", fold=True)
    assert fixed.verified_rounded is None and 1e-4 < fixed.verified_error < TOLERANCE[torch.bfloat16]
    monkeypatch.setitem(TOLERANCE, torch.bfloat16, 1e-6)
    result = streamed_align.align_streamed(source, anchor, tmp_path / "out", mode="full", fold=True)
    rounded = result.verified_rounded
    assert result.verified_error == pytest.approx(fixed.verified_error) and result.verified_error > 1e-4
    assert rounded.ok and rounded.exact_error < 1e-6 and 0.1 < rounded.roundings < 1

    cli = run("align", source, anchor, "-o", tmp_path / "cli", "--stream", "--fold", "--stats", tmp_path / "s.json")
    assert cli.returncode == 0, cli.stderr
    assert "past the fixed tolerance, but computed without rounding" in cli.stdout
    assert json.loads((tmp_path / "s.json").read_text())["verified_rounded_exact"]["roundings"] <= ROUNDINGS

    model, config, _, norms, *_ = streamed_align.streamed_groups(source, fold=True)
    exact = streamed_align.ExactResult(LazyState(source), result.elements, list(_block_list(model, config)), norms)
    assert verify_streamed(source, result.path, exact=exact).ok
    moved = tmp_path / "moved"
    shutil.copytree(result.path, moved)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = next(f for f in moved.glob("*.safetensors") if name in load_file(f))
    tensors = load_file(shard)
    sign = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0)).sign()
    tensors[name] = (tensors[name].double() * (1 + 3 * 2.0 ** -8 * sign)).to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    refused = verify_streamed(source, moved, exact=exact)
    assert not refused.ok and refused.rounded_exact.tensor == name
    assert ROUNDINGS < refused.rounded_exact.roundings < 4 and refused.rounded_exact.exact_error < 1e-6
    prefixes = list(_block_list(model, config))
    first = next(e for e in result.elements if not e.group.id.startswith("residual") and len(e.group.members) > 1)
    dropped = [e for e in result.elements if e is not first]  # another reparametrisation, not the one written
    other = verify_streamed(source, result.path, exact=streamed_align.ExactResult(LazyState(source), dropped,
                                                                                  prefixes, norms))
    assert not other.ok and other.rounded_exact.exact_error < 1e-6 and other.rounded_exact.roundings > 10
    halved = dataclasses.replace(first, group=dataclasses.replace(first.group, members=first.group.members[:1]))
    unsound = [halved if e is first else e for e in result.elements]  # one member moved alone: no symmetry
    wrong = verify_streamed(source, result.path, exact=streamed_align.ExactResult(LazyState(source), unsound,
                                                                                  prefixes, norms))
    assert not wrong.ok and wrong.rounded_exact.exact_error > 1e-3
    assert "not the rounding of an exact result" in wrong.describe()


def test_the_rounded_check_benchmark_times_every_pass_and_restores_the_tolerance(tmp_path, capsys):
    import bench_rounded_check
    from symgraph.verify import ROUNDINGS, TOLERANCE

    root = tmp_path / "bf16"
    make_llama_7b_pair.main(["--out", str(root), "--dtype", "bfloat16", "--models", "A,B1", *TINY])
    capsys.readouterr()
    report = bench_rounded_check.main([str(root / "B1"), str(root / "A")])
    assert json.loads(capsys.readouterr().out)["passes_s"] == report["passes_s"] and len(report["passes_s"]) == 3
    assert report["rounded_exact"]["roundings"] <= ROUNDINGS and report["relative_error"] > 1e-6
    assert report["second_route_over_usual_check"] > 1 and TOLERANCE[torch.bfloat16] == 3e-2


def test_models_of_different_sizes_are_refused(tmp_path, pair, zoo_pair):
    with pytest.raises(MismatchError):
        streamed_align.align_streamed(zoo_pair[0], pair / "A", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_streamed_alignment_on_the_command_line(tmp_path, pair):
    code, out, err = run("align", pair / "B1", pair / "A", "-o", tmp_path / "out", "--stream", "--quiet",
                         "--stats", tmp_path / "stats.json", "--shard-size", "20KB")
    assert code == 0, err
    assert "streamed block by block" in out and "float64 block by block" in out
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["streamed"] and stats["distance_after"] < 1e-12 < stats["distance_before"]
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    code, _, err = run("align", pair / "B1", pair / "A", "-o", tmp_path / "o2", "--stream", "--general-linear")
    assert code != 0 and "--stream cannot be combined with --general-linear" in err
    assert not (tmp_path / "o2").exists()


@pytest.fixture(scope="module")
def tied_pair(tmp_path_factory):
    """Two independent zoo LLaMAs whose LM head is their embedding (stored once, as model.embed_tokens.weight,
    while the graph reads it as lm_head.weight), float32, one file each; and B itself."""
    from symgraph.io import model_config, save_model

    root = tmp_path_factory.mktemp("tied")
    models = [zoo.build("llama-tied", seed=s) for s in (0, 1)]
    return [save_model(m.state_dict(), root / f"m{i}", config=model_config(m)) for i, m in enumerate(models)], models[1]


def _computes(folder, model) -> float:
    """The largest relative change of ``model``'s logits when transformers loads ``folder`` instead (float64)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        want, got = reference(x).logits, loaded(x).logits
    return float((got - want).norm() / want.norm())


@pytest.mark.slow
def test_a_tied_checkpoint_streams_under_the_names_it_stores(tmp_path, tied_pair):
    """Without folding the tie is kept: the groups move the stored embedding once (as the LM head it also is),
    the written checkpoint stores what the source stores and computes B's function as transformers loads it."""
    (a, b), model = tied_pair
    result = streamed_align.align_streamed(b, a, tmp_path / "out", mode="full")
    assert result.distance_after < result.distance_before and not result.untied and not result.unsolved
    assert set(LazyState(result.path)) == set(LazyState(b)) and "lm_head.weight" not in LazyState(b)
    assert json.loads((result.path / "config.json").read_text())["tie_word_embeddings"] is True
    assert result.verified_error < result.verified_tolerance and _computes(result.path, model) < 1e-5


@pytest.mark.slow
def test_a_tied_checkpoint_folds_streamed_untied_as_in_memory(tmp_path, tied_pair):
    """The final norm is read by the tied LM head: folding unties it by default, as symgraph.fold does. The
    first pass equals the in-memory one, OUT stores the head apart and says so in its config, and it computes B's
    function; --no-untie refuses and writes nothing."""
    (a, b), model = tied_pair
    result = streamed_align.align_streamed(b, a, tmp_path / "out", mode="full", fold=True, rounds=0)
    expected = symgraph.align(b, a, mode="full", fold=True, refine_rounds=0, matching_start=False,
                              synthetic_activations=False, short_learning=False)  # the first pass alone
    assert result.folded and result.untied == expected.untied == ["lm_head.weight"]
    assert same_elements(result.elements, expected.elements)
    assert result.distance_after == pytest.approx(expected.distance_after, rel=1e-9)
    assert any(e.group.kind == "orthogonal" and e.group.id.startswith("residual") for e in result.elements)
    written = LazyState(result.path)
    assert set(written) == set(LazyState(b)) | {"lm_head.weight"}
    assert json.loads((result.path / "config.json").read_text())["tie_word_embeddings"] is False
    assert result.verified_error < result.verified_tolerance and _computes(result.path, model) < 1e-5

    code, out, err = run("align", b, a, "-o", tmp_path / "cli", "--stream", "--fold", "--quiet")
    assert code == 0, err
    assert "tied weights untied: lm_head.weight" in out and (tmp_path / "cli" / "config.json").is_file()
    code, _, err = run("align", b, a, "-o", tmp_path / "kept", "--stream", "--fold", "--no-untie")
    assert code != 0 and "tied weights" in err and "--untie" in err
    assert not (tmp_path / "kept").exists()
    with pytest.raises(FoldError, match="serves only a fold"):
        streamed_align.align_streamed(b, a, tmp_path / "plain", untie=True)
    assert not (tmp_path / "plain").exists()


@pytest.mark.slow
def test_a_tie_stored_twice_is_refused_kept_and_untied_when_folded(tmp_path, tied_pair):
    """A checkpoint holding both names of its tie: moving one copy would write two different tensors, of which a
    model loading them keeps one; folded, both are untied and OUT's config says so."""
    from safetensors.torch import save_file

    (a, b), model = tied_pair
    folders = {}
    for name, folder, tied in (("both", b, model), ("anchor", a, zoo.build("llama-tied", seed=0))):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        shutil.copy(Path(folder) / "config.json", folders[name] / "config.json")
        save_file({k: v.clone() for k, v in tied.state_dict().items()}, folders[name] / "model.safetensors")
    both, anchor = folders["both"], folders["anchor"]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(LazyState(both))
    with pytest.raises(MismatchError, match="stores the tied tensors .* separately"):
        streamed_align.align_streamed(both, anchor, tmp_path / "kept", mode="full")
    assert not (tmp_path / "kept").exists()
    result = streamed_align.align_streamed(both, anchor, tmp_path / "out", mode="full", fold=True)
    assert result.untied == ["lm_head.weight"] and set(LazyState(result.path)) == set(LazyState(both))
    assert json.loads((result.path / "config.json").read_text())["tie_word_embeddings"] is False
    assert result.verified_error < result.verified_tolerance and _computes(result.path, model) < 1e-5


@pytest.mark.slow
def test_a_checkpoint_storing_tensors_under_other_names_streams_and_compares(tmp_path):
    """transformers renames a ViT's attention on saving (vit.layers.0.attention.k_proj.weight is stored as
    vit.encoder.layer.0.attention.attention.key.weight): the streamed alignment reads and writes the stored names,
    and what it writes computes B's function as transformers loads it (compare agrees)."""
    from transformers import AutoModelForImageClassification

    from symgraph.checkpoint import StoredLayout
    from symgraph.io import model_config, save_model

    models = [zoo.build("vit", seed=s) for s in (0, 1)]
    a, b = (save_model(m.state_dict(), tmp_path / f"m{i}", config=model_config(m)) for i, m in enumerate(models))
    units = StoredLayout(models[1]).units
    assert units and all(u.renames for u in units)
    assert not {u.model[0] for u in units} & set(LazyState(b)) and {u.stored[0] for u in units} <= set(LazyState(b))
    result = streamed_align.align_streamed(b, a, tmp_path / "out", mode="full")
    assert result.distance_after < result.distance_before and result.verified_error < result.verified_tolerance
    assert set(LazyState(result.path)) == set(LazyState(b))
    loaded = AutoModelForImageClassification.from_pretrained(result.path, dtype=torch.float64).eval()
    pixels = torch.randn(2, 3, models[1].config.image_size, models[1].config.image_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = copy.deepcopy(models[1]).double()(pixel_values=pixels).logits, loaded(pixel_values=pixels).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    code, out, err = run("compare", b, result.path)
    assert code == 0 and "the same function" in out, err


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_experts_stored_one_by_one_stream_in_the_layout_stored(tmp_path, family):
    """transformers stores each expert's matrices apart (Mixtral: block_sparse_moe.experts.3.w1.weight) and stacks
    them on loading (mlp.experts.gate_up_proj): the streamed alignment reads the stacks, moves experts and their
    hidden units, and writes every expert back where it was stored; transformers loads OUT as B's function, and
    ``compare`` agrees."""
    from transformers import AutoModelForCausalLM

    from symgraph.io import model_config, save_model
    from symgraph.moe import REFERENCE, use_experts_implementation

    models = [zoo.build(family, seed=s) for s in (0, 1)]
    a, b = (save_model(m.state_dict(), tmp_path / f"m{i}", config=model_config(m)) for i, m in enumerate(models))
    stored = set(LazyState(b))
    assert not any(n.endswith("experts.gate_up_proj") for n in stored), "experts are stored one by one"
    code, out, err = run("align", b, a, "-o", tmp_path / "out", "--stream")
    assert code == 0, err
    assert set(LazyState(tmp_path / "out")) == stored
    loaded = use_experts_implementation(AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64),
                                        REFERENCE).eval()
    reference = use_experts_implementation(copy.deepcopy(models[1]), REFERENCE).double().eval()
    x = torch.randint(0, reference.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(x).logits, loaded(x).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    moved = [n for n in stored if ".experts." in n
             and not torch.equal(LazyState(tmp_path / "out")[n], LazyState(b)[n])]
    assert moved, "the alignment moved no expert tensor"
    code, out, err = run("compare", b, tmp_path / "out")
    assert code == 0 and "the same function" in out, err


@pytest.mark.slow
def test_the_moe_pair_script_writes_two_models_stored_as_transformers_stores_them(tmp_path):
    """examples/make_moe_pair.py (the large MoE benchmark's pair, here at tiny sizes): two different models, each
    expert stored apart, that stream-align with the float64 check passing."""
    from example_scripts import example_module

    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48, vocab_size=64)
    with example_module("make_moe_pair") as script:
        report = script.main(["--out", str(tmp_path), "--sizes", json.dumps(sizes)])
    assert json.loads((tmp_path / "READY").read_text()) == report
    a, b = LazyState(tmp_path / "A"), LazyState(tmp_path / "B")
    assert set(a) == set(b) and "model.layers.1.mlp.experts.3.up_proj.weight" in set(a)
    assert all(a.info(k).dtype == torch.bfloat16 for k in a)
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    assert not torch.equal(a[name], b[name])
    result = streamed_align.align_streamed(tmp_path / "B", tmp_path / "A", tmp_path / "out", mode="full")
    assert result.distance_after < result.distance_before and result.verified_error < result.verified_tolerance


def test_a_stored_layout_that_does_not_convert_back_is_refused(tmp_path, monkeypatch):
    """A stored unit is read only if converting it back gives the stored tensors bit for bit: otherwise the
    aligned checkpoint could not be written in the source's layout (refused, nothing written)."""
    from symgraph.checkpoint import StoredLayout
    from symgraph.errors import ModelLoadError
    from symgraph.io import model_config, save_model

    models = [zoo.build("mixtral", seed=s) for s in (0, 1)]
    a, b = (save_model(m.state_dict(), tmp_path / f"m{i}", config=model_config(m)) for i, m in enumerate(models))
    to_stored = StoredLayout.to_stored
    monkeypatch.setattr(StoredLayout, "to_stored",
                        lambda self, unit, tensors: {k: v + 1 for k, v in to_stored(self, unit, tensors).items()})
    with pytest.raises(ModelLoadError, match="does not give the stored tensors back"):
        streamed_align.align_streamed(b, a, tmp_path / "out", mode="full")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_projection_stored_fused_streams_split_and_is_written_fused(tmp_path):
    """GTE stores its MLP's up and gate projections as one tensor (mlp.up_gate_proj) that transformers splits on
    loading: the two halves are read apart (a permutation of the hidden units moves both), and written back as
    one."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("gte", hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                  num_hidden_layers=2, vocab_size=50, max_position_embeddings=64, num_labels=3)
    folders, models = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(AutoModelForSequenceClassification.from_config(config).eval())
        folders.append(tmp_path / f"m{seed}")
        models[-1].save_pretrained(folders[-1])
    a, b = folders
    stored = set(LazyState(b))
    assert any(n.endswith("mlp.up_gate_proj.weight") for n in stored)
    result = streamed_align.align_streamed(b, a, tmp_path / "out", mode="full")
    assert result.distance_after < result.distance_before and result.verified_error < result.verified_tolerance
    assert set(LazyState(result.path)) == stored
    loaded = AutoModelForSequenceClassification.from_pretrained(result.path, dtype=torch.float64).eval()
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = copy.deepcopy(models[1]).double()(x).logits, loaded(x).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("family", ["llama-tied", "gpt2", "opt", "t5", "bart"])
def test_a_model_built_from_its_config_alone_is_tied_as_with_its_weights(tmp_path, family):
    """Built on the meta device (report --config-only, streaming), a tied model must tie as it does with its
    weights: untied, its graph had symmetries the model lacks (GPT-2, OPT, T5: the final norm rescaled against the
    LM head alone, not against the embedding it is; 58 of the architecture sweep's 240 types differed)."""
    from symgraph.io import load_model, model_config, save_model
    from symgraph.verify import _aliases

    model = zoo.build(family, seed=0)
    folder = save_model(model.state_dict(), tmp_path / "m", config=model_config(model))
    meta = load_model(Path(folder), config_only=True).model
    assert _aliases(meta) == _aliases(model) != []
    with_weights = {(g.id, g.kind) for g in symgraph.analyze(folder).groups}
    config_only = {(g.id, g.kind) for g in symgraph.analyze(symgraph.load(Path(folder), config_only=True)).groups}
    assert config_only == with_weights


def _tiny_gemma():
    """RMSNorms that multiply by 1 + w (folded, w reads 0 and its readers absorb 1 + w)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        num_hidden_layers=2, vocab_size=60, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_folded_reads_are_the_numbers_symgraph_fold_writes(tmp_path, family):
    """Tensor by tensor, in bf16 (multiplied in fp32, not float64; 1 + w in float64): bit for bit what the
    in-memory fold gives."""
    from symgraph.io import model_config, save_model

    model = zoo.build("llama", seed=0) if family == "llama" else _tiny_gemma()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    folder = save_model(state, tmp_path / "m", config=model_config(model))
    norms = streamed_align.streamed_groups(folder, fold=True).norms
    folded = streamed_align.FoldedState(LazyState(folder), norms)
    expected = symgraph.fold(symgraph.load(folder)).state
    assert any(not torch.equal(folded[k], LazyState(folder)[k]) for k in folded)
    for name in folded:
        assert folded[name].dtype == torch.bfloat16, name
        assert torch.equal(folded[name], expected[name].to(torch.bfloat16)), name
    assert {n.offset for n in norms} == {0.0 if family == "llama" else 1.0}


def test_a_one_plus_w_model_folded_on_disk_is_refused_against_an_unfolded_anchor(tmp_path):
    """Gemma folded by `symgraph fold` stores its norm weights as 0 (it multiplies by 1 + w): one number
    throughout, a larger group than the unfolded anchor's, which the streamed alignment must not mix."""
    from symgraph.io import model_config, save_model

    model = _tiny_gemma()
    folder = save_model(model.state_dict(), tmp_path / "g", config=model_config(model))
    folded = symgraph.fold(symgraph.load(folder))
    folded_folder = save_model(folded.state, tmp_path / "folded", config=model_config(model))
    with pytest.raises(MismatchError, match="(?s)holds one number throughout.*fold both"):
        streamed_align.align_streamed(folded_folder, folder, tmp_path / "out", mode="permutation", rounds=0)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the device machine runs it)"))])
def test_compute_device_and_dtype_give_the_same_alignment(tmp_path, pair, device):
    """Blocks solved on ``device`` in float64 or float32: the same permutations, distances within rounding, and
    the written tensors back on the CPU in their stored dtype."""
    wide = streamed_align.align_streamed(pair / "B2", pair / "A", tmp_path / "f64", mode="permutation",
                                         device=device, dtype="float64")
    narrow = streamed_align.align_streamed(pair / "B2", pair / "A", tmp_path / "f32", mode="permutation",
                                           device=device, dtype="float32")
    assert same_elements(wide.elements, narrow.elements)
    assert narrow.distance_after == pytest.approx(wide.distance_after, rel=1e-5)
    assert narrow.distance_after < narrow.distance_before
    assert {info.dtype for info in LazyState(narrow.path).infos()} == {torch.float64}


def test_streamed_device_without_a_gpu_is_refused_before_reading(tmp_path, pair, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run("align", pair / "B2", pair / "A", "-o", tmp_path / "out", "--stream", "--device", "cuda")
    assert code == 2 and "sees no CUDA GPU" in err
    assert not (tmp_path / "out").exists()
