"""Bad checkpoints are refused, and written checkpoints reload exactly: nothing lost, nothing filled in at random.

Each command that reads a model must stop (exit 2, one paragraph naming the tensor, nothing written) on a
checkpoint that transformers would silently complete with random values; every written folder must reload with no
missing or unexpected key, whatever values its tensors hold.
"""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
import transformers

from cli_runner import run, tree_digest
from symgraph import zoo
from symgraph.errors import ModelLoadError
from symgraph.io import load_model, model_config, save_model, state_dict_of

MODEL_COMMANDS = {  # every command that reads MODEL arguments, with the rest of its arguments
    "report": lambda m, o: ["report", m, "-o", o / "r.md"],
    "transform": lambda m, o: ["transform", m, "-o", o / "t"],
    "fuzz": lambda m, o: ["fuzz", m, "--samples", "1", "--json", o / "f.json"],
    "align": lambda m, o: ["align", m, m, "-o", o / "a"],
    "merge": lambda m, o: ["merge", m, m, "-o", o / "m"],
    "barrier": lambda m, o: ["barrier", m, m, "--data", "digits", "--limit", "4", "-o", o / "b.png"],
}


def _saved(family: str, folder, **edits):
    """A zoo model saved by transformers itself; ``edits`` rewrite its stored tensors (None deletes one)."""
    model = zoo.build(family)
    model.save_pretrained(folder)
    file = folder / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    for key, value in edits.items():
        key = key.replace("__", ".")
        if value is None:
            del stored[key]
        else:
            stored[key] = value(stored.get(key))
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    return folder


def _only_output(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "model")


