"""Reliability audit, second pass: faults found by running every command on bad input, each with its regression.

A streamed merge of incomplete or differently configured checkpoints, two outputs on one path, NaN weights given to
``compare``, damaged data and tokenizer files, a conversion of the caller's module: each was accepted (or reported
as a crash, a user abort or a difference between models) before, and is a clear refusal now, with nothing written.
"""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from cli_runner import run, tree_digest
from symgraph import zoo
from symgraph.errors import DataError


def _llama(folder, seed=0, edit=None, config_edit=None):
    """A tiny LLaMA saved by transformers; ``edit(stored)`` changes its tensors, ``config_edit(dict)`` its config."""
    zoo.build("llama", seed=seed).save_pretrained(folder)
    if edit is not None:
        file = folder / "model.safetensors"
        stored = safetensors.torch.load_file(file)
        edit(stored)
        safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((folder / "config.json").read_text())
        config_edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny LLaMA folders of one configuration (read only)."""
    root = tmp_path_factory.mktemp("pair")
    return _llama(root / "a", 0), _llama(root / "b", 1)


def _written(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# merge --stream checks what the in-memory merge checks
# ---------------------------------------------------------------------------------------------------------------

def test_streamed_merge_refuses_checkpoints_that_all_lack_a_weight(tmp_path):
    """Both checkpoints lack lm_head.weight (the model does not tie it): the merge would lack it as well and load
    with a random head. Before: written, exit 0."""
    drop = lambda stored: stored.pop("lm_head.weight")  # noqa: E731
    a, b = _llama(tmp_path / "a", 0, drop), _llama(tmp_path / "b", 1, drop)
    code, _, err = run("merge", a, b, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code == 2 and "lm_head.weight" in err and "at random" in err and "Traceback" not in err, err
    assert _written(tmp_path) == ["a", "b"]


def test_streamed_merge_of_complete_checkpoints_still_runs(tmp_path, pair):
    """The completeness check knows tied weights (left out by save_pretrained) and per-expert MoE names."""
    import shutil

    import transformers

    config = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mix")
    zoo.build("llama-tied").save_pretrained(tmp_path / "tied")
    for source in ("mix", "tied"):
        shutil.copytree(tmp_path / source, tmp_path / f"{source}-copy")
        code, _, err = run("merge", tmp_path / source, tmp_path / f"{source}-copy", "--stream", "--align", "none",
                           "-o", tmp_path / f"{source}-out")
        assert code == 0, err


def test_streamed_merge_refuses_different_configurations(tmp_path, pair):
    """Same tensors and shapes, another rope_theta: the in-memory merge refused this, the streamed one wrote the
    first model's config over an average of two different functions."""
    def other_rope(config):
        config["rope_parameters"]["rope_theta"] = 500.0

    b = _llama(tmp_path / "b", 1, config_edit=other_rope)
    code, _, err = run("merge", pair[0], b, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code == 2 and "different configurations" in err and "rope_theta" in err, err
    assert _written(tmp_path) == ["b"]


def test_barrier_says_whose_configuration_holds_which_value(tmp_path, pair):
    """barrier aligns its second model to its first, and the refusal listed 'key: B's value vs A's value' with no
    name: read in the command's order, the values were each other's."""
    def other_eps(config):
        config["rms_norm_eps"] = 0.001

    b = _llama(tmp_path / "b", 1, config_edit=other_eps)
    code, _, err = run("barrier", pair[0], b, "--data", "pydoc-chars", "--limit", "4", "--steps", "3", "--align",
                       "none", "-o", tmp_path / "p.png")
    eps = json.loads((pair[0] / "config.json").read_text())["rms_norm_eps"]
    assert code == 2 and (f"b vs a: rms_norm_eps: 0.001 vs {eps}" in err or f"a vs b: rms_norm_eps: {eps} vs 0.001"
                          in err), err
    assert _written(tmp_path) == ["b"]


# ---------------------------------------------------------------------------------------------------------------
# compare: NaN weights are bad input, not a different function
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"])  # outside, in a block
def test_compare_names_nan_weights(tmp_path, pair, key):
    def poison(stored):
        stored[key].view(-1)[0] = float("nan")

    bad = _llama(tmp_path / "bad", 0, poison)
    for args in ((bad, pair[1]), (pair[1], bad)):
        code, out, err = run("compare", *args)
        assert code == 2 and "NaN or Inf" in err and key in err and "DIFFERENT" not in out, (out, err)


def test_compare_names_different_architectures(tmp_path, pair):
    """A LLaMA against a GPT-2, or against a deeper LLaMA: refused, naming the classes or the tensors that differ
    (it used to answer "DIFFERENT functions", as if the weights were at fault)."""
    import transformers

    config = transformers.AutoConfig.for_model("gpt2", vocab_size=100, n_embd=32, n_layer=2, n_head=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    code, out, err = run("compare", pair[0], tmp_path / "gpt2")
    assert code == 2 and "LlamaForCausalLM" in err and "GPT2LMHeadModel" in err and "DIFFERENT" not in out, err

    def deeper(config):
        config["num_hidden_layers"] += 1

    zoo.build("llama", seed=0).save_pretrained(tmp_path / "plain")
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(_llama(tmp_path / "deep-config", 0, config_edit=deeper)))
    model.save_pretrained(tmp_path / "deep")
    code, out, err = run("compare", pair[0], tmp_path / "deep")
    assert code == 2 and "different tensors" in err and "layers." in err, err


def test_compare_says_which_configuration_fields_differ(tmp_path, pair):
    def other_rope(config):
        config["rope_parameters"]["rope_theta"] = 500.0

    code, out, _ = run("compare", pair[0], _llama(tmp_path / "theta", 0, config_edit=other_rope))
    assert code == 1 and "DIFFERENT functions" in out and "rope_theta" in out and "500.0" in out, out


# ---------------------------------------------------------------------------------------------------------------
# two outputs of one command on one path
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["align", "fold", "merge", "merge-stream", "barrier"])
def test_two_outputs_on_one_path_are_refused_before_any_work(tmp_path, pair, command):
    """Before: the model folder was written, then the side file failed on it (exit 2 with OUT in place), or the
    barrier's JSON silently replaced its plot."""
    out = tmp_path / ("plot.png" if command == "barrier" else "out")
    same = tmp_path / ".." / tmp_path.name / out.name  # the same path, spelt differently
    args = {
        "align": ["align", *pair, "-o", out, "--stats", same],
        "fold": ["fold", pair[0], "-o", out, "--json", same],
        "merge": ["merge", *pair, "-o", out, "--json", same],
        "merge-stream": ["merge", *pair, "--stream", "--align", "none", "-o", out, "--json", same],
        "barrier": ["barrier", *pair, "--data", "pydoc-chars", "-o", out, "--json", same],
    }[command]
    code, _, err = run(*args)
    assert code == 2 and "name the same path" in err, err
    assert _written(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# damaged data files
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"PK\x03\x04truncated"])
def test_an_empty_or_truncated_npz_is_a_data_error(tmp_path, pair, content):
    """Before: an empty .npz raised EOFError, which click reports as a user abort ('aborted', exit 130)."""
    data = tmp_path / "data.npz"
    data.write_bytes(content)
    code, _, err = run("align", pair[1], pair[0], "-o", tmp_path / "out", "--data", data, "--quiet")
    assert code == 2 and "Cannot read" in err and str(data.name) in err and "aborted" not in err, err
    assert _written(tmp_path) == ["data.npz"]


