"""Synthetic data for learned matching without a dataset (symgraph.synthetic): what it is made of, how it is
labelled, where it is refused, and learning on it through the API and the CLI."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import symgraph
import symgraph.synthetic
from symgraph import zoo
from symgraph.datasets import Batch, batch_loss, load_data
from symgraph.demo import shipped_pair
from symgraph.errors import DataError
from symgraph.inputs import example_inputs
from symgraph.learn import LearnError, LearnOptions
from symgraph.synthetic import TOP, PathJudge, elements_written, merge_examples, synthetic_data

from cli_runner import run


def _mean_probabilities(models, inputs):
    with torch.no_grad():
        return sum(m(**inputs).logits.softmax(-1) for m in models) / len(models)


def test_a_causal_lm_learns_on_samples_of_both_models_labelled_by_their_mean_prediction():
    a, b = zoo.build("llama", seed=0).eval(), zoo.build("llama", seed=1).eval()
    before = torch.get_rng_state()
    data = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=10, batch_size=4, seed=3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state is left alone
    assert data.task == "causal_lm" and len(data) == 10 and "sampled" in data.name
    ids = torch.cat([batch.inputs["input_ids"] for batch in data.batches])
    assert ids.shape == (10, a.config.max_position_embeddings)  # 128 tokens, fewer where positions run out
    # even rows were sampled from a, odd rows from b: each half is likelier under the model that wrote it
    with torch.no_grad():
        likelihood = [m(input_ids=ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean((1, 2))
                      for m in (a, b)]
    assert (likelihood[0] - likelihood[1])[0::2].mean() > 0 > (likelihood[0] - likelihood[1])[1::2].mean()
    for batch in data.batches:  # the target at each position is the mean prediction there, its top token the label
        mean = _mean_probabilities((a, b), batch.inputs)
        assert torch.equal(batch.labels[:, 1:], mean.argmax(-1)[:, :-1])
        probabilities, ids = batch.targets
        assert ids.shape == (*batch.inputs["input_ids"].shape, TOP) and torch.equal(ids[..., 0], mean.argmax(-1))
        kept = mean.gather(-1, ids)
        assert torch.allclose(probabilities, kept / kept.sum(-1, keepdim=True))
        assert (kept.min(-1).values >= mean.topk(TOP + 1, -1).values[..., -1] - 1e-7).all()  # the likeliest
    again = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=10, batch_size=4, seed=3)
    other = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=10, batch_size=4, seed=4)
    assert all(torch.equal(x.inputs["input_ids"], y.inputs["input_ids"]) for x, y in zip(data.batches, again.batches))
    assert not torch.equal(ids, torch.cat([batch.inputs["input_ids"] for batch in other.batches]))


def test_samples_drawn_in_chunks_keep_each_row_with_the_model_that_wrote_it(monkeypatch):
    """Each endpoint samples its rows of every batch in calls of at most SAMPLED_TOGETHER sequences; cut into
    chunks of 3 across batches of 4, even rows still come from the first model and odd rows from the second."""
    a, b = zoo.build("llama", seed=0).eval(), zoo.build("llama", seed=1).eval()
    monkeypatch.setattr(symgraph.synthetic, "SAMPLED_TOGETHER", 3)
    calls = []
    real = symgraph.synthetic._sampled
    monkeypatch.setattr(symgraph.synthetic, "_sampled", lambda model, first, *rest: calls.append(len(first))
                        or real(model, first, *rest))
    data = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=10, batch_size=4, seed=3)
    assert calls == [3, 2, 3, 2]  # 5 rows per model, in chunks of 3
    ids = torch.cat([batch.inputs["input_ids"] for batch in data.batches])
    assert [len(batch.inputs["input_ids"]) for batch in data.batches] == [4, 4, 2]
    monkeypatch.setattr(symgraph.synthetic, "SAMPLED_TOGETHER", 128)
    whole = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=10, batch_size=4, seed=3)
    # each row's first token is drawn before sampling, whatever the chunks: the rows come back in their places
    assert torch.equal(ids[:, 0], torch.cat([batch.inputs["input_ids"][:, 0] for batch in whole.batches]))
    with torch.no_grad():
        likelihood = [m(input_ids=ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean((1, 2))
                      for m in (a, b)]
    assert (likelihood[0] - likelihood[1])[0::2].mean() > 0 > (likelihood[0] - likelihood[1])[1::2].mean()
    short = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=4, batch_size=4, seed=3, length=16)
    assert short.batches[0].inputs["input_ids"].shape == (4, 16)


def test_a_classifier_learns_on_inverted_inputs_of_its_config_labelled_by_both_models():
    a, b = (symgraph.load(str(p)).model.eval() for p in shipped_pair("vit-digits"))  # trained: classes to invert to
    data = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=40, batch_size=32)
    assert data.task == "classification" and [batch.size for batch in data.batches] == [32, 8]
    assert "inverted" in data.name
    config = a.config
    for index, batch in enumerate(data.batches):
        assert batch.inputs["pixel_values"].shape[1:] == (config.num_channels, config.image_size, config.image_size)
        mean = _mean_probabilities((a, b), batch.inputs)
        assert torch.equal(batch.labels, mean.argmax(-1))
        probabilities, ids = batch.targets  # fewer classes than TOP: the whole distribution
        assert torch.allclose(probabilities, mean.gather(-1, ids))
        # inversion moved the random pixels to where both models together are sure of a class, each its own
        drawn = example_inputs(config, batch=batch.size, seq=8, seed=index)["pixel_values"]
        assert not torch.equal(batch.inputs["pixel_values"], drawn)
        noise = _mean_probabilities((a, b), {"pixel_values": drawn})
        assert mean.max(-1).values.mean() > noise.max(-1).values.mean() + 0.2
    assert len(torch.cat([batch.labels for batch in data.batches]).unique()) >= 5


@pytest.mark.parametrize("task, shape", [("classification", (4, 3)), ("causal_lm", (4, 5, 7))])
def test_the_loss_on_soft_targets_is_their_cross_entropy_over_every_example_and_position(task, shape):
    logits = torch.randn(shape, dtype=torch.float64)
    probabilities, ids = torch.rand((*shape[:-1], 2)).softmax(-1), torch.randint(shape[-1], (*shape[:-1], 2))
    batch = Batch({"x": torch.zeros(shape[0])}, targets=(probabilities, ids))

    class Fixed(torch.nn.Module):  # the loss reads the logits alone
        def forward(self, **inputs):
            return logits

    model = Fixed()
    expected = -(probabilities * logits.log_softmax(-1).gather(-1, ids)).sum() / probabilities[..., 0].numel()
    assert torch.allclose(batch_loss(model, batch, task).double(), expected, atol=1e-6)


@pytest.mark.parametrize("family, task", [("gpt2", "causal_lm"), ("llama-tied", "causal_lm"),
                                          ("bert", "classification"), ("t5", None)])
def test_tied_embeddings_and_encoder_decoders(family, task):
    a, b = zoo.build(family, seed=0).eval(), zoo.build(family, seed=1).eval()
    if task is None:  # an encoder-decoder reads decoder ids the samples would need too: refused
        with pytest.raises(DataError, match="classifiers and causal language models"):
            synthetic_data(a, [a.state_dict(), b.state_dict()], examples=4, batch_size=2)
        return
    data = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=4, batch_size=2)
    assert data.task == task
    for batch in data.batches:  # tied names carry one tensor: the labels are still both models' mean prediction
        assert torch.equal(batch.labels if task == "classification" else batch.targets[1][..., 0],
                           _mean_probabilities((a, b), batch.inputs).argmax(-1))


@pytest.mark.parametrize("head, kind", [("AutoModelForMaskedLM", "random"), ("AutoModelForCausalLM", "sampled")])
def test_sequences_fit_positions_that_start_after_the_padding_index(head, kind):
    """Before: a RoBERTa whose 20 positions start after its padding index (1) ran out of them at 19 and 20 tokens
    (IndexError); the sequences are now as long as the model runs (18)."""
    config = zoo.tiny_config("roberta", max_position_embeddings=20, is_decoder=head == "AutoModelForCausalLM")
    a, b = (getattr(transformers, head).from_config(config).eval() for _ in range(2))
    data = synthetic_data(a, [a.state_dict(), b.state_dict()], examples=4, batch_size=2)
    assert kind in data.name and [tuple(batch.inputs["input_ids"].shape) for batch in data.batches] == [(2, 18)] * 2


@pytest.mark.parametrize("family, inverted", [("vit", True), ("llama", False), ("bert", False)])
def test_the_judge_inverts_a_classifiers_pixels_only_and_makes_each_set_once(family, inverted):
    model = zoo.build(family)
    state = model.state_dict()
    judge = PathJudge(model, state, state, examples=4)
    drawn = judge.examples()
    assert judge.examples() is drawn and judge.examples.inverted() is judge.examples.inverted()
    assert (judge.examples.inverted() is drawn) != inverted
    if inverted:  # the same random pixels, moved by inversion
        assert "inverted inputs" in judge.examples.inverted().name and "random inputs" in drawn.name
        moved = judge.examples.inverted().batches[0].inputs["pixel_values"]
        assert moved.shape == drawn.batches[0].inputs["pixel_values"].shape
        assert not torch.equal(moved, drawn.batches[0].inputs["pixel_values"])


@pytest.mark.parametrize("family, kind", [("vit", "inverted"), ("bert", "random")])
def test_merges_are_scored_on_a_classifiers_pixels_inverted(family, kind):
    """Random pixels ranked vit-digits' merge frames worse than inverted ones (merge_examples' docstring)."""
    model = zoo.build(family)
    state = model.state_dict()
    examples = merge_examples(model, [state, state], examples=4)
    assert f"{kind} inputs" in examples.name and len(examples) == 4


def test_a_config_with_tokens_and_pixels_gets_what_the_models_forward_reads():
    """Before: BEiT's config has a vocabulary (masked-image pretraining), the judge built token ids for it, and
    BEiT's forward failed on the missing pixels with an AttributeError that ended every alignment of it."""
    config = transformers.BeitConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, image_size=8, patch_size=4, num_labels=3)
    model = transformers.BeitForImageClassification(config).eval()
    state = model.state_dict()
    data = synthetic_data(model, [state, state], examples=4, batch_size=2, invert=False)
    assert set(data.batches[0].inputs) == {"pixel_values"} and data.task == "classification"


