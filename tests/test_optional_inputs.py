"""Parameters a model reads only when given an optional input (XLNet's segment embeddings with token_type_ids, a
decoder's cross-attention with encoder_hidden_states) must move with the groups that meet them there: the trace is
taken again with those inputs added (symgraph.capture.capture, symgraph.inputs.optional_inputs), and every group
keeps the function with and without them. Parameters no input reaches are named in the report."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import symgraph
from symgraph.inputs import optional_inputs

from group_checks import largest_change, noisy

transformers = pytest.importorskip("transformers")


def _xlnet():
    config = transformers.XLNetConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, d_inner=48)
    torch.manual_seed(0)
    return noisy(transformers.XLNetLMHeadModel(config), 0.05)


def _ids(batch, length, seed, vocab=40):
    return torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _segments(ids, seed):
    return torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(seed + 100))


def test_xlnet_segment_embeddings_move_with_their_query_key_groups():
    model = _xlnet()
    subject = symgraph.load(model)
    report = subject.report
    assert subject.capture.added_inputs == ("token_type_ids",)
    assert "token_type_ids" in subject.kwargs, "the checks run on the inputs the groups were found on"
    for layer in range(2):
        name = f"transformer.layer.{layer}.rel_attn.seg_embed"
        assert any(name in g.params for g in report.groups), f"{name} is in no group: it would stay behind"
    assert any("token_type_ids" in note and "seg_embed" in note for note in report.notes), report.notes
    run = lambda m, x: m(**x).logits  # noqa: E731
    for seed, (batch, length) in enumerate(((2, 5), (1, 11))):
        ids = _ids(batch, length, seed)
        assert largest_change(model, report, {"input_ids": ids, "token_type_ids": _segments(ids, seed)},
                              draws=2, run=run) < 1e-10
        assert largest_change(model, report, {"input_ids": ids}, draws=1, run=run) < 1e-10


def test_activations_are_recorded_on_the_data_as_it_is():
    """The data gives token ids alone: recording runs the graph traced on them, not the one the groups were found
    on (which also takes token_type_ids)."""
    from symgraph.activations import record
    from symgraph.datasets import Batch, Dataset

    anchor = _xlnet()
    torch.manual_seed(1)
    source = noisy(transformers.XLNetLMHeadModel(anchor.config), 0.05)
    subjects = symgraph.load(source), symgraph.load(anchor)
    ids = _ids(8, 12, 3)
    data = Dataset("ids", "causal_lm", (Batch({"input_ids": ids}, labels=ids),))
    recording = record(*subjects, subjects[1].report.groups, data, batches=1)
    assert recording.sites and set(recording.source) == set(recording.anchor)


def _mbart_decoder():
    config = transformers.MBartConfig(vocab_size=40, d_model=32, decoder_layers=2, encoder_layers=1,
                                      decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=48,
                                      encoder_ffn_dim=48, max_position_embeddings=64)
    torch.manual_seed(0)
    return noisy(transformers.MBartForCausalLM(config), 0.05)


def test_decoder_cross_attention_moves_with_the_stream():
    """As a causal LM, MBart's decoder reads its cross-attention only when given encoder states: its query
    projection reads the stream, its output projection writes it."""
    model = _mbart_decoder()
    subject = symgraph.load(model)
    report = subject.report
    assert subject.capture.added_inputs == ("encoder_hidden_states",)
    stream = report.by_motif("residual")
    assert len(stream) == 1, "the decoder's stream keeps its group"
    for name in ("encoder_attn.q_proj.weight", "encoder_attn.out_proj.weight"):
        assert f"model.decoder.layers.0.{name}" in stream[0].params
    run = lambda m, x: m(**x, use_cache=False).logits  # noqa: E731
    for seed, (batch, length, memory) in enumerate(((2, 5, 3), (1, 9, 6))):
        ids = _ids(batch, length, seed)
        states = torch.randn(batch, memory, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert largest_change(model, report, {"input_ids": ids, "encoder_hidden_states": states},
                              draws=2, run=run) < 1e-10


def test_xlm_language_embeddings_move_with_the_stream():
    config = transformers.XLMConfig(vocab_size=40, emb_dim=32, n_layers=2, n_heads=4, n_langs=3, use_lang_emb=True)
    torch.manual_seed(0)
    model = noisy(transformers.XLMWithLMHeadModel(config), 0.05)
    subject = symgraph.load(model)
    report = subject.report
    assert "langs" in subject.capture.added_inputs
    assert [g.motif for g in report.groups if "transformer.lang_embeddings.weight" in g.params] == ["residual"]
    ids = _ids(2, 6, 0)
    langs = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(1))
    assert largest_change(model, report, {"input_ids": ids, "langs": langs}, run=lambda m, x: m(**x).logits) < 1e-10


def test_luke_entities_move_with_the_stream():
    """LUKE reads its entity embeddings and entity-aware attention only when given entities, which come with the
    word positions of their mentions."""
    config = transformers.LukeConfig(vocab_size=40, entity_vocab_size=10, hidden_size=32, entity_emb_size=16,
                                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    torch.manual_seed(0)
    model = noisy(transformers.LukeForMaskedLM(config), 0.05)
    subject = symgraph.load(model)
    report = subject.report
    assert {"entity_ids", "entity_position_ids"} <= set(subject.capture.added_inputs)
    assert any(g.motif == "residual" and "luke.entity_embeddings.entity_embedding_dense.weight" in g.params
               for g in report.groups)
    run = lambda m, x: torch.cat([m(**x).logits.flatten(), m(**x).entity_logits.flatten()])  # noqa: E731
    for seed, (batch, length, entities) in enumerate(((2, 6, 2), (1, 11, 3))):
        g = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, length, (batch, entities, 2), generator=g)
        positions[:, :, 1] = -1  # one-word mentions
        inputs = {"input_ids": _ids(batch, length, seed), "entity_ids": torch.randint(1, 10, (batch, entities),
                                                                                     generator=g),
                  "entity_position_ids": positions}
        assert largest_change(model, report, inputs, draws=2, run=run) < 1e-10


class MaskedPatches(nn.Module):
    """A ViT-style stem that puts a learned mask token in place of the patches ``bool_masked_pos`` picks (DINOv2,
    BEiT), a residual block and a mean-pooled head: the mask token lies in the stream's coordinates."""

    def __init__(self, patch=2, channels=3, width=8, hidden=16, classes=5):
        super().__init__()
        self.config = SimpleNamespace(patch_size=patch)
        self.embed = nn.Linear(channels * patch * patch, width)
        self.mask_token = nn.Parameter(torch.randn(width))
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.head = nn.Linear(width, classes)

    def forward(self, pixel_values, bool_masked_pos=None):
        p = self.config.patch_size
        patches = nn.functional.unfold(pixel_values, p, stride=p).transpose(1, 2)
        h = self.embed(patches)
        if bool_masked_pos is not None:
            h = torch.where(bool_masked_pos.unsqueeze(-1), self.mask_token.to(h.dtype), h)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h.mean(1))