def test_an_eof_error_is_not_reported_as_a_user_abort(tmp_path, pair, monkeypatch):
    import symgraph.api

    def broken(*args, **kwargs):
        raise EOFError("ran out of input")

    monkeypatch.setattr(symgraph.api, "load", broken)
    code, _, err = run("report", pair[0])
    assert code == 3 and "EOFError: ran out of input" in err and "aborted" not in err, err


def test_a_damaged_tokenizer_is_a_data_error(tmp_path, pair):
    """Before: a tokenizer_config.json that is not JSON ended text data loading in an internal error."""
    import shutil

    from symgraph.datasets import load_data

    folder = tmp_path / "model"
    shutil.copytree(pair[0], folder)
    (folder / "tokenizer_config.json").write_text("{ not json")
    (tmp_path / "lines.txt").write_text("hello world\n")
    before = tree_digest(folder)
    with pytest.raises(DataError, match="Cannot load the tokenizer in .*JSONDecodeError") as info:
        load_data(tmp_path / "lines.txt", model=folder)
    assert "tokenizer" in info.value.hint
    assert tree_digest(folder) == before


# ---------------------------------------------------------------------------------------------------------------
# the caller's module is never converted
# ---------------------------------------------------------------------------------------------------------------

def test_loading_a_module_in_another_dtype_leaves_the_callers_module_alone():
    """Before: ``load_model(module, dtype=torch.float64)`` converted the caller's module in place."""
    from symgraph.io import load_model

    model = zoo.build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = load_model(model, dtype=torch.float64)
    assert all(v.dtype == torch.float64 for v in loaded.model.state_dict().values() if v.is_floating_point())
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


# ---------------------------------------------------------------------------------------------------------------
# files beside the weights: carried over, or named as not
# ---------------------------------------------------------------------------------------------------------------

def test_every_tokenizer_file_is_carried_and_the_rest_named(tmp_path, pair, caplog):
    """DeBERTa-v2's spm.model and Marian's source.spm were silently left behind (a fixed list of names); other
    files (model card, licence, folders) are still not copied, and now the run says so."""
    import logging
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(pair[0], folder)
    for name in ("spm.model", "source.spm", "README.md", "LICENSE"):
        (folder / name).write_text(name)
    (folder / "original").mkdir()
    with caplog.at_level(logging.WARNING, logger="symgraph"):
        code, _, err = run("transform", folder, "-o", tmp_path / "out")
    assert code == 0, err
    written = _written(tmp_path / "out")
    assert {"spm.model", "source.spm", "generation_config.json"} <= set(written)
    assert all((tmp_path / "out" / n).read_text() == n for n in ("spm.model", "source.spm"))
    assert "README.md" not in written and "LICENSE" not in written
    assert "Not copied from" in caplog.text and "LICENSE, README.md, original/." in caplog.text, caplog.text


