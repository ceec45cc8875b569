"""Architectures that used to crash on symgraph's own example inputs or inside the analysis: each now works end to
end from its config alone (inputs built by symgraph, every emitted group fuzzed in float64), or stops with an
error that names the line and what to try."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoConfig

import symgraph
from cli_runner import assert_fuzzed, report_json, run
from symgraph.errors import CaptureError, ModelLoadError, UnverifiableError
from symgraph.fuzz import fuzz
from symgraph.inputs import example_inputs, forward_kwargs

T5_LIKE = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
               decoder_start_token_id=0)
VLM_TEXT = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
VLM_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=4)
CASES = {
    # LongT5's local attention splits the mask into blocks: its code cannot run without an attention mask.
    "longt5": ("AutoModelForSeq2SeqLM", dict(T5_LIKE, local_radius=4, global_block_size=4)),
    # Llava: use_cache lives in text_config; the text must hold one image token per image feature.
    "llava": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=4),
        image_token_index=99, image_seq_length=16)),
    # Placeholder vision-language models whose configs give no image_seq_length: Gemma 3 pools its patches to
    # mm_tokens_per_image, PaliGemma takes one per patch, Mistral 3 merges 2 x 2 patches of a Pixtral tower that
    # requires each image's size; the count is measured by the model's get_image_features.
    "gemma3": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="gemma3_text", **VLM_TEXT), vision_config=dict(
            model_type="siglip_vision_model", **VLM_VISION), mm_tokens_per_image=4, image_token_index=99,
        boi_token_index=97, eoi_token_index=98)),
    "paligemma": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="gemma", **VLM_TEXT), vision_config=dict(
            model_type="siglip_vision_model", **VLM_VISION), projection_dim=32, image_token_index=99)),
    "mistral3": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="mistral", **VLM_TEXT), vision_config=dict(
            model_type="pixtral", head_dim=8, **VLM_VISION), image_token_index=99, spatial_merge_size=2)),
    # SmolVLM (as Idefics 2 and 3) takes images as (batch, images, channels, height, width), keeps the real ones by
    # their pixel values (a count known only at run time, which its tower's patch mask is computed at) and
    # shuffles 2 x 2 patches into each placeholder's features.
    "smolvlm": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="llama", **VLM_TEXT), vision_config=dict(
            model_type="smolvlm_vision", **VLM_VISION), image_token_id=99, scale_factor=2)),
    # LLaVA-NeXT cuts each image into a base tile and a grid of tiles (1 x 2 for an image of one tile's size here),
    # as (batch, tiles, channels, height, width), slicing as many as each image's size makes.
    "llava_next": ("AutoModelForImageTextToText", dict(
        text_config=dict(model_type="llama", **VLM_TEXT), vision_config=dict(
            model_type="clip_vision_model", **VLM_VISION), image_token_index=99,
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])),
    # GIT: a vision sub-config beside the text model's sizes at the top level; traced on text alone, its vision
    # tower was left unread (and the stream its image features enter pinned: tests/test_untraced_inputs.py).
    "git": ("AutoModelForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4))),
    # ResNet: a vision config without image_size.
    "resnet": ("AutoModelForImageClassification", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                       num_labels=3)),
    # BEiT: a vision model whose config also has a vocab_size (masked image modelling).
    "beit": ("AutoModelForImageClassification", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                     intermediate_size=64, image_size=16, patch_size=4,
                                                     num_labels=3)),
    # DeepSeek-V3: group-limited routing indexes expert scores by routed ids (the replay hit index -1).
    "deepseek_v3": ("AutoModelForCausalLM", dict(
        vocab_size=100, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64)),
    # Funnel: pooling leaves coordinates that no parameter carries (assemble took min() of nothing).
    "funnel": ("AutoModelForMaskedLM", dict(vocab_size=100, d_model=32, n_head=4, d_head=8, d_inner=64,
                                            block_sizes=[1, 1, 1], num_decoder_layers=1)),
    # Audio and characters: what forward() takes settles the layout the config leaves open.
    # AST: mel bins, but a spectrogram of max_length frames as input_values (not Whisper's input_features).
    "audio-spectrogram-transformer": ("AutoModelForAudioClassification", dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, num_mel_bins=16,
        max_length=32, patch_size=8, frequency_stride=8, time_stride=8, num_labels=3)),
    # Speech2Text: filterbank features (frames, features per channel), subsampled by two stride-2 convs.
    "speech_to_text": ("AutoModel", dict(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=16,
        conv_channels=32, max_source_positions=64, max_target_positions=64)),
    # Wav2Vec2-BERT: stacked filterbank frames as input_features, as wide as feature_projection_input_dim.
    "wav2vec2-bert": ("AutoModel", dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        feature_projection_input_dim=20, output_hidden_size=32, conv_depthwise_kernel_size=3)),
    # Moonshine: raw audio into a conv stem the config does not describe, beside a decoder's vocabulary.
    "moonshine": ("AutoModel", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
        max_position_embeddings=64)),
    # Video: a clip (batch, frames, channels, height, width) where the config has a frame count. V-JEPA 2 takes it
    # as pixel_values_videos, sized by crop_size, and gathers its predictor's mask tokens after repeating them
    # mask.max() + 1 times, a count known only at run time (the replay of that gather overran its stand-in size).
    "videomae": ("AutoModelForVideoClassification", dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, num_frames=4, tubelet_size=2, num_labels=3)),
    "vjepa2": ("AutoModel", dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, crop_size=16, patch_size=8, frames_per_clip=4,
        tubelet_size=2, mlp_ratio=2.0, pred_hidden_size=32, pred_num_attention_heads=4, pred_num_hidden_layers=1,
        pred_mlp_ratio=2.0, num_pooler_layers=1)),
    # Time series: past values (batch, context length, channels); TimesFM's have no channel axis and come with
    # a frequency id per series.
    "patchtst": ("AutoModel", dict(
        d_model=32, num_attention_heads=4, ffn_dim=64, num_hidden_layers=1, context_length=16, patch_length=4,
        patch_stride=4, num_input_channels=3)),
    "timesfm": ("AutoModelForTimeSeriesPrediction", dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=8,
        context_length=64, patch_length=16, horizon_length=16)),
    # A forecasting encoder-decoder: the past (context plus the largest lag), its time features and observed mask,
    # the future to predict and its time features; no decoder ids (it decodes values).
    "time_series_transformer": ("AutoModel", dict(
        prediction_length=4, context_length=8, lags_sequence=[1, 2, 3], num_time_features=2, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64)),
}
# CANINE: no vocabulary at all; it reads Unicode code points. In float64 its outputs are NaN unless its float32
# casts stay float64 (symgraph.verify.Float64Casts).
CANINE = ("AutoModelForSequenceClassification", dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, num_labels=3,
    max_position_embeddings=64, num_hash_buckets=64, local_transformer_stride=4))


def build(model_type: str, head: str, config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, head).from_config(AutoConfig.for_model(model_type, **config)).eval()
    with torch.no_grad():  # no weight exactly 0 or 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("model_type", CASES)
def test_analysed_from_config_inputs_and_every_group_is_sound(model_type):
    subject = symgraph.load(build(model_type, *CASES[model_type]))
    report = subject.report
    result = fuzz(subject, samples=2, seed=1)
    assert result.ok, [v.counterexample for v in result.failures]
    assert len(result.verdicts) == len(report.groups)
    if model_type not in ("resnet",):  # BatchNorm is not described yet: ResNet pins everything, soundly
        assert report.groups


def test_a_mask_is_added_only_where_the_model_needs_one():
    longt5 = symgraph.load(build("longt5", *CASES["longt5"]))
    longt5.capture
    assert "attention_mask" in longt5.kwargs
    t5 = symgraph.load(build("t5", "AutoModelForSeq2SeqLM", T5_LIKE))
    t5.capture
    assert "attention_mask" not in t5.kwargs  # a mask adds nodes to the graph: only where it is needed


def test_use_cache_in_a_sub_config_is_switched_off():
    config = AutoConfig.for_model("llava", **CASES["llava"][1])
    assert getattr(config, "use_cache", None) is None and config.text_config.use_cache is not None
    assert forward_kwargs(config)["use_cache"] is False


def test_vision_inputs_without_image_size_and_beside_a_vocabulary():
    resnet = AutoConfig.for_model("resnet", **CASES["resnet"][1])
    assert tuple(example_inputs(resnet)["pixel_values"].shape) == (2, 3, 32, 32)
    beit = build("beit", *CASES["beit"])
    params = symgraph.load(beit).kwargs
    assert "pixel_values" in params and "input_ids" not in params


def test_a_vision_config_beside_top_level_text_sizes_gets_tokens_and_pixels():
    subject = symgraph.load(build("git", *CASES["git"]))
    assert {"input_ids", "pixel_values"} <= set(subject.kwargs)
    assert not subject.capture.untraced_inputs
    streams = [g for g in subject.report.groups if g.motif == "residual"]
    assert len(streams) == 2, "the text stream and the vision tower's"


def test_image_placeholders_fill_one_image_per_sample():
    config = AutoConfig.for_model("llava", **CASES["llava"][1])
    ids = example_inputs(config)["input_ids"]
    assert (ids == 99).sum(1).tolist() == [16, 16]


@pytest.mark.parametrize("model_type, per_image", [("gemma3", 4), ("paligemma", 16), ("mistral3", 4), ("llava", 16),
                                                   ("smolvlm", 4), ("llava_next", 36)])
def test_placeholders_per_image_are_as_many_as_the_image_path_makes_features(model_type, per_image):
    model = build(model_type, *CASES[model_type])
    kwargs = symgraph.load(model).kwargs
    assert (kwargs["input_ids"] == 99).sum(1).tolist() == [per_image, per_image]
    if model_type in ("mistral3", "llava_next"):  # the towers cut each image by its size: Python ints (traceable)
        assert kwargs["image_sizes"] == [[16, 16], [16, 16]]
    # one image per example, in the layout the image path takes: as tiles where it takes no 4-d pixels
    tiles = {"smolvlm": (1,), "llava_next": (3,)}.get(model_type, ())
    assert kwargs["pixel_values"].shape == (2, *tiles, 3, 16, 16)
    with torch.no_grad():
        model(**kwargs)


def test_a_model_given_image_sizes_aligns_end_to_end(tmp_path):
    """Mistral 3's example inputs hold its image sizes as lists of ints: the synthetic data that judges full
    mode's starts refuses the model with a readable error (it is no plain causal LM), and alignment goes on."""
    a = build("mistral3", *CASES["mistral3"])
    b = build("mistral3", *CASES["mistral3"])
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn_like(p))
    result = symgraph.align(b, a)
    assert result.verified_error < 1e-4 and result.distance_after <= result.distance_before