def test_mask_token_moves_with_the_stream():
    torch.manual_seed(0)
    model = MaskedPatches()
    subject = symgraph.load(model, inputs={"pixel_values": torch.randn(2, 3, 4, 4)})
    report = subject.report
    assert subject.capture.added_inputs == ("bool_masked_pos",)
    assert any("mask_token" in g.params and "embed.weight" in g.params for g in report.groups), report.groups
    for seed, (batch, side) in enumerate(((2, 4), (1, 6))):
        g = torch.Generator().manual_seed(seed)
        inputs = {"pixel_values": torch.randn(batch, 3, side, side, generator=g, dtype=torch.float64),
                  "bool_masked_pos": torch.rand(batch, (side // 2) ** 2, generator=g) < 0.5}
        assert largest_change(model, report, inputs) < 1e-10


@pytest.mark.parametrize("kind", ["SEW", "SEWD"])
def test_masked_frames_embedding_moves_with_the_stream(kind):
    """SEW writes ``masked_spec_embed`` over the frames ``mask_time_indices`` picks (``x[mask] = v``, in place), in a
    stream its groups move: on main the stream's group left it behind (0.94 of the outputs changed)."""
    config = getattr(transformers, f"{kind}Config")(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, conv_dim=(16, 16),
        conv_kernel=(5, 3), conv_stride=(4, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2)
    torch.manual_seed(0)
    model = noisy(getattr(transformers, f"{kind}Model")(config), 0.05)
    subject = symgraph.load(model)
    report = subject.report
    assert subject.capture.added_inputs == ("mask_time_indices",)
    assert any("masked_spec_embed" in g.params for g in report.groups), report.groups
    run = lambda m, x: m(**x).last_hidden_state  # noqa: E731
    for seed, (batch, samples) in enumerate(((2, 400), (1, 560))):
        g = torch.Generator().manual_seed(seed)
        frames = int(model._get_feat_extract_output_lengths(samples))
        inputs = {"input_values": torch.randn(batch, samples, generator=g, dtype=torch.float64),
                  "mask_time_indices": torch.rand(batch, frames, generator=g) < 0.5}
        assert largest_change(model, report, inputs, draws=1, run=run) < 1e-10


class WindowSummary(nn.Module):
    """Reads ``summary`` only from 20 tokens on (a compressed attention's window), past the probes grown from 7."""

    def __init__(self, vocab=20, width=8, hidden=16, window=20):
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.summary = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if input_ids.shape[1] >= self.window:
            h = h + self.summary(h[:, :self.window].mean(1, keepdim=True))
        return self.head(h + self.down(torch.relu(self.up(h))))


def test_parameters_read_from_a_length_on_are_traced_there():
    torch.manual_seed(0)
    model = WindowSummary()
    subject = symgraph.load(model, inputs={"input_ids": torch.randint(0, 20, (2, 7))})
    report = subject.report
    assert subject.capture.lengthened == (7, 512) and subject.kwargs["input_ids"].shape == (2, 512)
    assert any("summary.weight" in g.params and "embed.weight" in g.params for g in report.groups), report.groups
    assert any("traced at 512 tokens" in note and "summary.weight" in note for note in report.notes), report.notes
    for seed, (batch, length) in enumerate(((2, 7), (1, 30))):
        assert largest_change(model, report, {"input_ids": _ids(batch, length, seed, vocab=20)}) < 1e-10


def test_cli_reports_and_fuzzes_a_model_read_from_a_length_on(tmp_path):
    from cli_runner import assert_fuzzed, report_json

    path = tmp_path / "window_factory.py"
    path.write_text("import torch\nfrom test_optional_inputs import WindowSummary\n\n\ndef window():\n"
                    "    torch.manual_seed(0)\n"
                    "    return WindowSummary(), (), {'input_ids': torch.randint(0, 20, (2, 7))}\n")
    report = report_json(f"{path}:window")
    assert any("traced at 512 tokens" in note for note in report["notes"]), report["notes"]
    assert any(m["param"] == "summary.weight" for g in report["groups"] for m in g["members"])
    assert_fuzzed(f"{path}:window", tmp_path)


def test_deepseek_v4_compressor_moves_with_the_stream():
    """DeepSeek-V4's heavily compressed attention reads its compressor (gate, norm, position bias) only from its
    compress rate's tokens on: on main every group left it behind (0.40 of the logits changed at 130 tokens, rate 128;
    here rate 32 and 64 positions, so the longer trace is at 64 tokens)."""
    from symgraph.moe import DENSE, experts_implementation

    config = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        max_position_embeddings=64, layer_types=["heavily_compressed_attention"] * 2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        mlp_layer_types=["hash_moe", "moe"], sliding_window=16, o_groups=8, o_lora_rank=32, index_n_heads=4,
        index_head_dim=16, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = noisy(transformers.AutoModelForCausalLM.from_config(config), 0.05)
    subject = symgraph.load(model)
    report = subject.report
    assert subject.capture.lengthened == (7, 64)
    gate = "model.layers.0.self_attn.compressor.gate_proj.weight"
    assert gate in subject.capture.read_when_longer and any(gate in g.params for g in report.groups)

    def run(m, x):
        with experts_implementation(m, DENSE):
            return m(**x, use_cache=False).logits
    for seed, length in enumerate((7, 40)):
        assert largest_change(model, report, {"input_ids": _ids(1, length, seed, vocab=128)}, draws=1, run=run) < 1e-5


class ExtraBranch(nn.Module):
    """A parameter read only when an input no rule knows is given: it stays unread, and the report says so."""

    def __init__(self, vocab=20, width=8, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.extra = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, style=None):
        h = self.embed(input_ids)
        if style is not None:
            h = h + self.extra(style)
        return self.head(h + self.down(torch.relu(self.up(h))))


class UntraceableSegments(ExtraBranch):
    """token_type_ids read through a branch on their values: the trace with them fails, the first one stays."""

    def forward(self, input_ids, token_type_ids=None):
        h = self.embed(input_ids)
        if token_type_ids is not None and bool(token_type_ids.any()):
            h = h + self.extra(h)
        return self.head(h + self.down(torch.relu(self.up(h))))


@pytest.mark.parametrize("kind", [ExtraBranch, UntraceableSegments])
def test_parameters_no_input_reaches_are_named(kind):
    torch.manual_seed(0)
    subject = symgraph.load(kind(), inputs={"input_ids": torch.randint(0, 20, (2, 5))})
    report = subject.report
    assert subject.capture.added_inputs == ()
    assert not any("extra.weight" in g.params for g in report.groups)
    assert any("unread at the traced inputs" in note and "extra.weight" in note for note in report.notes), \
        report.notes
    assert any("up.weight" in g.params for g in report.groups), "the rest is analysed as before"


def test_optional_inputs_are_built_beside_token_ids_only():
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_attention_heads=4, type_vocab_size=3,
                                     is_decoder=True)
    ids = torch.ones(2, 6, dtype=torch.long)
    built = optional_inputs(config, ["input_ids", "token_type_ids", "encoder_hidden_states"], {"input_ids": ids},
                            dtype=torch.float64)
    assert built["token_type_ids"].shape == (2, 6) and int(built["token_type_ids"].max()) < 3
    assert built["encoder_hidden_states"].shape == (2, 6, 32)
    assert built["encoder_hidden_states"].dtype == torch.float64
    config.is_decoder = False  # an encoder may read encoder states with its self-attention's keys (BigBird)
    assert "encoder_hidden_states" not in optional_inputs(config, ["input_ids", "encoder_hidden_states"],
                                                          {"input_ids": ids})
    given = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}
    assert optional_inputs(config, ["input_ids", "token_type_ids"], given) == {}, "what is given is kept"
    assert optional_inputs(config, ["pixel_values", "token_type_ids"], {"pixel_values": torch.ones(1, 3)}) == {}
    audio = transformers.Wav2Vec2Config(conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2))
    built = optional_inputs(audio, ["input_values", "mask_time_indices"], {"input_values": torch.ones(2, 400)})
    assert built["mask_time_indices"].shape == (2, 39) and built["mask_time_indices"].dtype == torch.bool
    built = optional_inputs(config, ["input_features", "mask_time_indices"], {"input_features": torch.ones(2, 9, 80)})
    assert built["mask_time_indices"].shape == (2, 9)


def test_cli_report_and_align_of_an_xlnet_folder(tmp_path):
    """Through the CLI: ``report`` of a saved XLNet names the added input and keeps its segment embeddings in the
    groups; ``align`` writes a model whose logits with token_type_ids are the source's."""
    from cli_runner import report_json, run

    anchor, source = tmp_path / "a", tmp_path / "b"
    _xlnet().save_pretrained(anchor)
    torch.manual_seed(1)
    model = noisy(transformers.XLNetLMHeadModel(_xlnet().config), 0.05)
    model.save_pretrained(source)
    report = report_json(anchor)
    assert any("token_type_ids" in note for note in report["notes"]), report["notes"]
    assert any(m["param"].endswith("seg_embed") for g in report["groups"] for m in g["members"])
    result = run("align", source, anchor, "-o", tmp_path / "aligned")
    assert result.returncode == 0, result.stderr
    ids = _ids(2, 7, 5)
    inputs = {"input_ids": ids, "token_type_ids": _segments(ids, 5)}
    with torch.no_grad():
        expected = model.double()(**inputs).logits
        aligned = transformers.XLNetLMHeadModel.from_pretrained(tmp_path / "aligned").double().eval()(**inputs).logits
    assert float((aligned - expected).abs().max() / expected.abs().max()) < 1e-5