@pytest.mark.parametrize("family, method, error, refusal, logged", [
    # before: BEiT's forward failed on its config's inputs with an AttributeError nothing caught
    ("vit", "forward", AttributeError("'NoneType' object has no attribute 'shape'"), "returns no logits",
     "returns no logits"),
    # before: generate()'s failure (ProphetNet's positions ran out) ended the alignment that judged its starts
    ("llama", "generate", IndexError("index out of range in self"), "cannot be sampled from LlamaForCausalLM",
     "generate() fails"),
])
def test_a_model_that_fails_on_synthetic_inputs_leaves_the_starts_unjudged(family, method, error, refusal, logged,
                                                                            caplog):
    model = zoo.build(family)

    def fails(*args, **kwargs):
        raise error

    setattr(model, method, fails)
    state = model.state_dict()
    with pytest.raises(DataError, match=refusal):
        synthetic_data(model, [state, state], examples=2, batch_size=2)
    with caplog.at_level("INFO", logger="symgraph.synthetic"):
        assert PathJudge(model, state, state, examples=2)(state) is None
    assert "not judged on synthetic data" in caplog.text and logged in caplog.text


def test_a_model_above_the_judges_size_is_not_judged_and_aligns_by_distance(monkeypatch, caplog):
    """The judge's forward passes grow with the model and the alignment's solves far less (a 58M-parameter
    LLaMA judged its starts in 274 s against 36 s of alignment): above JUDGE_MAX_PARAMETERS nothing is made."""
    a, b = (zoo.build("llama", seed=s) for s in (0, 1))
    size = sum(p.numel() for p in a.parameters())
    state = a.state_dict()
    assert PathJudge(a, state, b.state_dict(), examples=2).examples() is not None
    monkeypatch.setattr(symgraph.synthetic, "JUDGE_MAX_PARAMETERS", size - 1)
    made = []
    monkeypatch.setattr(symgraph.synthetic, "synthetic_data", lambda *args, **kwargs: made.append(1))
    with caplog.at_level("INFO", logger="symgraph.synthetic"):
        assert PathJudge(a, state, b.state_dict(), examples=2)(state) is None
        assert merge_examples(a, [state, b.state_dict()], examples=2) is None
        result = symgraph.align(symgraph.load(b), symgraph.load(a))
    assert made == [] and f"has {size:,} parameters, more than the {size - 1:,}" in caplog.text
    assert result.path_losses == {} and result.judged_on == "" and result.start == min(result.starts,
                                                                                         key=result.starts.get)