def test_sizes_known_only_at_run_time_neither_crash_a_fold_nor_an_alignment():
    """SmolVLM's tower runs on the images it keeps by their pixel values, a count torch.export leaves symbolic:
    comparing such shapes used to raise GuardOnDataDependentSymNode inside the fold. Now the fold refuses with the
    norm it cannot fold, and two random SmolVLMs align and merge into one that computes finite outputs."""
    from symgraph.fold import FoldError

    a, b = (build("smolvlm", *CASES["smolvlm"]) for _ in range(2))
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn_like(p))
    with pytest.raises(FoldError, match="post_layernorm"):
        symgraph.fold(a)
    result = symgraph.align(b, a)
    assert result.verified_error < 1e-4 and result.distance_after < result.distance_before


@pytest.mark.parametrize("model_type, per_image, pixels", [("gemma3", 4, (2, 3, 16, 16)),
                                                           ("llava_next", 36, (2, 3, 3, 16, 16))])
def test_a_config_only_report_counts_placeholders_and_tiles_on_the_meta_device(model_type, per_image, pixels,
                                                                                tmp_path):
    """A config alone (a 7B model's report allocates no weights) gets the placeholders and tiles its image path
    makes, measured on the meta device, where the config's count used to stand (Gemma 3: none); ``symgraph report
    --config-only`` then finds the groups the weights' report finds."""
    build(model_type, *CASES[model_type]).save_pretrained(tmp_path / "weights")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "weights" / "config.json").read_text())
    subject = symgraph.load(tmp_path / "cfg" / "config.json", config_only=True)
    assert (subject.kwargs["input_ids"] == 99).sum(1).tolist() == [per_image, per_image]
    assert subject.kwargs["pixel_values"].shape == pixels
    res = run("report", tmp_path / "cfg" / "config.json", "--config-only", "--format", "json")
    assert res.returncode == 0, res.stderr
    groups = json.loads(res.stdout)["groups"]
    assert groups and groups == report_json(tmp_path / "weights")["groups"]


