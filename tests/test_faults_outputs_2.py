"""Written models lose nothing of their inputs, and what cannot be written is refused where it is written: read-only
commands read every checkpoint they can analyse (second pass; see test_faults_outputs.py)."""
from __future__ import annotations

import json
import logging

import pytest
import safetensors.torch
import torch
import transformers

from cli_runner import run
from symgraph import zoo
from symgraph.errors import ModelLoadError
from symgraph.io import save_model
from test_faults_outputs import _deepseek_v3_with_mtp, _stored, _with_extra

MTP = "model.layers.61.eh_proj.weight"


def test_read_only_commands_read_a_checkpoint_with_tensors_the_model_skips(tmp_path, caplog):
    """Multi-token-prediction layers were refused on loading, so report and fuzz, which write no model, refused
    DeepSeek-V3 / GLM-4.5 / Qwen3-Next checkpoints; now they warn, naming the tensors left out."""
    folder = _deepseek_v3_with_mtp(tmp_path / "m", 0)
    for args in (["report", folder], ["fuzz", folder, "--samples", "1"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symgraph"):
            code, _, err = run(*args)
        assert code == 0, err
        assert MTP in caplog.text and "left out" in caplog.text, caplog.text


def test_commands_writing_moved_weights_refuse_tensors_the_model_skips_before_any_work(tmp_path):
    """align, transform, fold and an in-memory merge would write the model without them: refused before loading,
    naming them and what to do; an anchor holding them is only read (the output is the source's)."""
    folder, other = _deepseek_v3_with_mtp(tmp_path / "m", 0), _deepseek_v3_with_mtp(tmp_path / "o", 1)
    for args in (["transform", folder], ["fold", folder], ["align", folder, other, "--quiet"],
                 ["merge", folder, other, "--align", "none", "--no-progress"]):
        code, _, err = run(*args, "-o", tmp_path / "out")
        assert code == 2 and MTP in err and "does not load" in err and "merge --stream" in err, (args, err)
        assert not (tmp_path / "out").exists()
    file = folder / "model.safetensors"  # without them, it aligns onto an anchor that has them
    safetensors.torch.save_file({k: v for k, v in safetensors.torch.load_file(file).items() if ".61." not in k}, file,
                                metadata={"format": "pt"})
    code, _, err = run("align", folder, other, "--quiet", "--mode", "permutation", "--no-judge-starts", "-o",
                       tmp_path / "out")
    assert code == 0, err


def test_a_streamed_plain_merge_averages_tensors_the_model_skips(tmp_path):
    """merge --stream averages every stored tensor: the multi-token-prediction layers too, as the model's."""
    a, b = _deepseek_v3_with_mtp(tmp_path / "a", 0), _deepseek_v3_with_mtp(tmp_path / "b", 1)
    code, _, err = run("merge", a, b, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code == 0, err
    merged, first, second = _stored(tmp_path / "out"), _stored(a), _stored(b)
    assert merged.keys() == first.keys()
    assert torch.allclose(merged[MTP], (first[MTP] + second[MTP]) / 2)


def test_a_streamed_alignment_refuses_tensors_not_in_the_model(tmp_path):
    """Tensors the class does not skip belong to another model: refused as loading refuses them."""
    extra = {"extra.weight": torch.ones(3)}
    a, b = _with_extra(tmp_path / "a", "llama", extra), _with_extra(tmp_path / "b", "llama", extra, seed=1)
    code, _, err = run("align", a, b, "--stream", "--quiet", "-o", tmp_path / "out")
    assert code == 2 and "extra.weight" in err and "not in the model" in err, err


def test_save_model_refuses_to_drop_tensors_the_model_skips(tmp_path):
    """The Python API: a state loaded without the multi-token-prediction layers, written like its checkpoint."""
    folder = _deepseek_v3_with_mtp(tmp_path / "m", 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ModelLoadError, match="does not load"):
        save_model(model.state_dict(), tmp_path / "out", config=model.config, like=folder)
    assert not (tmp_path / "out").exists()


def _sharded(folder, seed: int, index_metadata: dict):
    """A llama checkpoint in two shards whose index "metadata" holds ``index_metadata`` beside total_size."""
    zoo.build("llama", seed=seed).save_pretrained(folder, max_shard_size="100KB")
    index = folder / "model.safetensors.index.json"
    stored = json.loads(index.read_text())
    stored["metadata"].update(index_metadata)
    index.write_text(json.dumps(stored))
    return folder


def test_index_metadata_is_carried_into_written_indexes(tmp_path, caplog):
    """Every writer wrote {"total_size": N} alone; now a written index carries the input's other entries (those
    all merged inputs agree on), and a one-file output says it cannot."""
    a = _sharded(tmp_path / "a", 0, {"origin": "lab", "step": 1000})
    b = _sharded(tmp_path / "b", 1, {"origin": "lab", "step": 2000})
    for args in (["align", a, b, "--stream", "--quiet"], ["merge", a, b, "--stream", "--align", "none"]):
        out = tmp_path / args[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symgraph"):
            code, _, err = run(*args, "--shard-size", "100KB", "-o", out)
        assert code == 0, err
        metadata = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
        expected = {"origin": "lab"} if args[0] == "merge" else {"origin": "lab", "step": 1000}
        assert {k: v for k, v in metadata.items() if k != "total_size"} == expected, metadata
        assert metadata["total_size"] == sum(f.stat().st_size for f in out.glob("*.safetensors")) - sum(
            8 + int.from_bytes(f.read_bytes()[:8], "little") for f in out.glob("*.safetensors"))
        assert ("step" in caplog.text) == (args[0] == "merge"), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="symgraph"):
        code, _, err = run("transform", a, "-o", tmp_path / "one")
    assert code == 0 and "one file with no index: origin, step" in caplog.text, err + caplog.text


def test_a_streamed_merge_refuses_a_folder_without_config(tmp_path):
    """merge --stream took the config from the first model and compared configs only where both had one: with the
    first lacking config.json it wrote a folder that does not load; with another lacking it, it merged weights of
    no known architecture into the first's. Bare checkpoints alone (none has a config) still average."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
    (a / "config.json").unlink()
    for models in ((a, b), (b, a)):
        code, _, err = run("merge", *models, "--stream", "--align", "none", "-o", tmp_path / "out")
        assert code == 2 and f"({a}) has no config.json" in err, err
        assert not (tmp_path / "out").exists()


def _tokenizer_with_named_templates(folder):
    """A word-level tokenizer saved beside a model with a default and a named chat template (transformers writes the
    named one to additional_chat_templates/tool_use.jinja)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="t2")
    tokenizer.chat_template = {"default": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                               "tool_use": "tools: {{ tools }}"}
    tokenizer.save_pretrained(folder)


def test_named_chat_templates_are_carried(tmp_path):
    """The output's tokenizer had the default chat template only: additional_chat_templates/ was not copied."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
        _tokenizer_with_named_templates(folder)
    for args in (["transform", a], ["merge", a, b, "--stream", "--align", "none"]):
        code, _, err = run(*args, "-o", tmp_path / args[0])
        assert code == 0, err
        templates = transformers.AutoTokenizer.from_pretrained(tmp_path / args[0]).chat_template
        assert templates == transformers.AutoTokenizer.from_pretrained(a).chat_template, templates


def _with_own_code(folder, seed: int):
    """A llama checkpoint whose config.json maps the auto classes to code shipped beside it (trust_remote_code),
    the model's module importing a helper relatively; the code computes what transformers' llama computes."""
    zoo.build("llama", seed=seed).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_x.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass XConfig(LlamaConfig):\n    model_type = 'llama'\n")
    (folder / "helpers_x.py").write_text("from transformers import LlamaForCausalLM as Base\n")
    (folder / "modeling_x.py").write_text(
        "from .configuration_x import XConfig\nfrom .helpers_x import Base\n\n\n"
        "class XForCausalLM(Base):\n    config_class = XConfig\n")
    return folder


def test_code_the_config_maps_is_carried(tmp_path, caplog):
    """The output kept config.json's auto_map but not the code it names: loading it as the input loads
    (trust_remote_code=True) failed on the missing configuration_x.py."""
    a, b = _with_own_code(tmp_path / "a", 0), _with_own_code(tmp_path / "b", 1)
    for args in (["transform", a], ["merge", a, b, "--stream", "--align", "none"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symgraph"):
            code, _, err = run(*args, "-o", tmp_path / args[0])
        assert code == 0, err
        assert "Not copied" not in caplog.text, caplog.text
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / args[0], trust_remote_code=True)
        assert type(model).__name__ == "XForCausalLM"


def test_an_output_inside_a_file_is_refused_saying_so(tmp_path):
    """-o FILE/out failed with the OS's bare "File exists" (from creating the output's folders)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
    (tmp_path / "notes").write_text("x")
    for args in (["transform", a], ["merge", a, b, "--stream", "--align", "none"]):
        code, _, err = run(*args, "-o", tmp_path / "notes" / "deeper" / "out")
        assert code == 2 and f"'{tmp_path / 'notes'}' is a file" in err, err


def test_a_merge_of_models_with_different_tokenizers_says_so(tmp_path, caplog):
    """The merge carried the reference model's tokenizer without a word when the other's differed."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
        _tokenizer_with_named_templates(folder)
    (b / "tokenizer_config.json").write_text(json.dumps({**json.loads((b / "tokenizer_config.json").read_text()),
                                                         "eos_token": "t3"}))
    for extra in (["--align", "none", "--no-progress"], ["--stream", "--align", "none"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symgraph"):
            code, _, err = run("merge", a, b, *extra, "-o", tmp_path / extra[0])
        assert code == 0, err
        assert "tokenizer_config.json differ" in caplog.text and "tokenizer.json" not in caplog.text, caplog.text


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_failing_after_its_first_shard_leaves_nothing(tmp_path, monkeypatch, failure):
    """Nothing stays of a write that fails or is interrupted midway: no temporary folder, no side file, and not the
    folders made to hold the output (-o new/deep/out left new/deep behind); an output replaced stays as it was."""
    import symgraph.shards
    from cli_runner import tree_digest

    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
    zoo.build("llama", seed=2).save_pretrained(tmp_path / "old")
    before, written = tree_digest(tmp_path / "old"), []
    write_shard = symgraph.shards._write_shard

    def failing(path, *args):
        if written:
            raise failure
        written.append(path)
        write_shard(path, *args)

    monkeypatch.setattr(symgraph.shards, "_write_shard", failing)
    for out, extra in ((tmp_path / "new" / "deep" / "out", []), (tmp_path / "old", ["--overwrite"])):
        written.clear()
        code, _, err = run("merge", a, b, "--stream", "--align", "none", "--shard-size", "50KB", "-o", out,
                           "--json", tmp_path / "merge.json", *extra)
        assert code == (130 if isinstance(failure, KeyboardInterrupt) else 2) and written, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "old"]
        assert tree_digest(tmp_path / "old") == before


def test_a_streamed_command_on_a_bin_checkpoint_says_what_works(tmp_path):
    """The hint named save_pretrained(safe_serialization=True), an argument transformers 5 no longer has."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed, folder in enumerate((a, b)):
        zoo.build("llama", seed=seed).save_pretrained(folder)
    torch.save(safetensors.torch.load_file(a / "model.safetensors"), a / "pytorch_model.bin")
    (a / "model.safetensors").unlink()
    code, _, err = run("merge", a, b, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code == 2 and "safe_serialization" not in err and "without --stream" in err, err
    code, _, err = run("merge", a, b, "--align", "none", "--no-progress", "-o", tmp_path / "out")
    assert code == 0, err