def test_elements_written_counts_what_each_operator_writes_and_no_view():
    """The judge's cost measure: a linear layer writes batch x out elements, its ReLU as many again; the weight's
    transpose is a view and writes nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    state = dict(model.named_parameters())
    assert elements_written(model, state, {"input": torch.randn(5, 4)}) == 2 * 5 * 3


def test_a_model_whose_forward_writes_past_the_judges_budget_is_not_judged(monkeypatch, caplog):
    """Parameters do not see a forward's cost (a tiny inkling_text of 2.9M parameters ran past 800 s, its judge's
    passes 4x those of the wide LLaMA): past JUDGE_MAX_ELEMENTS, what one pass over the examples writes, no
    examples are made, said with the count, and the alignment decides by distance; at the budget they are made."""
    a, b = (zoo.build("llama", seed=s).eval() for s in (0, 1))
    state = a.state_dict()
    data = synthetic_data(a, [state, b.state_dict()], examples=2, batch_size=2)
    written = 2 * elements_written(a, state, {"input_ids": data.batches[0].inputs["input_ids"][:1]})
    assert synthetic_data(a, [state, b.state_dict()], examples=2, batch_size=2, max_elements=written).batches
    with pytest.raises(DataError, match=f"writes {written:,} tensor elements, more than the {written - 1:,} "):
        synthetic_data(a, [state, b.state_dict()], examples=2, batch_size=2, max_elements=written - 1)
    monkeypatch.setattr(symgraph.synthetic, "JUDGE_MAX_ELEMENTS", 1e6)  # a pass over 64 examples writes more
    with caplog.at_level("INFO", logger="symgraph.synthetic"):
        assert PathJudge(a, state, b.state_dict())(state) is None
        result = symgraph.align(symgraph.load(b), symgraph.load(a))
    assert "not judged on synthetic data" in caplog.text and "tensor elements, more than the 1,000,000 " in caplog.text
    assert result.path_losses == {} and result.judged_on == "" and result.start == min(result.starts,
                                                                                         key=result.starts.get)


def test_experts_without_float64_kernels_label_float64_states():
    """Before: learning on synthetic data from float64 states (a consensus's) ended in grouped_mm's "Expected
    mat_a to be Float32 ... got Double"; the experts run transformers' reference loop there, as in the checks."""
    a, b = (transformers.AutoModelForCausalLM.from_config(zoo.tiny_config("mixtral"),
                                                          experts_implementation="grouped_mm").eval()
            for _ in range(2))
    states = [{k: v.double() for k, v in m.state_dict().items()} for m in (a, b)]
    data = synthetic_data(a, states, examples=2, batch_size=2)
    assert data.task == "causal_lm" and a.config._experts_implementation == "grouped_mm"  # the caller's kept


def test_models_without_a_task_synthetic_data_serves_are_refused():
    base = transformers.BertModel(zoo.tiny_config("bert"))  # hidden states, no logits
    with pytest.raises(DataError, match="classifiers and causal language models"):
        synthetic_data(base, [base.state_dict()] * 2, examples=4, batch_size=2)
    plain = torch.nn.Linear(3, 2)
    with pytest.raises(DataError, match="config"):
        synthetic_data(plain, [plain.state_dict()] * 2, examples=4, batch_size=2)


def test_synthetic_data_serves_learned_matching_only():
    with pytest.raises(DataError, match="learned matching only"):
        load_data("synthetic")
    a, b = (str(p) for p in shipped_pair("vit-digits"))
    with pytest.raises(DataError, match="learned matching only"):  # activation costs need real data
        symgraph.align(b, a, data="synthetic")
    with pytest.raises(LearnError, match="synthetic_examples"):
        symgraph.align(b, a, data="synthetic", learn=LearnOptions(synthetic_examples=0))


@pytest.mark.slow
def test_learning_on_synthetic_data_lowers_the_path_loss_and_keeps_the_source_function():
    a, b = (str(p) for p in shipped_pair("llama-chars"))
    options = LearnOptions(steps=12, eval_batches=2, synthetic_examples=128)
    result = symgraph.align(b, a, data="synthetic", learn=options, fold=True)
    learned = result.learned
    assert learned["steps"] == 12 and learned["kept"] and learned["end_path_loss"] < learned["start_path_loss"]
    assert result.start == "learned" and result.verified_error is not None  # still the source's function


@pytest.mark.slow
def test_cli_barrier_align_and_merge_learn_on_synthetic_data(tmp_path, monkeypatch):
    made = []  # how many examples each synthetic data set was asked for (the judges' too: 64)

    def counted(*args, examples, **kwargs):
        made.append(examples)
        return synthetic_data(*args, examples=examples, **kwargs)
    monkeypatch.setattr(symgraph.synthetic, "synthetic_data", counted)
    few = ("--learn-synthetic-examples", 48)  # each command makes its own (1600 by default: minutes of inversion)
    a, b = (str(p) for p in shipped_pair("vit-digits"))
    code, stdout, stderr = run("barrier", a, b, "--data", "digits", "--limit", 64, "--steps", 3,
                               "--align", "full,full+learn", "--learn-data", "synthetic", "--learn-steps", 6,
                               "--learn-patience", 0, "-o", tmp_path / "b.png", "--json", tmp_path / "b.json",
                               "--no-progress", *few)
    assert code == 0, stderr
    learned = json.loads((tmp_path / "b.json").read_text())["modes"]["full+learn"]["alignment"]["learned"]
    assert learned["steps"] == 6
    code, stdout, stderr = run("align", b, a, "-o", tmp_path / "out", "--learn", "--learn-data", "synthetic",
                               "--learn-steps", 3, "--quiet", *few)
    assert code == 0, stderr
    assert "learned over 3 steps" in stdout and "outputs checked" in stdout
    code, stdout, stderr = run("merge", a, b, "-o", tmp_path / "merged", "--data", "synthetic", "--learn",
                               "--learn-steps", 3, "--no-progress", *few)
    assert code == 0, stderr
    assert "learned matching" in stdout
    assert made.count(48) >= 3 and LearnOptions.synthetic_examples not in made
    code, _, stderr = run("merge", a, b, "-o", tmp_path / "fisher", "--method", "fisher", "--data", "synthetic")
    assert code == 2 and "learned matching only" in stderr and not (tmp_path / "fisher").exists()


def test_inputs_inverted_in_chunks_across_batches_come_back_in_their_places(monkeypatch):
    """Classifier inputs are inverted INVERTED_TOGETHER examples at a time across batches, and each example comes
    back in its batch and row; inverting an example among others moves it as inverting it alone does (its own
    loss, Adam's steps per entry)."""
    a, b = (symgraph.load(str(p)).model.eval() for p in shipped_pair("vit-digits"))
    endpoints = [a.state_dict(), b.state_dict()]
    monkeypatch.setattr(symgraph.synthetic, "INVERTED_TOGETHER", 3)
    calls = []
    monkeypatch.setattr(symgraph.synthetic, "_inverted", lambda model, states, inputs: calls.append(
        len(inputs["pixel_values"])) or {k: v + 1 for k, v in inputs.items()})
    data = synthetic_data(a, endpoints, examples=10, batch_size=4, seed=3)
    assert calls == [3, 3, 3, 1] and [batch.size for batch in data.batches] == [4, 4, 2]
    for index, batch in enumerate(data.batches):
        drawn = example_inputs(a.config, batch=batch.size, seq=8, seed=3 + index)["pixel_values"]
        assert torch.equal(batch.inputs["pixel_values"], drawn + 1)
    # past INVERTED_ELEMENTS (memory: both passes are held for the backward) chunks stay at a batch's size
    monkeypatch.setattr(symgraph.synthetic, "INVERTED_TOGETHER", 128)
    monkeypatch.setattr(symgraph.synthetic, "INVERTED_ELEMENTS", 1)
    calls.clear()
    synthetic_data(a, endpoints, examples=10, batch_size=4, seed=3)
    assert calls == [4, 4, 2]
    monkeypatch.setattr(symgraph.synthetic, "INVERTED_ELEMENTS", 1e8)
    calls.clear()
    synthetic_data(a, endpoints, examples=10, batch_size=4, seed=3)
    assert calls == [10]
    monkeypatch.undo()
    pixels = example_inputs(a.config, batch=2, seq=8, seed=0)["pixel_values"]
    with torch.random.fork_rng():
        torch.manual_seed(5)
        together = symgraph.synthetic._inverted(a, endpoints, {"pixel_values": pixels})["pixel_values"]
        torch.manual_seed(5)
        alone = symgraph.synthetic._inverted(a, endpoints, {"pixel_values": pixels[:1]})["pixel_values"]
    assert not torch.equal(together[0], pixels[0])
    torch.testing.assert_close(alone[0], together[0], rtol=1e-4, atol=1e-4)