def test_a_stale_placeholder_count_in_the_config_is_measured_instead():
    """A config whose image_seq_length disagrees with its vision tower (resized images): the model's own count."""
    model = build("llava", CASES["llava"][0], dict(CASES["llava"][1], image_seq_length=9))
    assert (symgraph.load(model).kwargs["input_ids"] == 99).sum(1).tolist() == [16, 16]


def test_free_outputs_move_the_text_stream_with_the_image_features_scattered_into_it():
    """With free outputs, Llava's projected image features (an output, one tensor per image) move with the text
    stream they are scattered into (masked_scatter), and the checks find them by name at a batch of one image,
    where the leaves after that list shift (the check crashed on a None there)."""
    subject = symgraph.load(build("llava", *CASES["llava"]), free_outputs=True)
    text = [g for g in subject.report.groups if g.motif == "residual"
            and any(m.param == "model.language_model.embed_tokens.weight" for m in g.members)]
    assert len(text) == 1 and any(m.param == "model.multi_modal_projector.linear_2.weight" for m in text[0].members)
    moved = {f.name for f in subject.report.free_outputs if f.group == text[0].id}
    assert moved == {"image_outputs.pooler_output.0", "image_outputs.pooler_output.1"}
    result = fuzz(subject, samples=2, seed=1)
    assert result.ok, [v.counterexample for v in result.failures]
    assert any(shape.startswith("input_ids 1x") for shape in result.shapes)


