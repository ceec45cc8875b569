"""A model traced without the inputs of another modality it takes (a vision-language model traced on text) must
keep every group sound when those inputs are given: what they compute enters the token embeddings' output through
code the trace never took, so the stream there is pinned (symgraph.capture.untraced_inputs)."""
import pytest
import torch
from torch import nn

import symgraph
from symgraph.errors import CaptureError

from cli_runner import report_json
from group_checks import largest_change, noisy


class TextOnly(nn.Module):
    """A residual block between token embeddings and a head: its stream has a group."""

    def __init__(self, vocab=20, width=8, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.head = nn.Linear(width, vocab)

    def get_input_embeddings(self):
        return self.embed

    def block(self, h):
        return self.head(h + self.down(torch.relu(self.up(h))))

    def joined(self, input_ids, features=None):
        """The block on the embedded tokens, with ``features`` of another modality in front where given."""
        h = self.embed(input_ids)
        return self.block(h if features is None else torch.cat([features, h], dim=1))

    def forward(self, input_ids):
        return self.joined(input_ids)


class TinyVLM(TextOnly):
    """The same, with image features written into the embedded sequence when pixels are given."""

    def __init__(self, patch=6, **sizes):
        super().__init__(**sizes)
        self.vision = nn.Linear(patch, self.embed.embedding_dim)

    def forward(self, input_ids, pixel_values=None):
        return self.joined(input_ids, None if pixel_values is None else self.vision(pixel_values))


class PatchesVLM(TinyVLM):
    """Pix2Struct / Fuyu style: the image comes as ``flattened_patches``."""

    def forward(self, input_ids, flattened_patches=None):
        return super().forward(input_ids, flattened_patches)


class AudioTokensLM(TinyVLM):
    """Higgs-audio style: audio tokens embedded by a table of their own and put beside the text."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.audio = nn.Embedding(12, self.embed.embedding_dim)

    def forward(self, input_ids, audio_input_ids=None):
        return self.joined(input_ids, None if audio_input_ids is None else self.audio(audio_input_ids))


class NoEmbeddingsAccessor(TinyVLM):
    def get_input_embeddings(self):  # as transformers' PreTrainedModel where a model does not say
        raise NotImplementedError


def _moves(report, name):
    return [g for g in report.groups if name in g.params]


def _image_inputs(batch, length, patches, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 20, (batch, length), generator=g),
            "pixel_values": torch.randn(batch, patches, 6, generator=g, dtype=torch.float64)}


def test_text_model_keeps_its_stream_group():
    torch.manual_seed(0)
    report = symgraph.load(TextOnly(), inputs={"input_ids": torch.randint(0, 20, (2, 5))}).report
    assert _moves(report, "embed.weight"), "control: the stream of the same blocks is movable without images"


def test_stream_that_untraced_images_enter_is_pinned():
    torch.manual_seed(0)
    model = TinyVLM()
    report = symgraph.load(model, inputs={"input_ids": torch.randint(0, 20, (2, 5))}).report
    assert not _moves(report, "embed.weight")
    assert not _moves(report, "vision.weight")
    assert _moves(report, "up.weight"), "the block's own units still permute"
    reasons = {p.reason for p in report.pinned}
    assert any("token embeddings" in r and "pixel_values" in r for r in reasons), reasons
    for shape in ((2, 5, 3), (1, 9, 4)):
        assert largest_change(model, report, _image_inputs(*shape)) < 1e-12


@pytest.mark.parametrize("kind", [PatchesVLM, AudioTokensLM])
def test_other_names_of_untraced_inputs_pin_the_stream_too(kind):
    torch.manual_seed(0)
    report = symgraph.load(kind(), inputs={"input_ids": torch.randint(0, 20, (2, 5))}).report
    assert not _moves(report, "embed.weight")
    assert _moves(report, "up.weight")


def test_every_input_given_keeps_the_stream():
    torch.manual_seed(0)
    model = TinyVLM()
    inputs = {"input_ids": torch.randint(0, 20, (2, 5)), "pixel_values": torch.randn(2, 3, 6)}
    assert _moves(symgraph.load(model, inputs=inputs).report, "embed.weight")


def test_no_embeddings_to_pin_is_refused():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="pixel_values"):
        symgraph.load(NoEmbeddingsAccessor(), inputs={"input_ids": torch.randint(0, 20, (2, 5))}).report


def _tiny_qwen2_vl():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
    torch.manual_seed(0)
    return noisy(transformers.Qwen2VLForConditionalGeneration(config), 0.05)


def test_qwen2_vl_is_analysed_on_text_and_sound_on_images():
    """Qwen2-VL takes images as patches with their grid, whose values size its tensors (torch.export cannot trace
    that): it is traced on text, keeps its heads' and units' groups, and each keeps its outputs on images."""
    model = _tiny_qwen2_vl()
    subject = symgraph.load(model)
    assert set(subject.kwargs) >= {"input_ids"} and "pixel_values" not in subject.kwargs
    report = subject.report
    kinds = {(g.motif, g.kind) for g in report.groups}
    assert ("heads", "permutation") in kinds and ("ffn", "permutation") in kinds, kinds
    assert not _moves(report, "model.language_model.embed_tokens.weight")
    for seed, (batch, side) in enumerate(((2, 4), (1, 8))):  # 4 / 16 image tokens of a side x side patch grid
        g = torch.Generator().manual_seed(seed)
        tokens = side * side // 4
        ids = torch.randint(0, 60, (batch, tokens + 5), generator=g)
        ids[:, 2:2 + tokens] = 60
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == 60).long(),
                  "pixel_values": torch.randn(batch * side * side, 3 * 2 * 4 * 4, generator=g, dtype=torch.float64),
                  "image_grid_thw": torch.tensor([[1, side, side]] * batch)}
        logits = largest_change(model, report, inputs, draws=1, run=lambda m, x: m(**x, use_cache=False).logits)
        assert logits < 1e-9



def test_images_with_their_grid_are_refused_with_the_text_route_named():
    """Given the images, torch.export stops on the grid's values: the hint names the inputs to leave out."""
    model = _tiny_qwen2_vl()
    ids = torch.randint(0, 60, (1, 9))
    ids[:, 2:6] = 60
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == 60).long(), "use_cache": False,
              "pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(CaptureError) as caught:
        symgraph.load(model, inputs=inputs).report
    assert "without pixel_values" in caught.value.hint and "pinned" in caught.value.hint


def test_full_mode_judges_and_aligns_a_qwen2_vl_on_its_own_samples():
    """Its vocabulary lives in its text config and its cache switch there too: the synthetic judge and the
    activations' alignment run on its sampled text, as for a causal LM."""
    anchor = _tiny_qwen2_vl()
    torch.manual_seed(1)
    source = noisy(type(anchor)(anchor.config), 0.05)
    result = symgraph.align(source, anchor, mode="full")
    assert {"weights", "activations"} <= set(result.path_losses), result.path_losses
    assert result.distance_after <= result.distance_before


def test_cli_report_of_a_qwen2_vl_folder_names_the_pinned_stream(tmp_path):
    """``symgraph report FOLDER``: traced on text from the folder's config, the stream pinned with its reason."""
    _tiny_qwen2_vl().save_pretrained(tmp_path)
    report = report_json(tmp_path)
    reasons = [p["reason"] for p in report["pinned"]]
    assert any("token embeddings" in r and "pixel_values" in r for r in reasons), reasons
    assert {g["motif"] for g in report["groups"]} >= {"heads", "ffn"}
    assert not any(g["motif"] == "residual" for g in report["groups"])