@pytest.mark.parametrize("problem, edits, words", [
    ("missing", dict(classifier__bias=None), ["classifier.bias", "missing", "random"]),
    ("unexpected", dict(extra__weight=lambda _: torch.ones(2)), ["extra.weight", "not in the model"]),
    ("integer", dict(classifier__weight=lambda t: (t * 100).to(torch.int64)), ["classifier.weight", "I64"]),
    ("nan", dict(bert__pooler__dense__bias=lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
     ["NaN or Inf", "bert.pooler.dense.bias"]),
])
def test_bad_checkpoint_is_refused_by_the_loader(tmp_path, problem, edits, words):
    folder = _saved("bert", tmp_path / "model", **edits)
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_every_command_refuses_a_checkpoint_with_a_missing_tensor(tmp_path, command):
    folder = _saved("bert", tmp_path / "model", classifier__bias=None)
    before = tree_digest(folder)
    code, out, err = run(*MODEL_COMMANDS[command](folder, tmp_path))
    assert code == 2 and "classifier.bias" in err and "missing" in err and "Traceback" not in err, err
    assert _only_output(tmp_path) == [] and tree_digest(folder) == before


def _equal_valued(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every attention projection bias and make every norm the identity (weights 1, biases 0): many tensors
    equal by value (to each other and across layers), none tied."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            owner = owner.rpartition(".")[2].lower()
            if leaf == "bias" and owner in ("q_proj", "k_proj", "v_proj", "query", "key", "value", "q_lin",
                                            "k_lin", "v_lin", "c_attn", "q", "k", "v"):
                param.zero_()
            elif "norm" in owner or owner.startswith("ln"):
                param.fill_(1.0 if leaf == "weight" else 0.0)
    return model


@pytest.mark.parametrize("family", zoo.HF_FAMILIES)
def test_saved_folder_matches_save_pretrained_and_reloads_whole(tmp_path, family):
    model = _equal_valued(zoo.build(family))
    state = state_dict_of(model)
    out = save_model(state, tmp_path / "ours", config=model_config(model))
    model.save_pretrained(tmp_path / "theirs")
    ours = safetensors.torch.load_file(out / "model.safetensors")
    assert ours.keys() == safetensors.torch.load_file(tmp_path / "theirs" / "model.safetensors").keys()

    cls = getattr(transformers, model_config(model).architectures[0])
    again, info = cls.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    reloaded = again.state_dict()
    for key, value in state.items():
        assert torch.equal(reloaded[key], value), key


def test_tied_tensors_that_differ_are_refused(tmp_path):
    model = zoo.build("llama-tied")
    state = {k: v.clone() for k, v in state_dict_of(model).items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(Exception, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
        save_model(state, tmp_path / "out", config=model_config(model))
    assert not (tmp_path / "out").exists()


def _dinov2(folder):
    """A DINOv2 checkpoint as transformers 5 writes it: legacy key names (attention.attention.key, loaded as
    attention.k_proj), with every q/k/v bias zero."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, image_size=16, patch_size=4)
    model = transformers.Dinov2Model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.zero_()
    model.save_pretrained(folder)
    return model


def test_transform_of_a_legacy_named_checkpoint_keeps_every_tensor(tmp_path):
    model = _dinov2(tmp_path / "dino")
    stored = safetensors.torch.load_file(tmp_path / "dino" / "model.safetensors")
    assert "encoder.layer.0.attention.attention.key.bias" in stored  # the legacy name is what is on disk
    code, out, err = run("transform", tmp_path / "dino", "-o", tmp_path / "t")
    assert code == 0, err
    written = safetensors.torch.load_file(tmp_path / "t" / "model.safetensors")
    assert written.keys() == stored.keys()
    assert all(torch.count_nonzero(written[k]) == 0 for k in stored if k.endswith(("query.bias", "key.bias")))
    again, info = transformers.Dinov2Model.from_pretrained(tmp_path / "t", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(again(pixels).last_hidden_state, model(pixels).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# outputs: never an input, never half written, nothing left behind
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A tiny BERT checkpoint written by transformers (copy it before changing anything in it)."""
    return _saved("bert", tmp_path_factory.mktemp("bert") / "model")


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("where", ["is", "inside", "contains", "link"])
@pytest.mark.parametrize("command", ["transform", "align", "merge"])
def test_an_output_that_overlaps_an_input_is_refused(tmp_path, bert_folder, command, where):
    import shutil

    model = tmp_path / "work" / "model"
    shutil.copytree(bert_folder, model)
    (tmp_path / "link").symlink_to(model)
    output = {"is": model, "inside": model / "sub", "contains": model.parent, "link": tmp_path / "link"}[where]
    before = tree_digest(tmp_path / "work")
    args = [command, model, "-o", output, "--overwrite"] if command == "transform" else \
        [command, model, model, "-o", output, "--overwrite"]
    code, out, err = run(*args)
    assert code == 2 and "input" in err and "Traceback" not in err, err
    assert tree_digest(tmp_path / "work") == before and sorted(p.name for p in model.iterdir()) == \
        ["config.json", "model.safetensors"]


def test_a_report_may_not_replace_an_input_file(tmp_path, bert_folder):
    code, _, err = run("report", bert_folder, "-o", bert_folder / "config.json")
    assert code == 2 and "input" in err
    assert (bert_folder / "config.json").read_text().startswith("{")


@pytest.mark.parametrize("command", ["report", "merge"])
def test_a_side_file_may_not_replace_any_file_of_an_input_folder(tmp_path, bert_folder, command):
    """Not only the model files: a model card, licence or custom code beside the weights is the input's too."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(bert_folder, model)
    (model / "README.md").write_text("# card\n")
    args = ["report", model, "-o", model / "README.md"] if command == "report" else \
        ["merge", model, bert_folder, "-o", tmp_path / "out", "--align", "none", "--json", model / "README.md"]
    code, _, err = run(*args)
    assert code == 2 and "input" in err, err
    assert (model / "README.md").read_text() == "# card\n" and not (tmp_path / "out").exists()


def test_overwrite_recovers_a_replacement_that_died_between_its_renames(tmp_path, bert_folder):
    """Without renameat2, --overwrite moves the old folder aside first; if the process dies right then, the next
    run to the same output puts the old folder back (and without --overwrite refuses, the old folder intact)."""
    out = tmp_path / "out"
    assert run("transform", bert_folder, "-o", out).returncode == 0
    before = tree_digest(out)
    dead = _dead_pid()
    out.rename(tmp_path / f".out.old-{dead}-0badc0de")
    (tmp_path / f".out.tmp-{dead}-0badc0de").mkdir()  # the new copy it was writing
    code, _, err = run("transform", bert_folder, "-o", out)
    assert code == 2 and "already exists" in err
    assert tree_digest(out) == before and _leftovers(tmp_path) == []
    assert run("transform", bert_folder, "-o", out, "--overwrite", "--seed", "1").returncode == 0
    assert tree_digest(out) != before and _leftovers(tmp_path) == []


def test_leftovers_of_a_live_process_are_kept(tmp_path):
    from symgraph.files import clean_leftovers

    out = tmp_path / "out"
    live, dead = tmp_path / f".out.tmp-{os.getppid()}-1234abcd", tmp_path / f".out.tmp-{_dead_pid()}-1234abcd"
    for folder in (live, dead):
        folder.mkdir()
    (tmp_path / ".other.tmp-1-1234abcd").mkdir()  # another output's: not ours to judge
    clean_leftovers(out)
    assert _leftovers(tmp_path) == [".other.tmp-1-1234abcd", live.name]


def test_overwrite_swaps_in_one_step(tmp_path, monkeypatch):
    """Where renameat2 exists the old and new folders are exchanged atomically: os.rename is never called on an
    existing output, so no moment exists at which OUT is missing."""
    from symgraph import files

    out = tmp_path / "out"
    save_model({"w": torch.zeros(2)}, out)
    renames = []
    real = files.os.rename
    monkeypatch.setattr(files.os, "rename", lambda a, b: (renames.append((a, b)), real(a, b)))
    save_model({"w": torch.ones(2)}, out, overwrite=True)
    assert renames == [] and _leftovers(tmp_path) == []
    assert torch.equal(safetensors.torch.load_file(out / "model.safetensors")["w"], torch.ones(2))


@pytest.mark.parametrize("name, exit_code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_write_removes_the_temporary_folder(tmp_path, bert_folder, monkeypatch, name, exit_code):
    import signal

    sig = getattr(signal, name)

    def killed(*args, **kwargs):
        # never kill the test runner itself: a handler that raises must be installed by now
        assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    # a process started in the background by a non-interactive shell inherits SIGINT ignored, and Python then keeps
    # it ignored: give SIGINT Python's usual handler, as an interactive run has, for this test only
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run("transform", bert_folder, "-o", tmp_path / "out")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == exit_code, err
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_right_after_the_temporary_folder_is_made_removes_it(tmp_path, monkeypatch):
    """Ctrl-C between the mkdir of the temporary folder and the block that removes it on failure left
    ``.out.tmp-<pid>-<hex>`` behind (seen once in six Ctrl-C's of ``symgraph fold`` as its write began)."""
    from pathlib import Path

    from symgraph.checkpoint import staged_folder

    mkdir = Path.mkdir

    def mkdir_then_interrupt(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if ".tmp-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt), staged_folder(tmp_path / "out", overwrite=False):
        pass
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    """A process id that is not running (a child that has exited and been reaped)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_an_unwritable_report_target_is_bad_output(tmp_path, bert_folder, monkeypatch):
    from symgraph import files

    (tmp_path / "a_file").write_text("x")
    code, _, err = run("report", bert_folder, "-o", tmp_path / "a_file" / "r.md")
    assert code == 2 and "it is a file" in err, err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(files.os, "replace", read_only)
    code, _, err = run("report", bert_folder, "-o", tmp_path / "r.md")
    assert code == 2 and "Read-only file system" in err and "internal error" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("command", ["align", "merge"])
def test_a_side_file_that_cannot_be_written_stops_before_the_model(tmp_path, bert_folder, command):
    option = "--stats" if command == "align" else "--json"
    code, _, err = run(command, bert_folder, bert_folder, "-o", tmp_path / "out", option,
                       tmp_path / "missing" / "s.json")
    assert code == 2 and "does not exist" in err, err
    assert list(tmp_path.iterdir()) == []


def test_side_file_and_model_are_both_written(tmp_path, bert_folder):
    code, _, err = run("align", bert_folder, bert_folder, "-o", tmp_path / "out", "--stats", tmp_path / "s.json",
                       "--quiet")
    assert code == 0, err
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["timings_s"]["write"] > 0  # staged before the model, completed after it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.json"]


@pytest.mark.parametrize("layers, words", [("99-100", ["outside the model", "0-1"]), ("2-0", ["reversed"]),
                                           ("1-5", ["outside the model"])])
def test_layer_ranges_outside_the_model_are_refused(tmp_path, bert_folder, layers, words):
    code, _, err = run("align", bert_folder, bert_folder, "-o", tmp_path / "out", "--layers", layers)
    assert code == 2 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_layer_range_is_checked_by_the_api_too():
    import symgraph
    from symgraph.errors import SymgraphError

    a = zoo.build("bert")
    with pytest.raises(SymgraphError, match="outside the model"):
        symgraph.align(symgraph.load(a, zoo.example_inputs_for("bert", a)), symgraph.load(a, zoo.example_inputs_for(
            "bert", a)), layers=(2, 3))


@pytest.mark.parametrize("command", ["transform", "fuzz"])
def test_nan_weights_are_named_as_bad_input(tmp_path, command):
    folder = _saved("bert", tmp_path / "model",
                    bert__encoder__layer__1__output__dense__weight=lambda t: t.index_fill(0, torch.tensor([0]),
                                                                                       float("inf")))
    args = ["transform", folder, "-o", tmp_path / "t"] if command == "transform" else ["fuzz", folder]
    code, out, err = run(*args)
    assert code == 2 and "bert.encoder.layer.1.output.dense.weight" in err and "NaN or Inf" in err, err
    assert "bug" not in err and "VIOLATE" not in out


# ---------------------------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------------------------

def test_a_config_transformers_rejects_keeps_its_reason(tmp_path, bert_folder):
    folder = tmp_path / "m"
    folder.mkdir()
    config = json.loads((bert_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5}))
    code, _, err = run("report", folder / "config.json", "--config-only")
    assert code == 2 and "not a multiple" in err and "(5)" in err, err


def test_weights_file_that_is_a_folder(tmp_path, bert_folder):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((bert_folder / "config.json").read_text())
    (folder / "model.safetensors").mkdir()
    code, _, err = run("report", folder)
    assert code == 2 and "is a folder, not a weights file" in err and "only reads" not in err, err


def test_weightless_folder_does_not_offer_transform_an_option_it_lacks(tmp_path, bert_folder):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((bert_folder / "config.json").read_text())
    code, _, err = run("transform", folder, "-o", tmp_path / "out")
    assert code == 2 and "No weights" in err and "report --config-only" in err and "pass --config-only" not in err


@pytest.mark.parametrize("output", ["", "."])
def test_an_output_naming_no_folder_is_refused(tmp_path, bert_folder, output):
    code, _, err = run("transform", bert_folder, "-o", output)
    assert code == 2 and "names no folder" in err and "already exists" not in err, err


def test_a_factory_calling_sys_exit_is_an_error(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\n\ndef build():\n    sys.exit(7)\n")
    code, _, err = run("report", f"{tmp_path / 'exits.py'}:build")
    assert code == 2 and "sys.exit(7)" in err, err


def test_an_output_symlink_is_called_a_link(tmp_path, bert_folder):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    code, _, err = run("transform", bert_folder, "-o", tmp_path / "link", "--overwrite")
    assert code == 2 and "symbolic link" in err and "not a folder" not in err, err
    assert (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_transform_rounds_once_and_says_so(tmp_path, dtype):
    import symgraph
    from symgraph.elements import apply

    model = zoo.build("llama", dtype=dtype)
    folder = save_model(state_dict_of(model), tmp_path / "m", config=model_config(model))
    code, out, err = run("transform", folder, "-o", tmp_path / "t", "--seed", "3")
    name = str(dtype).removeprefix("torch.")
    assert code == 0 and "tolerance" in out and f"{name} weights rounded once" in out, err
    error = float(out.split("relative error ")[1].split(" ")[0])
    assert 0 < error < 3e-2  # rounding shows, as the message says, within the dtype's tolerance

    subject = symgraph.load(folder)
    exact = apply({k: v.double() for k, v in subject.state_dict().items()},
                  symgraph.sample_elements(subject.report, 3))
    written = safetensors.torch.load_file(tmp_path / "t" / "model.safetensors")
    for key, value in written.items():  # each weight is the float64 result rounded once to the dtype
        assert value.dtype == dtype and torch.equal(value, exact[key].to(dtype)), key


def test_transform_of_a_checkpoint_with_gamma_beta_names_reloads_whole(tmp_path):
    """Old checkpoints name LayerNorm parameters gamma/beta; transformers renames them on load. The output is
    written with the model's names and loads back with nothing missing or unexpected."""
    folder = tmp_path / "old"
    model = zoo.build("bert")
    model.save_pretrained(folder)
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in stored.items()}
    assert renamed.keys() != stored.keys()
    safetensors.torch.save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run("transform", folder, "-o", tmp_path / "t")
    assert code == 0, err
    again, info = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "t",
                                                                             output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    args, kwargs = zoo.example_inputs_for("bert", model)
    with torch.no_grad():
        torch.testing.assert_close(again(*args, **kwargs).logits, model(*args, **kwargs).logits,
                                   rtol=1e-4, atol=1e-5)


def test_report_into_a_pipe_is_streamed_and_the_pipe_kept(tmp_path, bert_folder):
    """A named pipe (or /dev/stdout) is written into, not replaced by a file (which, run as root, would replace
    a device node)."""
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    code, _, err = run("report", bert_folder, "-o", fifo, "--format", "json")
    reader.join(timeout=60)
    assert code == 0, err
    assert json.loads(received[0])["model"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_report_through_a_link_replaces_the_linked_file(tmp_path, bert_folder):
    (tmp_path / "target.md").write_text("old")
    (tmp_path / "link.md").symlink_to(tmp_path / "target.md")
    code, _, err = run("report", bert_folder, "-o", tmp_path / "link.md")
    assert code == 0, err
    assert (tmp_path / "link.md").is_symlink() and (tmp_path / "target.md").read_text().startswith("#")


def test_integer_tensor_under_a_legacy_name_is_refused(tmp_path):
    """The stored name (attention.attention.key) is mapped through transformers' own load-time renaming to the
    float parameter it fills (attention.k_proj)."""
    _dinov2(tmp_path / "dino")
    file = tmp_path / "dino" / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    key = "encoder.layer.0.attention.attention.key.weight"
    stored[key] = (stored[key] * 100).to(torch.int32)
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path / "dino")
    assert f"{key} (I32" in str(info.value)


def test_save_model_refuses_to_write_into_the_folder_it_copies_from(bert_folder):
    from symgraph.errors import OutputError

    before = tree_digest(bert_folder)
    state = state_dict_of(load_model(bert_folder).model)
    for out in (bert_folder, bert_folder / "aligned"):
        with pytest.raises(OutputError, match="input"):
            save_model(state, out, like=bert_folder, overwrite=True)
    assert tree_digest(bert_folder) == before


def test_fused_moe_experts_are_written_per_expert_like_save_pretrained(tmp_path):
    """transformers 5 fuses Mixtral's per-expert weights on load and splits them again on save; so do we."""
    config = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    out = save_model(state_dict_of(model), tmp_path / "ours", config=model_config(model))
    model.save_pretrained(tmp_path / "theirs")
    ours = safetensors.torch.load_file(out / "model.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "theirs" / "model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) > len(model.state_dict())  # split per expert
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    again, info = type(model).from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_report_may_sit_beside_the_model_files(tmp_path):
    """A new file beside the model files is fine; replacing one already there is not, even an earlier report:
    symgraph cannot tell it from the folder's model card, and the message says what to do."""
    folder = _saved("bert", tmp_path / "model")
    code, _, err = run("report", folder, "-o", folder / "report.md")
    assert code == 0, err
    written = (folder / "report.md").read_text()
    code, _, err = run("report", folder, "-o", folder / "report.md", "--format", "json")
    assert code == 2 and "already in the input folder" in err and "new file name" in err, err
    assert (folder / "report.md").read_text() == written
    code, _, err = run("report", folder, "-o", folder / "tokenizer.json")
    assert code == 2 and "input" in err


def test_integer_tensor_in_a_pytorch_bin_checkpoint_is_refused(tmp_path):
    folder = _saved("bert", tmp_path / "model")
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    stored["classifier.weight"] = (stored["classifier.weight"] * 100).to(torch.int64)
    torch.save(stored, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    assert "classifier.weight (int64 in pytorch_model.bin)" in str(info.value)


def test_a_custom_class_is_saved_with_its_own_keys(tmp_path):
    """A config naming a class transformers does not have (custom code) has no known layout: every tensor is
    written under its own name."""
    model = zoo.build("llama-tied")
    config = model_config(model)
    config.architectures = ["MyOwnLlama"]
    state = state_dict_of(model)
    out = save_model(state, tmp_path / "out", config=config)
    assert safetensors.torch.load_file(out / "model.safetensors").keys() == state.keys()


def test_missing_batchnorm_counters_are_no_missing_weights(tmp_path):
    """Checkpoints converted from other libraries often lack num_batches_tracked: an integer counter that starts
    at 0, not a weight filled at random. A missing running mean is a missing weight."""
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    transformers.ResNetForImageClassification(config).eval().save_pretrained(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    counters = [k for k in stored if k.endswith("num_batches_tracked")]
    assert counters
    safetensors.torch.save_file({k: v for k, v in stored.items() if k not in counters}, file,
                                metadata={"format": "pt"})
    load_model(tmp_path / "m")
    mean = next(k for k in stored if k.endswith("running_mean"))
    safetensors.torch.save_file({k: v for k, v in stored.items() if k not in counters and k != mean}, file,
                                metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path / "m")
    assert f"initialise them afresh, weights at random): {mean}." in str(info.value)


# -- checkpoints of mixed dtypes ------------------------------------------------------------------------------------
def _mixed_dtypes(folder, seed: int):
    """A llama checkpoint as some are stored: bfloat16 weights, float32 norm weights, config dtype bfloat16."""
    model = zoo.build("llama", seed=seed, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.data = (1 + 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixed")
    return _mixed_dtypes(base / "m0", 0), _mixed_dtypes(base / "m1", 1)


def _stored_dtypes_of(folder) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in safetensors.torch.load_file(folder / "model.safetensors").items()}


def _computes_what(source, written) -> float:
    """The relative difference of the two folders' logits, both run in float64."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float64)(input_ids=ids).logits
                  for f in (source, written)]
    return float((logits[0] - logits[1]).norm() / logits[0].norm())


@pytest.mark.parametrize("command", [
    ["align", "{m1}", "{m0}", "--only", "attention"], ["align", "{m1}", "{m0}"], ["fold", "{m1}"],
    ["transform", "{m1}", "--seed", "2"],
])
def test_a_checkpoint_of_mixed_dtypes_is_written_in_its_stored_dtypes(tmp_path, mixed_pair, command):
    m0, m1 = mixed_pair
    before = tree_digest(m1)
    code, out, err = run(*[a.format(m0=m0, m1=m1) for a in command], "-o", tmp_path / "out")
    assert code == 0, err
    assert _stored_dtypes_of(tmp_path / "out") == _stored_dtypes_of(m1)  # float32 norms stay float32
    assert _computes_what(m1, tmp_path / "out") < 3e-2  # bfloat16 weights rounded once
    assert tree_digest(m1) == before
    if "--only" in command:  # no attention group moves a norm, an embedding or an MLP: bit for bit the source's
        source = safetensors.torch.load_file(m1 / "model.safetensors")
        written = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
        unmoved = [k for k in source if "self_attn" not in k]
        assert unmoved and all(torch.equal(written[k], source[k]) for k in unmoved)


def test_a_merge_of_mixed_dtypes_keeps_the_stored_dtypes(tmp_path, mixed_pair):
    m0, m1 = mixed_pair
    code, out, err = run("merge", m0, m1, "-o", tmp_path / "out")
    assert code == 0, err
    assert _stored_dtypes_of(tmp_path / "out") == _stored_dtypes_of(m0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # as the inputs' config.json says: transformers loads them so


def test_streamed_and_in_memory_alignments_of_mixed_dtypes_agree(tmp_path, mixed_pair):
    m0, m1 = mixed_pair
    for extra in ([], ["--stream"]):
        code, out, err = run("align", m1, m0, "-o", tmp_path / f"out{len(extra)}", "--no-fold", *extra)
        assert code == 0, err
    assert _stored_dtypes_of(tmp_path / "out0") == _stored_dtypes_of(tmp_path / "out1") == _stored_dtypes_of(m1)
    configs = [json.loads((tmp_path / f"out{i}" / "config.json").read_text()) for i in (0, 1)]
    assert configs[0]["dtype"] == configs[1]["dtype"] == "bfloat16"


def test_a_checkpoint_stored_narrower_than_its_config_is_computed_in_the_config_dtype(tmp_path):
    """config.json says float32 and the weights are stored in bfloat16: the model runs in float32, as transformers
    would load it (never narrower), and results are written in the stored bfloat16."""
    folder = _saved("llama", tmp_path / "model")
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in stored.items()}, folder / "model.safetensors",
                                metadata={"format": "pt"})
    loaded = load_model(folder)
    assert loaded.model.dtype == torch.float32
    assert set(loaded.stored_dtypes.values()) == {torch.bfloat16}
    code, _, err = run("transform", folder, "-o", tmp_path / "out")
    assert code == 0, err
    assert set(_stored_dtypes_of(tmp_path / "out").values()) == {torch.bfloat16}