def test_a_model_that_rewrites_its_own_modules_stops_with_a_clear_error():
    """SwitchTransformers' router runs ``self.classifier = self.classifier.to(dtype)`` inside forward."""
    model = build("switch_transformers", "AutoModelForSeq2SeqLM", dict(
        T5_LIKE, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4))
    with pytest.raises(CaptureError, match=r"modeling_switch_transformers.py:\d+") as caught:
        symgraph.load(model).report
    assert "replaces one of its own submodules" in caught.value.hint


def test_no_inputs_can_be_built_is_a_load_error():
    with pytest.raises(ModelLoadError, match="Cannot build example inputs") as caught:
        example_inputs(object())
    assert "inputs=" in caught.value.hint


@pytest.mark.parametrize("model_type, key, shape", [
    ("audio-spectrogram-transformer", "input_values", (2, 32, 16)),
    ("speech_to_text", "input_features", (2, 28, 16)),
    ("wav2vec2-bert", "input_features", (2, 28, 20)),
    ("moonshine", "input_values", (2, 2800)),
    ("canine", "input_ids", (2, 7)),
    ("videomae", "pixel_values", (2, 4, 3, 16, 16)),
    ("vjepa2", "pixel_values_videos", (2, 4, 3, 16, 16)),
    ("patchtst", "past_values", (2, 16, 3)),
    ("timesfm", "past_values", (2, 64)),
    ("time_series_transformer", "past_time_features", (2, 11, 2))])
def test_audio_video_series_layouts_and_characters_follow_what_forward_takes(model_type, key, shape):
    model = build(model_type, *(CANINE if model_type == "canine" else CASES[model_type]))
    kwargs = symgraph.load(model).kwargs
    assert tuple(kwargs[key].shape) == shape
    with torch.no_grad():
        model(**kwargs)  # the model runs on them
    if model_type == "canine":
        assert 32 <= int(kwargs[key].min()) and int(kwargs[key].max()) < 127  # printable code points


class _NanInFloat64(torch.nn.Module):
    """An MLP whose code gives NaN whenever it runs in float64, its float32 casts kept in float64 or not."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    def forward(self, x):
        y = self.mlp(x)
        return y * float("nan") if y.dtype == torch.float64 else y


def test_a_model_whose_float64_outputs_are_all_nan_cannot_be_checked():
    subject = symgraph.load(_NanInFloat64(), inputs=(torch.randn(2, 4),))
    assert subject.report.groups  # the analysis needs no float64 run
    with pytest.raises(UnverifiableError, match="cannot be checked: in float64 every output") as caught:
        fuzz(subject, samples=1)
    assert "verify=False" in caught.value.hint


def test_canine_is_traced_where_its_molecules_are_not_empty_and_checked_with_its_casts_in_float64():
    """CANINE pools 4 characters into a molecule and drops the last molecule for [CLS]: at the 7 characters of the
    example inputs nothing is left, and the trace joined the characters' stream with an empty piece of the
    molecules'. Its groups moved the molecules' norm with the characters' stream: invisible at 7 characters, a
    change of 1.5e-2 at 17 (float32 too), never checked, since its float64 copy gave NaN (it is checked with its
    float32 casts kept in float64 now). It is traced at a length that leaves molecules, and every group is sound."""
    subject = symgraph.load(build("canine", *CANINE))
    assert subject.capture.lengthened is not None and subject.capture.filled_when_longer > 0
    assert any("empty" in note for note in subject.report.notes)
    result = fuzz(subject, samples=2, seed=1)
    assert result.ok and len(result.verdicts) == len(subject.report.groups) > 0, \
        [v.counterexample for v in result.failures]


@pytest.mark.parametrize("model_type", ["videomae", "time_series_transformer", "mistral3", "smolvlm", "wav2vec2-bert"])
def test_a_saved_model_of_a_new_input_kind_is_fuzzed_from_the_command_line(model_type, tmp_path):
    """A Hugging Face folder of a kind whose inputs symgraph now builds (a clip; a forecast's past and future;
    image placeholders counted by the model, with its image sizes; images as tiles; stacked filterbank frames):
    ``symgraph fuzz`` analyses it from its config alone and finds every group invariant."""
    build(model_type, *CASES[model_type]).save_pretrained(tmp_path / "model")
    assert_fuzzed(tmp_path / "model", tmp_path, samples=2)