@pytest.mark.parametrize("command", ["transform", "fuzz"])
def test_a_negative_seed_is_a_usage_error(tmp_path, pair, command):
    """Before: numpy's 'expected non-negative integer' surfaced as an internal error (exit 3), fuzz's only after
    every group had run."""
    args = ["transform", pair[0], "-o", tmp_path / "out"] if command == "transform" else ["fuzz", pair[0]]
    code, _, err = run(*args, "--seed", "-1")
    assert code == 2 and "--seed" in err and "internal error" not in err, err
    assert _written(tmp_path) == []


@pytest.mark.parametrize("command", ["transform", "fold", "align", "merge", "merge-stream"])
def test_overwrite_never_replaces_a_folder_that_holds_no_model(tmp_path, pair, command):
    """Before: ``-o ~/project --overwrite`` swapped the model in for the whole folder and deleted what it held."""
    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    before = tree_digest(out)
    args = {"transform": ["transform", pair[0]], "fold": ["fold", pair[0]], "align": ["align", *pair],
            "merge": ["merge", *pair], "merge-stream": ["merge", *pair, "--stream", "--align", "none"]}[command]
    code, _, err = run(*args, "-o", out, "--overwrite")
    assert code == 2 and "holds no model" in err and "notes.txt" in err, err
    assert tree_digest(out) == before and sorted(p.name for p in out.iterdir()) == ["notes.txt", "src"]
    assert _written(tmp_path) == ["project"]


def test_overwrite_never_deletes_what_a_model_folder_holds_besides_the_model(tmp_path, pair):
    """Before: a folder with any config.json counted as a model folder, so a project whose tool config is named
    config.json lost its code and data, and a training run's folder its checkpoints, model card and git history."""
    import shutil

    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"lint": true}')
    (project / "src" / "main.py").write_text("print(1)")
    run_dir = tmp_path / "run"
    shutil.copytree(pair[0], run_dir)
    (run_dir / "checkpoint-500").mkdir()
    (run_dir / "README.md").write_text("# card")
    clone = tmp_path / "clone"
    shutil.copytree(pair[0], clone)
    (clone / ".git").mkdir()
    for out, named, said in ((project, "config.json", "holds no model"), (run_dir, "checkpoint-500/", "README.md"),
                             (clone, ".git/", "would delete")):
        before = tree_digest(out)
        code, _, err = run("fold", pair[0], "-o", out, "--overwrite")
        assert code == 2 and named in err and said in err, err
        assert tree_digest(out) == before


@pytest.mark.parametrize("command", ["barrier --json", "merge --json", "align --stats", "merge -o"])
def test_no_output_replaces_the_data_it_reads(tmp_path, pair, command):
    """Before: ``--json data.npz`` beside ``--data data.npz`` replaced the data set with the run's JSON (exit 0): the
    overlap checks were given the models only."""
    import numpy as np

    data = tmp_path / "data.npz"
    vocab = json.loads((pair[0] / "config.json").read_text())["vocab_size"]
    np.savez(data, input_ids=np.random.default_rng(0).integers(0, vocab, (8, 6)))
    before = data.read_bytes()
    args = {"barrier --json": ["barrier", *pair, "--data", data, "--align", "none", "--steps", "3",
                               "-o", tmp_path / "plot.png", "--json", data],
            "merge --json": ["merge", *pair, "--align", "none", "--method", "fisher", "--data", data,
                             "-o", tmp_path / "merged", "--json", data],
            "align --stats": ["align", *pair, "--data", data, "-o", tmp_path / "aligned", "--stats", data],
            "merge -o": ["merge", *pair, "--align", "none", "--method", "fisher", "--data", f"{data}:train",
                         "-o", tmp_path, "--overwrite"]}[command]
    code, _, err = run(*args)
    assert code == 2 and "the data" in err, err
    assert data.read_bytes() == before and _written(tmp_path) == ["data.npz"]


@pytest.mark.parametrize("stored", [[1, 2, 3], "tensor"])
def test_a_bin_that_holds_no_state_dict_is_named(tmp_path, pair, stored):
    """Before: 'internal error: AttributeError: 'list' object has no attribute 'items'' (exit 3)."""
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(pair[0] / "config.json", folder / "config.json")
    torch.save(torch.zeros(3) if stored == "tensor" else stored, folder / "pytorch_model.bin")
    code, _, err = run("report", folder)
    assert code == 2 and "not a state dict" in err and "internal error" not in err, err


