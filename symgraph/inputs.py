"""Example inputs for Hugging Face models, built from their ``PretrainedConfig`` alone.

Dispatch is on what a config *has*, never on its model name:

===========================================  ==================================================================
config has                                   inputs built
===========================================  ==================================================================
``encoder`` and ``decoder`` sub-configs      the encoder's inputs, plus ``decoder_input_ids`` from the decoder
``text_config`` and ``vision_config``        ``input_ids`` (text) and ``pixel_values`` (vision), CLIP-like
                                             (``input_ids`` alone when ``forward`` takes an
                                             ``image_grid_thw``: Qwen2-VL's patches, see below); the
                                             same for a ``vision_config`` alone when ``forward`` takes
                                             both (GIT: the text sizes at the top level)
``num_mel_bins``                             ``input_features`` (batch, mel bins, frames), Whisper-like; when
                                             ``forward`` takes ``input_values`` instead, a spectrogram (batch,
                                             ``max_length`` frames, mel bins), AST-like
``input_feat_per_channel``                   ``input_features`` (batch, frames, features), Speech2Text-like
``feature_projection_input_dim``             ``input_features`` (batch, frames, that width) when ``forward``
                                             takes them, Wav2Vec2-BERT's stacked filterbank frames
``conv_kernel`` and ``conv_stride``          ``input_values`` (batch, samples), wav2vec2-like raw audio; also
                                             when ``forward`` takes ``input_values`` and no token ids (Moonshine)
``image_size`` or ``num_channels``           ``pixel_values`` (batch, channels, height, width) when the config has
                                             no ``vocab_size`` or ``forward`` takes pixels and no token ids
                                             (BEiT); 32 x 32 when there is no ``image_size`` (ResNet)
``num_frames`` or ``frames_per_clip``        a video (batch, frames, channels, height, width) as ``pixel_values``
                                             (VideoMAE, ViViT, TimeSformer) or as ``pixel_values_videos`` where
                                             ``forward`` takes that (V-JEPA 2, VideoPrism; ``crop_size`` is
                                             its image size)
``context_length``                           ``past_values`` (batch, context length, ``num_input_channels``) when
                                             ``forward`` takes them, a time series (PatchTST; one channel and no
                                             channel axis without ``num_input_channels``: TimesFM, with no step
                                             padded and frequency id 0 where ``forward`` requires them); with
                                             ``past_time_features``, a forecast's past (context plus largest
                                             lag), future and time features (TimeSeriesTransformer, Informer)
``vocab_size``                               ``input_ids``; printable code points when ``forward`` takes token
                                             ids but the config has no vocabulary (CANINE reads characters)
``is_encoder_decoder``                       ``decoder_input_ids`` in addition
===========================================  ==================================================================

Token ids avoid the config's special tokens (pad, bos, eos, image placeholders, ...), so no model needs an
``attention_mask`` to ignore padding; one of ones is added only on request, because a mask adds nodes to the
traced graph (``symgraph.load`` asks for one when a model's code cannot trace without it, see
:func:`with_attention_mask`). A vision-language config with ``image_seq_length`` gets that many image
placeholder tokens in front of each sequence; given the model (:func:`model_example_inputs`, what ``symgraph.load``
uses), as many as its image path makes features per image (Gemma 3, PaliGemma, Mistral 3 name or derive the count
otherwise), with each image's size where that path requires it, and the images as tiles (batch, tiles, channels,
height, width) where it takes no 4-d pixels (SmolVLM, LLaVA-NeXT). A model that takes its images as patches with an
``image_grid_thw`` (Qwen2-VL, GLM-4V) sizes tensors by the grid's values, which torch.export cannot trace: it gets
text alone, and the analysis pins the stream its images would enter (:func:`symgraph.capture.untraced_inputs`).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from .errors import ModelLoadError

__all__ = ["example_inputs", "forward_kwargs", "in_some_form", "longest_tokens", "model_example_inputs",
           "optional_inputs", "other_forms", "with_attention_mask", "with_choices", "without_cache"]

_DEFAULT_IMAGE_SIZE = 32  # for convolutional configs without an image size (ResNet): any size is accepted
_SUBSAMPLING = 4  # filterbank frames per position: speech front-ends subsample by 4 (Speech2Text's two stride-2 convs)
_SAMPLES_PER_FRAME = 400  # raw audio per position (25 ms at 16 kHz) where the config does not describe the stem
_PRINTABLE = (32, 127)  # code points of printable ASCII, for models that read characters instead of tokens
# images given as patches with the grid they came from (Qwen2-VL): the code sizes tensors by the grid's values,
# which torch.export cannot trace, so such a model is traced on text alone (its images' stream is then pinned:
# :func:`symgraph.capture.untraced_inputs`)
_GRID_INPUTS = frozenset({"image_grid_thw"})
_FRAME_ATTRS = ("num_frames", "frames_per_clip")  # a video model's clip length, fixed by its position table
_IMAGE_SIZE_ATTRS = ("image_size", "crop_size")  # V-JEPA 2 calls its frames' size the crop size
_CHANNEL_ATTRS = ("num_channels", "in_chans")
_VIDEO_INPUTS = ("pixel_values_videos", "pixel_values")  # the names a video model's forward takes it by
_IMAGE_TOKEN_ATTRS = ("image_token_index", "image_token_id")
_SPECIAL_TOKEN_ATTRS = _IMAGE_TOKEN_ATTRS + (
    "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
    "mask_token_id", "unk_token_id")


def example_inputs(config: Any, *, batch: int = 2, seq: int = 7, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32, attention_mask: bool = False,
                   forward_params: Collection[str] | None = None, image_tokens: int | None = None
                   ) -> dict[str, torch.Tensor]:
    """Keyword tensor inputs for the model that ``config`` describes.

    Parameters
    ----------
    config
        A ``transformers.PretrainedConfig`` (or any object with the same attributes).
    batch, seq
        Batch size and sequence length (token sequences, audio frames after the feature encoder).
    seed
        Seed of the ``torch.Generator`` that draws every tensor; equal seeds give equal inputs.
    device
        Where the tensors live. On ``"meta"`` only shapes and dtypes are produced.
    dtype
        Floating dtype of float inputs (pixels, audio); token ids are always ``int64``.
    attention_mask
        Add an all-ones ``attention_mask`` beside ``input_ids``.
    forward_params
        Names of the model's ``forward`` parameters, when known: they settle what a config with both a vocabulary
        and an image size takes (BEiT's ``vocab_size`` is for masked-image pretraining; it takes pixels), which
        audio layout a model takes (AST's spectrogram as ``input_values``, Moonshine's raw audio beside a
        decoder's vocabulary), and that a config without a vocabulary reads characters (CANINE).
    image_tokens
        Placeholder tokens per image of a vision-language model, where known better than from the config (what
        the model's image path measured: :func:`model_example_inputs`).

    Examples
    --------
    >>> from transformers import AutoConfig
    >>> cfg = AutoConfig.for_model("bert", vocab_size=100, hidden_size=32, num_attention_heads=4)
    >>> {k: tuple(v.shape) for k, v in example_inputs(cfg).items()}
    {'input_ids': (2, 7)}
    """
    maker = _Maker(batch, seq, seed, torch.device(device), dtype, image_tokens)
    inputs = _encoder_inputs(_encoder_config(config), maker, forward_params)
    if attention_mask and "input_ids" in inputs:
        inputs["attention_mask"] = maker.ones(tuple(inputs["input_ids"].shape))
    decoder = _decoder_config(config)
    if decoder is not None and getattr(decoder, "vocab_size", None) is not None:  # a forecast decodes values
        inputs["decoder_input_ids"] = maker.token_ids(decoder, start=_start_token(config, decoder))
    return inputs


def model_example_inputs(model: torch.nn.Module, config: Any, **shape: Any) -> dict[str, Any]:
    """:func:`example_inputs` for ``model`` (its forward's parameters settle what a config that describes both
    tokens and pixels takes), where the model places image features at placeholder tokens (Llava, Gemma 3,
    PaliGemma, Aya Vision), with as many placeholders per image as its image path makes features: configs name
    that count many ways (``image_seq_length``, ``mm_tokens_per_image``, ``num_image_tokens``) or derive it from
    sizes, pooling and pixel shuffles, so it is measured by the model's ``get_image_features`` on the example
    images (the config's count where that cannot run). ``image_sizes`` (batch, 2), each image's height and width,
    are given where that path requires them (Mistral 3's Pixtral tower). A model whose image path takes no 4-d
    pixels gets them as (batch, tiles, channels, height, width), with as many tiles per image as it needs
    (:func:`_measured_tiles`: one for Idefics 2 and 3 and SmolVLM, a base tile and a grid for LLaVA-NeXT)."""
    params = inspect.signature(model.forward).parameters
    inputs = example_inputs(config, forward_params=params, **shape)
    pixels = inputs.get("pixel_values")
    token, configured = _image_tokens(config)
    if pixels is None or "input_ids" not in inputs or token is None:
        return inputs
    extra = _image_path_inputs(model, pixels)
    if extra is None:
        return inputs
    count, tiles = _measured_image_tokens(model, pixels, extra), 0
    if count is None:
        count, tiles = _measured_tiles(model, pixels, extra)
    if count is not None and count != configured:
        inputs = example_inputs(config, forward_params=params, image_tokens=count, **shape)
    if tiles:
        inputs = {**inputs, "pixel_values": _tiled(inputs["pixel_values"], tiles)}
    return {**inputs, **{k: v for k, v in extra.items() if k in params}}


# The most tiles per image tried for an image path that takes (batch, tiles, channels, height, width): LLaVA-NeXT
# cuts an image of one tile's size into a base tile and a grid of 1 x 2 (3 tiles), Idefics and SmolVLM take 1.
MAX_TILES = 9


def _measured_tiles(model: torch.nn.Module, pixels: torch.Tensor, extra: dict[str, Any]) -> tuple[int | None, int]:
    """For an image path that takes no 4-d pixels: the placeholders per image and the fewest tiles per image
    (:func:`_tiled`) it runs on, trying 1 to :data:`MAX_TILES` (how many an image's size makes is the model's
    own rule: it slices the tiles it needs and refuses too few); (None, 0) where none runs."""
    if pixels.dim() != 4:
        return None, 0
    for tiles in range(1, MAX_TILES + 1):
        count = _measured_image_tokens(model, _tiled(pixels, tiles), extra)
        if count is not None:
            return count, tiles
    return None, 0


def _tiled(pixels: torch.Tensor, tiles: int) -> torch.Tensor:
    """Images (batch, channels, height, width) as (batch, tiles, channels, height, width), each tile the image
    shifted by one more column (tiles that differ, as a model's crops do)."""
    return torch.stack([pixels.roll(k, dims=-1) for k in range(tiles)], dim=1)


def _image_path_inputs(model: torch.nn.Module, pixels: torch.Tensor) -> dict[str, Any] | None:
    """What ``model.get_image_features`` requires beside the pixels (None: it has none, or requires something
    no example can give): ``image_sizes`` as lists of Python ints, which the trace keeps as constants (tensors of
    sizes would make the sizes it cuts to depend on tensor values, which torch.export cannot trace)."""
    features = getattr(model, "get_image_features", None)
    if not callable(features):
        return None
    try:
        params = inspect.signature(features).parameters
    except (TypeError, ValueError):
        return None
    extra = {}
    for name, param in params.items():
        if name == "pixel_values" or param.default is not inspect.Parameter.empty \
                or param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name != "image_sizes" or pixels.dim() != 4:
            return None
        extra[name] = [list(pixels.shape[-2:])] * pixels.shape[0]
    return extra


def _measured_image_tokens(model: torch.nn.Module, pixels: torch.Tensor, extra: dict[str, Any]) -> int | None:
    """Rows of image features ``model.get_image_features`` gives per image of ``pixels`` (None where it fails or
    the rows do not split evenly among the images)."""
    device = next((p.device for p in model.parameters()), pixels.device)  # a config-only model: on meta, shapes only
    try:
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pixels.to(device), **extra)
    except Exception:  # noqa: BLE001 -- an image path that cannot run on its own: the config's count stands
        return None
    out = getattr(out, "pooler_output", out)  # a ModelOutput: the features it returns for the text stream
    parts = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else []
    if not parts or not all(isinstance(p, torch.Tensor) and p.dim() >= 2 for p in parts):
        return None
    rows = sum(p.numel() // p.shape[-1] for p in parts)
    images = pixels.shape[0]
    return rows // images if rows and rows % images == 0 else None


def forward_kwargs(config: Any) -> dict[str, Any]:
    """Non-tensor keyword arguments for ``forward``: ``return_dict=True``, and ``use_cache=False`` where the
    config has a cache switch (decoders), so tracing does not build a key/value cache.

    Examples
    --------
    >>> from transformers import AutoConfig
    >>> forward_kwargs(AutoConfig.for_model("gpt2"))
    {'return_dict': True, 'use_cache': False}
    """
    return {"return_dict": True, **without_cache(config)}


def without_cache(config: Any) -> dict[str, Any]:
    """``{"use_cache": False}`` where ``config`` or a sub-config of it (Llava's, Qwen2-VL's ``text_config``) has a
    cache switch, else nothing: what every forward pass symgraph runs adds to its inputs."""
    return {"use_cache": False} if any(getattr(c, "use_cache", None) is not None for c in _configs(config)) else {}


def longest_tokens(config: Any, longest: int) -> int:
    """``longest``, or the config's position count where that is smaller (the most tokens a position table
    holds).

    >>> from types import SimpleNamespace
    >>> longest_tokens(SimpleNamespace(max_position_embeddings=64), 512), longest_tokens(None, 512)
    (64, 512)
    """
    counts = [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions", "n_ctx")]
    return min([longest, *(int(c) for c in counts if isinstance(c, int) and c > 1)])


def in_some_form(kwargs: dict[str, Any], attempt: Callable[[dict[str, Any]], Any], *, others: bool,
                 failing: type[Exception] = Exception) -> tuple[Any, dict[str, Any]]:
    """``(attempt(kwargs), kwargs)``; where that raises ``failing`` and ``others`` (the inputs were built from a
    config), the first of :func:`other_forms` that ``attempt`` runs on, with it. Where none runs, the error of
    the first other form tried is raised (with a mask, code that needs one goes furthest: its error says most),
    else the first error."""
    failures = []
    for form in [kwargs, *(other_forms(kwargs) if others else ())]:
        try:
            return attempt(form), form
        except failing as exc:
            failures.append(exc)
    raise failures[min(1, len(failures) - 1)]


def other_forms(kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Other forms of inputs built from a config, to try in turn where a model's code cannot run on them: with an
    attention mask (LongT5's local attention needs one), with an axis of choices (a multiple-choice head)."""
    return [form for form in (with_attention_mask(kwargs), with_choices(kwargs)) if form is not None]


def with_choices(kwargs: dict[str, Any], choices: int = 2) -> dict[str, Any] | None:
    """``kwargs`` with every tensor shaped like its ``input_ids`` given an axis of ``choices`` after the batch
    (choice c the sequence rolled by c, so that choices differ); ``None`` when there are no 2-D token ids. For
    multiple-choice heads (``BertForMultipleChoice`` flattens ``batch x choices`` sequences and scores each).

    Examples
    --------
    >>> ids = torch.ones(2, 3, dtype=torch.long)
    >>> tuple(with_choices({"input_ids": ids, "use_cache": False})["input_ids"].shape)
    (2, 2, 3)
    """
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    return {k: torch.stack([v.roll(c, dims=-1) for c in range(choices)], dim=1)
            if isinstance(v, torch.Tensor) and v.shape == ids.shape else v for k, v in kwargs.items()}


def with_attention_mask(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` plus an all-ones ``attention_mask`` beside its ``input_ids``; ``None`` when there are no token
    ids or a mask is already there. For models whose code cannot run without a mask (LongT5's local attention).

    Examples
    --------
    >>> ids = torch.ones(2, 3, dtype=torch.long)
    >>> tuple(with_attention_mask({"input_ids": ids})["attention_mask"].shape)
    (2, 3)
    """
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or kwargs.get("attention_mask") is not None:
        return None
    return {**kwargs, "attention_mask": torch.ones(ids.shape, dtype=torch.long, device=ids.device)}


# Optional forward inputs that make a model read parameters it leaves unread without them, by name: what each is
# built from. XLNet reads its segment embeddings (``seg_embed``, ``r_s_bias``, in the query/key dot products) only
# when given ``token_type_ids``; a decoder's cross-attention (MBart's, ProphetNet's as causal LMs) reads its query and
# output projections only when given ``encoder_hidden_states``; XLM adds language embeddings only when given
# ``langs``; a ViT puts its mask token in place of the patches ``bool_masked_pos`` picks (DINOv2, DINOv3), a speech
# encoder its ``masked_spec_embed`` in place of the frames ``mask_time_indices`` picks (SEW writes it into a stream its
# groups move); LUKE reads its entity embeddings and entity-aware attention only when given entities. Encoder
# states are built for decoders only (``is_decoder``): an encoder given them may attend to them with its own
# self-attention's keys (BigBird's code), a use its stream's groups are not found for. A trace
# without them finds groups that move the query or the stream but not those parameters: the model computes something
# else once it is given them. :func:`symgraph.capture.capture` adds them, built here, where the first trace left
# parameters unread.
_OPTIONAL_TOKEN_INPUTS = {"token_type_ids": "type_vocab_size", "langs": "n_langs"}  # name -> how many values
_OPTIONAL_STATE_INPUTS = {"encoder_hidden_states": ("cross_attention_hidden_size", "hidden_size")}  # -> width
_OPTIONAL_PATCH_MASKS = ("bool_masked_pos",)  # one flag per patch of the pixels given (the config's patch_size)
_OPTIONAL_FRAME_MASKS = ("mask_time_indices",)  # one flag per frame of the audio given (after its convolutions)
# inputs that come as a set: LUKE's entities (ids below the config's entity vocabulary, each with the word positions
# of its mention), read by its entity embeddings and entity-aware attention; name -> (count attribute, companion)
_OPTIONAL_INPUT_SETS = {"entity_ids": ("entity_vocab_size", "entity_position_ids")}
_ENTITIES = 2  # entities per example, and positions per mention


def optional_inputs(config: Any, forward_params: Collection[str], given: dict[str, Any], *, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The optional inputs (module comment above) that ``forward`` takes, ``given`` lacks and symgraph can build
    beside ``given``'s ``input_ids``: ids shaped like them (below the config's count of such values, 2 where it has
    none), for a decoder hidden states of the config's width as long as them, in ``dtype``, entities with the
    positions of their mentions; beside its ``pixel_values``, a mask of random patches; beside its audio, a mask of
    random frames.

    Examples
    --------
    >>> from transformers import AutoConfig
    >>> cfg = AutoConfig.for_model("xlnet", vocab_size=50, d_model=32, n_head=4)
    >>> built = optional_inputs(cfg, ["input_ids", "token_type_ids"], {"input_ids": torch.ones(2, 5, dtype=torch.long)})
    >>> {k: tuple(v.shape) for k, v in built.items()}
    {'token_type_ids': (2, 5)}
    """
    wanted = [n for n in forward_params if given.get(n) is None]
    generator = torch.Generator().manual_seed(seed)
    built: dict[str, torch.Tensor] = {}
    pixels, patch = given.get("pixel_values"), getattr(config, "patch_size", None)
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and isinstance(patch, int) and patch > 0:
        count = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
        for name in wanted:
            if name in _OPTIONAL_PATCH_MASKS:
                built[name] = (torch.rand(pixels.shape[0], count, generator=generator) < 0.5).to(pixels.device)
    frames = _audio_frames(config, given)
    if frames is not None:
        audio = given.get("input_values", given.get("input_features"))
        for name in wanted:
            if name in _OPTIONAL_FRAME_MASKS:
                built[name] = (torch.rand(audio.shape[0], frames, generator=generator) < 0.5).to(audio.device)
    ids = given.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return built
    for name in wanted:
        if name in _OPTIONAL_TOKEN_INPUTS:
            count = getattr(config, _OPTIONAL_TOKEN_INPUTS[name], None)
            count = int(count) if isinstance(count, int) and count > 0 else 2
            built[name] = torch.randint(count, tuple(ids.shape), generator=generator).to(ids.device)
        elif name in _OPTIONAL_STATE_INPUTS and getattr(config, "is_decoder", False):
            width = next((getattr(config, a) for a in _OPTIONAL_STATE_INPUTS[name]
                          if isinstance(getattr(config, a, None), int)), None)
            if width is not None:
                built[name] = torch.randn(*ids.shape, width, generator=generator).to(device=ids.device, dtype=dtype)
        elif name in _OPTIONAL_INPUT_SETS:
            count, companion = _OPTIONAL_INPUT_SETS[name]
            count = getattr(config, count, None)
            if isinstance(count, int) and count > 1 and companion in wanted:
                shape = (ids.shape[0], _ENTITIES)
                built[name] = torch.randint(1, count, shape, generator=generator).to(ids.device)
                built[companion] = torch.randint(ids.shape[1], (*shape, _ENTITIES), generator=generator).to(ids.device)
    return built


def _configs(config: Any) -> list[Any]:
    """The config and every sub-config (a decoder, Llava's ``text_config``): any of them may hold ``use_cache``."""
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {}]
    return [c for c in (config, _decoder_config(config), *subs) if c is not None and not isinstance(c, dict)]


class _Maker:
    """Draws tensors of one batch/sequence shape from one seeded generator (on CPU, then moved)."""

    def __init__(self, batch: int, seq: int, seed: int, device: torch.device, dtype: torch.dtype,
                 image_tokens: int | None = None):
        self.batch, self.seq, self.device, self.dtype = batch, seq, device, dtype
        self.image_tokens = image_tokens  # placeholders per image, where measured (:func:`model_example_inputs`)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def meta(self) -> bool:
        return self.device.type == "meta"

    def token_ids(self, config: Any, start: int | None = None, avoid: Any = None, prefix: int = 0,
                  prefix_id: int | None = None) -> torch.Tensor:
        """Random ids of ``config``'s vocabulary, none of its (or ``avoid``'s) special tokens; ``prefix``
        leading positions hold ``prefix_id`` instead (the image tokens a vision-language model replaces)."""
        shape = (self.batch, self.seq + prefix)
        if self.meta:
            return torch.empty(shape, dtype=torch.long, device="meta")
        vocab = int(config.vocab_size)
        special = _special_ids(config) | (_special_ids(avoid) if avoid is not None else set())
        allowed = torch.tensor(sorted(set(range(vocab)) - special) or list(range(vocab)))
        ids = allowed[torch.randint(len(allowed), shape, generator=self.generator)]
        if start is not None and 0 <= start < vocab:
            ids[:, 0] = start
        if prefix:
            ids[:, :prefix] = prefix_id
        return ids.to(self.device)

    def characters(self) -> torch.Tensor:
        """Printable ASCII code points, for a model that reads characters and has no vocabulary (CANINE)."""
        shape = (self.batch, self.seq)
        if self.meta:
            return torch.empty(shape, dtype=torch.long, device="meta")
        return torch.randint(*_PRINTABLE, shape, generator=self.generator).to(self.device)

    def floats(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=self.dtype, device="meta")
        return torch.randn(shape, generator=self.generator).to(device=self.device, dtype=self.dtype)

    def ones(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=torch.long, device=self.device)

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=self.device)


def _encoder_inputs(config: Any, maker: _Maker, forward_params: Collection[str] | None) -> dict[str, torch.Tensor]:
    text, vision = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if text is None and vision is not None and forward_params is not None \
            and {"input_ids", "pixel_values"} <= set(forward_params):
        text = config  # GIT: the text model's sizes at the top level, beside a vision sub-config
    if text is not None and vision is not None:
        if forward_params is not None and _GRID_INPUTS & set(forward_params):
            return {"input_ids": maker.token_ids(text, avoid=config)}
        image_token, count = _image_tokens(config)
        count = count if maker.image_tokens is None or image_token is None else maker.image_tokens
        takes_video = forward_params is not None and "pixel_values" not in forward_params \
            and "pixel_values_videos" in forward_params  # VideoPrism's text and video towers
        return {"input_ids": maker.token_ids(text, avoid=config, prefix=count, prefix_id=image_token),
                "pixel_values_videos" if takes_video else "pixel_values": _pixels(vision, maker, _frames(vision))}
    takes = set(forward_params) if forward_params is not None else set()
    mel_bins = getattr(config, "num_mel_bins", None)
    if mel_bins is not None and "input_values" in takes and "input_features" not in takes:
        frames = getattr(config, "max_length", None) or maker.seq  # AST: its position table fixes the frame count
        return {"input_values": maker.floats((maker.batch, int(frames), int(mel_bins)))}
    if mel_bins is not None:
        return {"input_features": _mel_features(config, maker)}
    if getattr(config, "input_feat_per_channel", None) is not None:
        features = int(config.input_feat_per_channel) * int(getattr(config, "input_channels", 1))
        return {"input_features": maker.floats((maker.batch, _SUBSAMPLING * maker.seq, features))}
    if getattr(config, "feature_projection_input_dim", None) is not None and "input_features" in takes:
        width = int(config.feature_projection_input_dim)  # stacked filterbank frames (Wav2Vec2-BERT)
        return {"input_features": maker.floats((maker.batch, _SUBSAMPLING * maker.seq, width))}
    if getattr(config, "conv_kernel", None) is not None and getattr(config, "conv_stride", None) is not None:
        return {"input_values": maker.floats((maker.batch, _raw_audio_length(config, maker.seq)))}
    if "input_values" in takes and "input_ids" not in takes:  # raw audio into a stem the config does not describe
        return {"input_values": maker.floats((maker.batch, _SAMPLES_PER_FRAME * maker.seq))}
    if "past_values" in takes and isinstance(getattr(config, "context_length", None), int):
        return _series(config, maker, takes)
    video = _video_input(config, forward_params)
    if video is not None:
        return {video: _pixels(config, maker, frames=_frames(config))}
    if _takes_pixels(config, forward_params):
        return {"pixel_values": _pixels(config, maker)}
    if getattr(config, "vocab_size", None) is not None:
        return {"input_ids": maker.token_ids(config)}
    if "input_ids" in takes:
        return {"input_ids": maker.characters()}
    raise ModelLoadError(
        f"Cannot build example inputs for {type(config).__name__}: it has no vocab_size, image_size, num_channels, "
        f"num_mel_bins, input_feat_per_channel, feature_projection_input_dim or conv_kernel, nor text/vision or "
        f"encoder/decoder sub-configs, and forward() takes neither input_ids nor input_values (nor past_values with "
        f"a context_length).",
        hint="pass example inputs (inputs=... in Python), or load a 'module:factory' that returns (model, args).")


def _series(config: Any, maker: _Maker, takes: Collection[str]) -> dict[str, torch.Tensor]:
    """Past values of a time series, and what TimesFM's ``forward`` requires beside them: padding flags (none
    padded) and a frequency id per series; for a forecasting encoder-decoder, :func:`_forecast`'s inputs."""
    if "past_time_features" in takes:
        return _forecast(config, maker, takes)
    channels = getattr(config, "num_input_channels", None)
    channel_axis = (channels,) if isinstance(channels, int) else ()
    values = maker.floats((maker.batch, int(config.context_length), *channel_axis))
    out = {"past_values": values}
    if "past_values_padding" in takes:
        out["past_values_padding"] = maker.zeros(tuple(values.shape[:2]))
    if "freq" in takes:  # (batch, 1): TimesFmModel adds its embedding to every patch (its prediction head reshapes)
        out["freq"] = maker.zeros((maker.batch, 1))
    return out


def _forecast(config: Any, maker: _Maker, takes: Collection[str]) -> dict[str, torch.Tensor]:
    """A forecasting encoder-decoder's inputs (TimeSeriesTransformer, Informer): the past (context plus the
    largest lag) with its time features and every value observed, the future to predict with its time features, and
    static features where the config has them."""
    variates = int(getattr(config, "input_size", 1) or 1)
    per_step = (variates,) if variates > 1 else ()
    past = int(config.context_length) + max(_ints(getattr(config, "lags_sequence", None) or [0]))
    future = int(config.prediction_length)
    features = int(getattr(config, "num_time_features", 0) or 0)
    out = {"past_values": maker.floats((maker.batch, past, *per_step)),
           "past_time_features": maker.floats((maker.batch, past, features)),
           "past_observed_mask": maker.ones((maker.batch, past, *per_step)),
           "future_values": maker.floats((maker.batch, future, *per_step)),
           "future_time_features": maker.floats((maker.batch, future, features))}
    categorical = int(getattr(config, "num_static_categorical_features", 0) or 0)
    if categorical and "static_categorical_features" in takes:
        out["static_categorical_features"] = maker.zeros((maker.batch, categorical))
    real = int(getattr(config, "num_static_real_features", 0) or 0)
    if real and "static_real_features" in takes:
        out["static_real_features"] = maker.floats((maker.batch, real))
    return {k: v for k, v in out.items() if k in takes}


def _video_input(config: Any, forward_params: Collection[str] | None) -> str | None:
    """The name ``forward`` takes a video by, where ``config`` describes clips of frames and ``forward`` takes no
    token ids; else ``None``."""
    if _frames(config) is None:
        return None
    if forward_params is None:
        return "pixel_values" if getattr(config, "vocab_size", None) is None else None
    if "input_ids" in forward_params:
        return None
    return next((name for name in _VIDEO_INPUTS if name in forward_params), None)


def _frames(config: Any) -> int | None:
    return next((int(v) for v in (getattr(config, a, None) for a in _FRAME_ATTRS) if isinstance(v, int) and v > 0),
                None)


def _first(config: Any, names: Iterable[str]) -> Any:
    return next((v for v in (getattr(config, a, None) for a in names) if v is not None), None)


def _takes_pixels(config: Any, forward_params: Collection[str] | None) -> bool:
    is_image = _first(config, _IMAGE_SIZE_ATTRS) is not None or _first(config, _CHANNEL_ATTRS) is not None
    if not is_image:
        return False
    if forward_params is not None and "pixel_values" in forward_params:
        return "input_ids" not in forward_params
    return getattr(config, "vocab_size", None) is None


def _encoder_config(config: Any) -> Any:
    encoder = getattr(config, "encoder", None)
    return encoder if encoder is not None and hasattr(encoder, "to_dict") else config


def _decoder_config(config: Any) -> Any | None:
    decoder = getattr(config, "decoder", None)
    if decoder is not None and hasattr(decoder, "to_dict"):
        return decoder
    if getattr(config, "is_encoder_decoder", False):
        return getattr(config, "text_config", None) or config
    return None


def _start_token(config: Any, decoder: Any) -> int | None:
    for source in (config, decoder):
        start = getattr(source, "decoder_start_token_id", None)
        if isinstance(start, int):
            return start
    return None


def _pixels(config: Any, maker: _Maker, frames: int | None = None) -> torch.Tensor:
    """Images (batch, channels, height, width), or with ``frames`` a video (batch, frames, channels, height,
    width)."""
    size = _first(config, _IMAGE_SIZE_ATTRS) or _DEFAULT_IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    clip = () if frames is None else (frames,)
    return maker.floats((maker.batch, *clip, int(_first(config, _CHANNEL_ATTRS) or 3), int(height), int(width)))


def _mel_features(config: Any, maker: _Maker) -> torch.Tensor:
    # Whisper's encoder checks the frame count: its stride-1 and stride-2 convs must leave max_source_positions.
    positions = getattr(config, "max_source_positions", None)
    frames = 2 * int(positions) if positions is not None else maker.seq
    return maker.floats((maker.batch, int(config.num_mel_bins), frames))


def _audio_frames(config: Any, given: dict[str, Any]) -> int | None:
    """Frames the encoder of a speech model makes of ``given``'s audio: raw samples through the config's
    convolutions (wav2vec2), or features already one frame a row (``input_features``, batch x frames x features)."""
    samples, features = given.get("input_values"), given.get("input_features")
    if isinstance(samples, torch.Tensor) and samples.dim() == 2 and getattr(config, "conv_kernel", None) is not None:
        length = samples.shape[-1]
        for kernel, stride in zip(_ints(config.conv_kernel), _ints(getattr(config, "conv_stride", ()))):
            length = (length - kernel) // stride + 1
        return length if length > 0 else None
    if isinstance(features, torch.Tensor) and features.dim() == 3:
        return features.shape[1]
    return None


def _raw_audio_length(config: Any, frames: int) -> int:
    """Samples that a stack of convolutions (kernel k, stride s) turns into exactly ``frames`` frames."""
    length = frames
    for kernel, stride in reversed(list(zip(_ints(config.conv_kernel), _ints(config.conv_stride)))):
        length = (length - 1) * stride + kernel
    return length


def _image_tokens(config: Any) -> tuple[int | None, int]:
    """The placeholder token a vision-language model (Llava) replaces by image features, and how many of them
    one image needs by the config (``image_seq_length``, else 0); (None, 0) for models that take no placeholders
    (CLIP)."""
    token = next((getattr(config, a) for a in _IMAGE_TOKEN_ATTRS if isinstance(getattr(config, a, None), int)), None)
    count = getattr(config, "image_seq_length", None)
    return (token, int(count) if isinstance(count, int) and token is not None else 0)


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for attr in _SPECIAL_TOKEN_ATTRS:
        value = getattr(config, attr, None)
        if value is not None:
            ids.update(_ints(value))
    return ids


def _ints(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, Iterable) else [int(value)]