@pytest.mark.parametrize("stream", [False, True])
def test_a_shard_named_outside_its_folder_is_refused(tmp_path, pair, stream):
    """Before: ``merge --stream`` read the tensors of ``../OTHER/model-00001-of-N.safetensors`` and merged them
    (exit 0), where the in-memory merge was refused by transformers."""
    sharded, other = tmp_path / "a", tmp_path / "other"
    for folder, seed in ((sharded, 0), (other, 2)):
        zoo.build("llama", seed=seed).save_pretrained(folder, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    first = sorted(json.loads(index.read_text())["weight_map"].values())[0]
    index.write_text(index.read_text().replace(f'"{first}"', f'"../other/{first}"'))
    code, _, err = run("merge", sharded, pair[1], "--align", "none", *(["--stream"] if stream else []),
                       "-o", tmp_path / "merged")
    assert code == 2 and "outside its folder" in err, err
    assert not (tmp_path / "merged").exists()


def test_compare_takes_a_tied_model_and_its_untied_fold_for_one_function(tmp_path):
    """Before: ``compare A F`` after ``fold A -o F`` (which unties a tied head by default) exited 2: "store different
    tensors (only in the first: []; only in the second: ['lm_head.weight'])"."""
    model = tmp_path / "a"
    zoo.build("gpt2", seed=0).save_pretrained(model)
    assert json.loads((model / "config.json").read_text()).get("tie_word_embeddings", True)
    code, _, err = run("fold", model, "-o", tmp_path / "folded")
    assert code == 0, err
    code, out, err = run("compare", model, tmp_path / "folded")
    assert code == 0 and "the same function" in out, out + err


def test_different_groups_are_named_with_their_usual_cause():
    """Before: "The two models have different symmetry groups ... they must be the same architecture", for two
    models of one architecture, one freshly initialised (its unit norm weights give its stream more symmetry)."""
    from group_checks import noisy

    import symgraph
    from symgraph.errors import MismatchError

    import transformers

    config = transformers.MBartConfig(vocab_size=40, d_model=32, decoder_layers=1, encoder_layers=1,
                                      decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=48,
                                      encoder_ffn_dim=48, max_position_embeddings=64)
    fresh, trained = transformers.MBartForCausalLM(config).eval(), noisy(transformers.MBartForCausalLM(config), 0.05)
    for call in (lambda: symgraph.align(fresh, trained, progress=False), lambda: symgraph.merge([trained, fresh])):
        with pytest.raises(MismatchError) as caught:
            call()
        assert "residual" in str(caught.value) and "freshly initialised" in caught.value.hint, caught.value


def test_inputs_given_to_a_cached_decoder_trace_without_its_cache():
    """Before: ``symgraph.load(llama, inputs=(ids,))`` stopped at capture on the DynamicCache its forward returned,
    where the inputs symgraph builds itself switch the cache off."""
    import symgraph
    import transformers

    model = transformers.LlamaForCausalLM(zoo.tiny_config("llama")).eval()
    ids = torch.randint(3, 50, (2, 6))
    for inputs in ((ids,), {"input_ids": ids}, ids):
        subject = symgraph.load(model, inputs=inputs)
        assert subject.kwargs.get("use_cache") is False and subject.report.groups


def test_overwrite_still_replaces_a_model_folder_and_an_empty_one(tmp_path, pair):
    from symgraph.io import save_model

    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", save_model({"w": torch.zeros(2)}, tmp_path / "model")):
        code, _, err = run("transform", pair[0], "-o", out, "--overwrite")
        assert code == 0 and (out / "config.json").is_file(), err


# ---------------------------------------------------------------------------------------------------------------
# integer and boolean tensors are never averaged, nor silently taken from one model
# ---------------------------------------------------------------------------------------------------------------

class _Masked(torch.nn.Module):
    """A ReLU MLP whose outputs pass through a boolean mask buffer, with a 0-d step counter."""

    def __init__(self, seed: int, mask):
        super().__init__()
        torch.manual_seed(seed)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.register_buffer("mask", torch.tensor(mask))
        self.register_buffer("steps", torch.tensor(seed + 5))

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.mask


def test_merge_refuses_models_whose_masks_differ():
    """Before: the merge kept one model's mask silently, computing with it on the other's averaged weights."""
    import symgraph
    import symgraph
    from symgraph.errors import MismatchError

    x = torch.randn(3, 8)
    same = symgraph.merge([symgraph.load(_Masked(0, [True, False, True, True]), (x,)),
                           symgraph.load(_Masked(1, [True, False, True, True]), (x,))])
    assert same.state["mask"].tolist() == [True, False, True, True] and int(same.state["steps"]) in (5, 6)
    with pytest.raises(MismatchError, match="bool tensor 'mask' differs between model 1"):
        symgraph.merge([symgraph.load(_Masked(0, [True, False, True, True]), (x,)),
                        symgraph.load(_Masked(1, [True, True, True, True]), (x,))])


def test_streamed_merge_refuses_integer_tensors_that_differ(tmp_path):
    import symgraph
    from symgraph.errors import MismatchError
    from symgraph.io import save_model
    from symgraph.merging import merge_streamed

    folders = [save_model({"w": torch.randn(3), "ids": torch.tensor(ids), "steps": torch.tensor(n)}, tmp_path / f"m{n}")
               for n, ids in ((1, [0, 1, 2]), (2, [0, 1, 2]))]
    merged = merge_streamed(folders, tmp_path / "same")
    stored = safetensors.torch.load_file(merged.path / "model.safetensors")
    assert stored["ids"].tolist() == [0, 1, 2] and stored["ids"].dtype == torch.int64 and int(stored["steps"]) == 1
    other = save_model({"w": torch.randn(3), "ids": torch.tensor([2, 1, 0]), "steps": torch.tensor(3)},
                       tmp_path / "m3")
    with pytest.raises(MismatchError, match="int64 tensor 'ids' differs between model 1"):
        merge_streamed([folders[0], other], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# every command that writes a model: every stored tensor written, in its dtype, loadable whole, inputs unchanged
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stored_pairs(tmp_path_factory):
    """(a, b) folders written by transformers: bf16 LLaMA (untied head), float32 LLaMA with tied embeddings."""
    root = tmp_path_factory.mktemp("stored")
    pairs = {}
    for family, dtype in (("llama", torch.bfloat16), ("llama-tied", torch.float32)):
        for seed in (0, 1):
            zoo.build(family, seed=seed, dtype=dtype).save_pretrained(root / f"{family}-{seed}")
        pairs[family] = (root / f"{family}-0", root / f"{family}-1")
    return pairs


_WRITERS = {
    "transform": lambda a, b, out: ["transform", a, "-o", out],
    "fold": lambda a, b, out: ["fold", a, "-o", out],
    "align": lambda a, b, out: ["align", a, b, "-o", out, "--quiet"],
    "merge": lambda a, b, out: ["merge", a, b, "-o", out, "--no-progress"],
    "merge-stream": lambda a, b, out: ["merge", a, b, "-o", out, "--stream", "--align", "none"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command, family", [(c, f) for c in sorted(_WRITERS) for f in ("llama", "llama-tied")])
def test_written_models_keep_every_tensor_and_dtype(tmp_path, stored_pairs, family, command):
    import transformers

    a, b = stored_pairs[family]
    before = [tree_digest(a), tree_digest(b)]
    code, out, err = run(*_WRITERS[command](a, b, tmp_path / "out"))
    assert code == 0, err
    # fold, and merge (which folds by default), untie a tied head so the final norm folds into it, and say so
    untied = family == "llama-tied" and command in ("fold", "merge")
    assert ("lm_head.weight" in out) == untied, out
    stored = safetensors.torch.load_file(a / "model.safetensors")
    written = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    head = {"lm_head.weight": stored["model.embed_tokens.weight"]} if untied else {}
    assert written.keys() == stored.keys() | head.keys()
    assert {k: v.dtype for k, v in written.items()} == {k: v.dtype for k, v in (stored | head).items()}
    assert all(torch.isfinite(v.float()).all() for v in written.values())
    again, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    if family == "llama-tied":
        shared = again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
        assert shared != untied and again.config.tie_word_embeddings != untied
    assert [tree_digest(a), tree_digest(b)] == before and _written(tmp_path) == ["out"]
    assert "generation_config.json" in _written(tmp_path / "out")


def test_a_merge_is_never_saved_over_one_of_its_models(tmp_path, pair):
    """Before: ``result.save(a, overwrite=True)`` replaced model a when the config was copied from model b (the
    reference), since only that folder was protected."""
    import shutil

    import symgraph
    from symgraph.errors import OutputError

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(pair[0], a)
    shutil.copytree(pair[1], b)
    before = [tree_digest(a), tree_digest(b)]
    result = symgraph.merge([a, b], align="none", fold=False, progress=False)
    for target in (a, b, a / "sub"):
        with pytest.raises(OutputError, match="input"):
            result.save(target, overwrite=True)
    assert [tree_digest(a), tree_digest(b)] == before and _written(tmp_path) == ["a", "b"]


def test_config_names_the_dtype_a_mixed_merge_is_written_in(tmp_path, pair, stored_pairs):
    """bf16 and float32 models merge into float32 weights; the config copied from the bf16 model said bfloat16,
    so transformers (dtype="auto") loaded the merge rounded to bf16."""
    code, _, err = run("merge", stored_pairs["llama"][0], pair[1], "-o", tmp_path / "out", "--stream", "--align",
                       "none")
    assert code == 0, err
    written = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert {v.dtype for v in written.values()} == {torch.float32}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("config_from", ["config", "like"])
def test_save_model_writes_the_dtype_of_the_weights_into_the_config(tmp_path, stored_pairs, config_from):
    from symgraph.io import load_model, save_model

    folder = stored_pairs["llama"][0]
    loaded = load_model(folder)
    state = {k: v.float() for k, v in loaded.model.state_dict().items()}
    given = dict(config=loaded.config) if config_from == "config" else dict(like=folder)
    out = save_model(state, tmp_path / "out", **given)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"  # the input's is left alone
    assert loaded.config.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# a module given to symgraph comes back exactly as it was given
# ---------------------------------------------------------------------------------------------------------------

def _module_state(model: torch.nn.Module) -> dict:
    """Everything about a module a caller can observe: each submodule's training flag and hooks, each tensor's
    identity, memory, dtype, device, requires_grad, values and gradient."""
    state: dict = {}
    for name, m in model.named_modules():
        state[f"module {name}"] = (m.training, list(m._forward_hooks), list(m._forward_pre_hooks))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        state[f"tensor {name}"] = (id(t), t.data_ptr(), t.dtype, t.device, t.requires_grad, t.detach().clone(),
                                   None if t.grad is None else t.grad.clone())
    return state


def _same_state(a: dict, b: dict) -> list[str]:
    def same(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return x == y
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k]))


def _callers_mlp(seed: int) -> torch.nn.Module:
    """A ReLU MLP as a caller holds it mid-training: train mode with its dropout switched to eval, a frozen
    first bias, gradients present, a forward hook, BatchNorm statistics that a train-mode forward would move."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), torch.nn.Linear(12, 3)).train()
    net[3].eval()
    net[0].bias.requires_grad_(False)
    net[4].weight.grad = torch.ones_like(net[4].weight)
    net[1].register_forward_hook(lambda *args: None)
    return net


@pytest.mark.slow
def test_a_callers_module_comes_back_exactly_as_given():
    """Before: ``symgraph.load(module)`` (and so analyze, transform, fuzz, align, merge, barrier) switched every
    submodule of the caller's module to eval mode, and Fisher statistics cleared its gradients."""
    import symgraph
    from symgraph.capture import capture
    from symgraph.datasets import Batch, Dataset, evaluate
    from symgraph.fuzz import fuzz
    from symgraph.statistics import fisher_diagonal, input_grams

    x = torch.randn(5, 6)
    data = Dataset("toy", "classification", (Batch({"input": x}, torch.tensor([0, 1, 2, 0, 1])),))
    a, b = _callers_mlp(0), _callers_mlp(1)
    before = [_module_state(a), _module_state(b)]
    subject = symgraph.load(a, (x,))
    assert subject.report.groups and not subject.model.training and subject.model[0].weight is a[0].weight
    symgraph.transform(a, inputs=(x,))
    assert fuzz(subject, samples=2).ok
    symgraph.align(symgraph.load(b, (x,)), subject)
    symgraph.merge([subject, symgraph.load(b, (x,))], method="fisher", data=data, progress=False)
    symgraph.barrier(subject, symgraph.load(b, (x,)), data, steps=3, aligns=("none",), progress=False)
    capture(a, (x,))
    fisher_diagonal(a, data, progress=False)
    input_grams(a, data, progress=False)
    evaluate(a, data)
    assert _same_state(_module_state(a), before[0]) == [] and _same_state(_module_state(b), before[1]) == []


def test_a_fisher_merge_averages_float_buffers_simply():
    """Before: a model with BatchNorm (float buffers: running statistics, which have no gradient and so no Fisher
    information) ended the Fisher merge in ``KeyError: '1.running_mean'``."""
    import symgraph
    from symgraph.datasets import Batch, Dataset

    x = torch.randn(5, 6)
    data = Dataset("toy", "classification", (Batch({"input": x}, torch.tensor([0, 1, 2, 0, 1])),))
    models = [_callers_mlp(seed).eval() for seed in (0, 1)]
    for m, shift in zip(models, (1.0, 3.0)):
        m[1].running_mean.fill_(shift)
    merged = symgraph.merge([symgraph.load(m, (x,)) for m in models], method="fisher", align="none", data=data,
                            progress=False)
    assert torch.allclose(merged.state["1.running_mean"], torch.full((12,), 2.0))
    assert "1.running_mean" in merged.simple_averaged and "0.weight" not in merged.simple_averaged


# ---------------------------------------------------------------------------------------------------------------
# safetensors metadata is carried into written checkpoints
# ---------------------------------------------------------------------------------------------------------------

def _with_metadata(folder, **metadata):
    file = folder / "model.safetensors"
    safetensors.torch.save_file(safetensors.torch.load_file(file), file, metadata={"format": "pt", **metadata})
    return folder


def _metadata_of(folder) -> dict:
    from safetensors import safe_open

    from symgraph.lazy_state import safetensors_files

    found = []
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            found.append(handle.metadata())
    assert all(m == found[0] for m in found), found  # every shard carries the same
    return found[0]


@pytest.fixture(scope="module")
def labelled_pair(tmp_path_factory):
    """Two tiny LLaMA folders whose safetensors metadata agree on ``origin`` and differ on ``run``."""
    root = tmp_path_factory.mktemp("labelled")
    return (_with_metadata(_llama(root / "a", 0), origin="lab", run="a"),
            _with_metadata(_llama(root / "b", 1), origin="lab", run="b"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["transform", "fold", "align", "align-stream", "merge", "merge-stream"])
def test_safetensors_metadata_is_carried(tmp_path, labelled_pair, command, caplog):
    """Before: every written checkpoint stored only ``format: pt``, dropping what the input's metadata said.
    A reparametrised model carries its source's; a merge the entries every model agrees on, naming the rest."""
    import logging

    a, b = labelled_pair
    out = tmp_path / "out"
    args = {"transform": ["transform", a], "fold": ["fold", a], "align": ["align", a, b, "--quiet"],
            "align-stream": ["align", a, b, "--stream", "--shard-size", "100KB", "--quiet"],
            "merge": ["merge", a, b, "--align", "none", "--no-progress"],
            "merge-stream": ["merge", a, b, "--stream", "--align", "none", "--shard-size", "100KB"]}[command]
    with caplog.at_level(logging.WARNING, logger="symgraph"):
        code, _, err = run(*args, "-o", out)
    assert code == 0, err
    if command.startswith("merge"):
        assert _metadata_of(out) == {"format": "pt", "origin": "lab"}
        assert "metadata not carried" in caplog.text and "run." in caplog.text, caplog.text
    else:
        assert _metadata_of(out) == {"format": "pt", "origin": "lab", "run": "a"}


# ---------------------------------------------------------------------------------------------------------------
# align --stream checks what the in-memory align checks
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["source", "anchor"])
def test_streamed_align_names_nan_weights(tmp_path, pair, bad):
    """Before: a NaN in a bf16 weight reached the Hungarian solver, and the run ended in 'Writing the model
    failed: matrix contains invalid numeric entries ... free disk space'."""
    key = "model.layers.0.mlp.up_proj.weight"

    def poison(stored):
        stored[key] = stored[key].to(torch.bfloat16)
        stored[key][0, 0] = float("nan")

    nan = _llama(tmp_path / "nan", 0, poison)
    source, anchor = (nan, pair[1]) if bad == "source" else (pair[1], nan)
    code, _, err = run("align", source, anchor, "--stream", "-o", tmp_path / "out", "--quiet")
    assert code == 2 and "NaN or Inf" in err and key in err and "disk" not in err, err
    assert _written(tmp_path) == ["nan"]


def test_streamed_align_refuses_layers_outside_the_model(tmp_path, pair):
    """Before: --layers 5-9 on a 2-layer model was accepted by --stream (exit 0, nothing aligned)."""
    code, _, err = run("align", *pair, "--stream", "--layers", "5-9", "-o", tmp_path / "out")
    assert code == 2 and "outside the model" in err and "0-1" in err, err
    assert _written(tmp_path) == []


def test_a_failure_computing_a_streamed_tensor_is_not_called_a_write_failure(tmp_path):
    """Only I/O errors are writing problems ('free disk space'); an error producing a tensor propagates as itself,
    and the staged shards are removed all the same."""
    from symgraph.shards import TensorInfo, write_checkpoint

    def produce(name):
        raise ValueError("the solver failed")

    with pytest.raises(ValueError, match="the solver failed"):
        write_checkpoint(tmp_path / "out", [TensorInfo("w", (2,), torch.float32)], produce)
    assert _written(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# a model given twice to merge
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_merge_refuses_a_model_given_twice(tmp_path, pair, stream):
    """Before: ``merge A A`` (or A spelt another way, or a link to it) wrote A again as 'the merge', exit 0."""
    (tmp_path / "link").symlink_to(pair[0])
    for again in (pair[0], pair[0].parent / ".." / pair[0].parent.name / pair[0].name, tmp_path / "link"):
        code, _, err = run("merge", pair[0], pair[1], again, "-o", tmp_path / "out", "--no-progress",
                           *(["--stream", "--align", "none"] if stream else []))
        assert code == 2 and "Model 3" in err and "is model 1" in err and "--weights" in err, err
    assert _written(tmp_path) == ["link"]


def test_merge_refuses_one_module_given_twice():
    import symgraph
    from symgraph.errors import SymgraphError

    x = torch.randn(3, 8)
    model = _Masked(0, [True, True, True, True])
    with pytest.raises(SymgraphError, match="Model 2 .* is model 1"):
        symgraph.merge([symgraph.load(model, (x,)), symgraph.load(model, (x,))], align="none", progress=False)


# ---------------------------------------------------------------------------------------------------------------
# what users hand over as a model: adapters, GGUF files, configs naming no class or custom code
# ---------------------------------------------------------------------------------------------------------------

def _adapter(folder):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    safetensors.torch.save_file({"base_model.model.q_proj.lora_A.weight": torch.zeros(8, 32)},
                                folder / "adapter_model.safetensors")
    return folder


def _gguf_file(folder):
    folder.mkdir()
    (folder / "model-q4_k_m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    return folder / "model-q4_k_m.gguf"


def _gguf_beside_config(folder):
    _llama(folder).joinpath("model.safetensors").unlink()
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    return folder


@pytest.mark.parametrize("make, words", [
    (_adapter, ["adapter_config.json", "PEFT adapter", "merge_and_unload"]),
    (_gguf_file, ["model-q4_k_m.gguf", "GGUF", "Hugging Face checkpoint"]),
    (_gguf_beside_config, ["model.gguf", "GGUF"]),
])
def test_other_formats_are_named_for_what_they_are(tmp_path, make, words):
    """Before: an adapter folder was 'a folder without config.json', a .gguf file 'neither a model folder nor a
    config.json', a config beside a .gguf file 'no weights found'."""
    source = make(tmp_path / "given")
    code, _, err = run("transform", source, "-o", tmp_path / "out")
    assert code == 2 and all(w in err for w in words), err
    assert _written(tmp_path) == ["given"]


def test_a_config_naming_no_class_says_which_class_the_weights_are(tmp_path):
    """Before: 'lm_head.weight in the file but not in the model' (the bare LlamaModel), with no word on why."""
    folder = _llama(tmp_path / "m", config_edit=lambda config: config.pop("architectures"))
    code, _, err = run("report", folder)
    assert code == 2 and 'names no class transformers has in "architectures"' in err, err
    assert '"architectures": ["LlamaForCausalLM"]' in err


@pytest.mark.parametrize("model_type", ["llama", "my-llama"])
def test_a_class_in_custom_code_is_refused_not_replaced_by_the_stock_one(tmp_path, model_type):
    """Before: with a known model_type the stock bare LlamaModel was built in place of the custom class (and
    analysed when the weights fitted it); with an unknown one, the error spoke of a misspelt model_type."""
    def custom(config):
        config.update(model_type=model_type, architectures=["MyLlama"],
                      auto_map={"AutoModelForCausalLM": "modeling_my.MyLlama"})

    folder = _llama(tmp_path / "m", config_edit=custom)
    (folder / "modeling_my.py").write_text("raise SystemExit('custom code ran')\n")
    for args in (["report", folder], ["report", folder / "config.json", "--config-only"]):
        code, _, err = run(*args)
        assert code == 2 and "custom code" in err and "modeling_my.MyLlama" in err and "trust_remote_code" in err, err


@pytest.mark.parametrize("command", ["transform", "merge-stream"])
def test_an_output_over_the_files_an_input_links_to_is_refused(tmp_path, pair, command):
    """A model folder of links to files kept elsewhere (as the Hugging Face cache keeps them). Before: writing to
    the folder the links point into was allowed, and replaced the input's files (its links then dangled)."""
    import shutil

    kept = tmp_path / "kept"
    shutil.copytree(pair[0], kept)
    links = tmp_path / "links"
    links.mkdir()
    for file in kept.iterdir():
        (links / file.name).symlink_to(file)
    before = tree_digest(kept)
    args = ["transform", links] if command == "transform" else ["merge", links, pair[1], "--stream", "--align", "none"]
    for out in (kept, kept / "sub"):
        code, _, err = run(*args, "-o", out, "--overwrite")
        assert code == 2 and "input" in err and f"links into '{kept}'" in err, err
    assert tree_digest(kept) == before and _written(tmp_path) == ["kept", "links"]


def test_a_parametrized_or_shared_module_is_loaded_with_its_structure():
    """symgraph's own module tree must not pickle (parametrized modules refuse it) and must keep a layer used twice
    one layer."""
    import symgraph
    from torch.nn.utils.parametrizations import weight_norm

    x = torch.randn(2, 4)
    normed = torch.nn.Sequential(weight_norm(torch.nn.Linear(4, 8)), torch.nn.ReLU(), torch.nn.Linear(8, 3)).train()
    subject = symgraph.load(normed, (x,))
    assert subject.report is not None and normed.training and not subject.model[0].training
    assert symgraph.transform(normed, inputs=(x,)).keys() == normed.state_dict().keys()
    shared = torch.nn.Linear(4, 4)
    twice = torch.nn.Sequential(shared, torch.nn.ReLU(), shared).train()
    own = symgraph.load(twice, (x,)).model
    assert own[0] is own[2] and own[0] is not shared and own[0].weight is shared.weight and twice.training


@pytest.mark.parametrize("method", ["simple", "fisher"])
def test_alpha_without_regmean_is_refused_instead_of_ignored(tmp_path, pair, method):
    out = tmp_path / "merged"
    code, _, err = run("merge", *pair, "-o", out, "--method", method, "--alpha", "0.5", "--align", "none",
                       "--no-progress")
    assert code == 2 and "--alpha is RegMean's shrinkage" in err and f"--method {method}" in err
    assert not out.exists()
