"""An independent soundness sweep over Hugging Face model types (issue 10's bar). Prints one JSON object.

For each model type the default ``transformers`` config is shrunk (every size field it has: width, depth,
heads, experts, vocabulary, image and patch size, ...), the model is built with its natural head, and every
parameter gets noise so no norm weight is 1 and no bias 0. symgraph then reports the model from its own example
inputs, and each reported group is checked *independently of symgraph's verification*: random elements
(``symgraph.elements.sample``, never the identity) are applied, and the float64 outputs are compared with the
original's at input shapes other than the traced one (batch 1, 2 and 3, lengths 1, 2, 5, 11 and 19, a padding
mask where ``forward`` takes one), with transformers' own reference experts loop for mixtures of experts. The model
runs in float64 throughout (its own float32 casts kept in float64 where it computes alike that way), and a group
fails when it changes the outputs by more than 10^4 times the model's floor (the change one rounding of every
state entry makes; at most 1e-5, at least 1e-12). ``symgraph.transform`` runs too, so a group the report lists but the
transform's own check refuses shows up.

Each type runs in its own subprocess with a time limit. Classes:

* ``sound``: groups found, every one preserved the outputs at every shape;
* ``nothing``: no group found (sound, but nothing to align);
* ``unsound``: some group changed the outputs (the group ids and errors are listed);
* ``refused``: symgraph's ``transform`` refused its own report (the report lists a group transform refuses);
* ``crash``: symgraph failed with an unexpected exception (not a :class:`symgraph.errors.SymgraphError`);
* ``unsupported``: symgraph stopped with its own clear error (message recorded);
* ``timeout``: over the per-type limit;
* ``skipped``: the tiny model could not be built or run by transformers itself (not symgraph's concern).

``named`` marks types an issue or the test zoo already names; the bar is measured on the others. Run in chunks
under load; results accumulate in ``--jsonl`` (one line per type, the last line per type wins)::

    python examples/sweep_architectures.py --types llama,bert --timeout 300 --jsonl /tmp/sweep.jsonl
    python examples/sweep_architectures.py --summarize --jsonl /tmp/sweep.jsonl -o examples/results/sweep.json

After fixes, re-run some types into another file and compare (``--before`` rows, updated by ``--jsonl`` rows)::

    python examples/sweep_architectures.py --types doge,prophetnet --jsonl /tmp/after.jsonl \
        --before /tmp/sweep.jsonl -o examples/results/sweep.json

``--variants`` sweeps config variants instead (:data:`VARIANTS`: a model type, the options flipped on top of its
shrunk default config, optionally the task heads to build: tied embeddings, biases, head and KV-head counts, rotary
layouts and scalings, norms on queries and keys, parallel residuals, sliding windows, softcapping, multipliers,
router shapes, classification heads, ...), with the same checker; their floating buffers get noise too (a
router's score-correction bias must move with its experts). Rows are keyed by the variant's name;
``--types`` keeps the variants of those types::

    python examples/sweep_architectures.py --variants --jsonl /tmp/variants.jsonl \
        -o examples/results/sweep_variants.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

# Types named by an issue, by the zoo or by the architecture tests: swept too, but kept out of the bar.
NAMED = {
    "bert", "roberta", "distilbert", "deberta-v2", "vit", "gpt2", "gptj", "gpt_neox", "llama", "mistral", "qwen2",
    "qwen3", "phi", "t5", "bart", "opt", "mixtral", "qwen2_moe", "olmoe", "deepseek_v2", "gpt_oss", "clip",
    "whisper", "xglm", "roformer", "llama4_text", "convnext", "persimmon", "mobilebert", "mamba", "deepseek_v3",
    "jamba", "longt5", "switch_transformers", "llava", "resnet", "beit", "squeezebert", "funnel", "nemotron",
    "rwkv", "smollm3", "helium", "glm", "phi3", "albert", "gemma", "falcon", "bloom", "gpt_bigcode", "electra",
    "gemma2", "glm4_moe", "phimoe", "granitemoe",
}

DECODERS = [
    "apertus", "arcee", "bitnet", "cohere", "cohere2", "diffllama", "doge", "exaone4", "gemma3_text", "glm4",
    "granite", "hunyuan_v1_dense", "jais2", "lfm2", "ministral", "olmo", "olmo2", "olmo3", "seed_oss", "stablelm",
    "starcoder2", "codegen", "ctrl", "gpt_neo", "gpt_neox_japanese", "biogpt", "openai-gpt", "mpt", "vaultgemma",
    "internlm3", "minicpm3", "ernie4_5", "nanochat", "modernbert-decoder", "xlnet", "cwm", "exaone4_5",
    "recurrent_gemma", "zamba", "zamba2", "bamba", "mamba2", "falcon_mamba", "falcon_h1", "lfm2_moe",
    "granitemoeshared", "granitemoehybrid", "jetmoe", "dbrx", "qwen3_moe", "qwen3_next", "hunyuan_v1_moe",
    "ernie4_5_moe", "dots1", "minimax", "flex_olmo", "deepseek_v3", "glm4_moe", "phimoe", "jamba", "granitemoe",
    "llama4_text", "xglm",
]
ENCODERS = [
    "camembert", "convbert", "data2vec-text", "ernie", "esm", "ibert", "megatron-bert", "mpnet", "nystromformer",
    "rembert", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "modernbert", "big_bird", "fnet",
    "flaubert", "xlm", "deberta", "longformer", "layoutlm", "mra", "yoso", "eurobert", "nomic_bert", "lilt",
    "canine", "xmod", "roc_bert", "bert-generation", "markuplm", "splinter",
]
SEQ2SEQ = ["mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "m2m_100", "plbart", "mvp", "led",
           "mt5", "umt5", "prophetnet", "fsmt", "bigbird_pegasus", "pegasus_x", "nllb-moe", "t5gemma"]
VISION = ["deit", "dinov2", "dinov2_with_registers", "swin", "swinv2", "convnextv2", "regnet", "mobilenet_v1",
          "mobilenet_v2", "mobilevit", "mobilevitv2", "efficientnet", "levit", "poolformer", "pvt", "pvt_v2",
          "segformer", "data2vec-vision", "vit_msn", "ijepa", "bit", "cvt", "focalnet", "hiera", "swiftformer",
          "dinov3_vit", "dinov3_convnext", "hgnet_v2", "siglip_vision_model", "vit_mae", "glpn", "vitdet"]
AUDIO = ["wav2vec2", "hubert", "wavlm", "unispeech", "unispeech-sat", "sew", "sew-d", "data2vec-audio",
         "wav2vec2-conformer", "speech_to_text", "audio-spectrogram-transformer", "moonshine"]
MULTIMODAL = ["siglip", "chinese_clip", "owlvit", "blip", "altclip", "x_clip"]
# Types outside the lists above that build and run as tiny models with the same shrink (every other entry of
# transformers' CONFIG_MAPPING was tried: /work/tmp probe, this round), by the head they were built with
WIDER_DECODERS = [
    "afmoe", "apertus1p5_text", "aria_text", "axk1", "axk2", "beam", "cohere2_moe", "cpmant", "deepseek_v32",
    "deepseek_v4", "dory", "emu3", "exaone_moe", "flint", "git", "glm4_moe_lite", "glm_moe_dsa", "granite_swa",
    "granitemoe_swa", "hrm_text", "hy_v3", "hy_v4", "hyperclovax", "inkling_text", "kolibri1", "laguna",
    "lara_mini", "lfm3", "minimax_m2", "mllama", "moshi",
]
WIDER_ENCODERS = ["gte", "jina_embeddings_v3", "dpr", "clip_text_model", "granite_docling_text", "molmo2_text",
                  "muse_spark_text"]
WIDER_SEQ2SEQ = ["encoder-decoder"]
WIDER_VISION = ["aimv2_vision_model", "chinese_clip_vision_model", "clip_vision_model", "dpt", "idefics3_vision",
                "internvl_vision", "mlcd_vision_model", "imagegpt", "groupvit"]
WIDER_AUDIO = ["glmasr_encoder", "moss_transcribe_diarize_audio", "higgs_audio_v2"]
WIDER_MULTIMODAL = ["aimv2", "bridgetower", "clipseg", "kosmos-2.5"]
# Types that build only once tiny_config repairs what the plain shrink breaks (per-layer lists, copied widths, rope
# sections; see `repaired`)
WIDER_REPAIRED = [
    "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "embedding_gemma2", "embedding_gemma2_text",
    "olmo_hybrid", "zaya", "esmc", "neomme", "cosmos3_edge_text", "hy_v4_vl_text", "gradium_phonon_tts",
    "pocket_tts", "tipsv2", "mistral4", "kimi_linear", "qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text",
    "glm4v_moe_text", "glm_image_text", "glm_ocr_text", "glm5_next_text",
]
# Vision-language models that take images as patches with an image_grid_thw: traced on text (symgraph.inputs), with
# the stream their images enter pinned; their own type, not only their text towers
WIDER_GRID_VLM = [
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm46v", "glmga", "glm4v_moe", "glm_image",
    "glm_ocr", "glm5_next", "paddleocr_vl", "cosmos3_edge", "cosmos3_omni", "hy_v4_vl", "hyperclovax_vision_v2",
    "kimi_k25", "lfm3_vl", "llava_onevision1_5", "minimax_m3_vl", "muse_glimmer", "muse_spark", "ovis2_5",
    "video_llama_3",
]
# transformers 5.25's entries the probe above had not reached (new families, towers), swept sound as they build:
# decoders, encoders and vision models by the shrink (gemma3n_text and yolos with EXTRA), text and vision towers
# that no Auto class maps by their own model class (:func:`own_model_class`)
WIDER_525 = [
    "ergo", "mellum", "mimo_v2_flash", "minicpm5_moe", "ministral3", "mistral_large4_text", "openai_privacy_filter",
    "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "solar_open", "youtu", "muse_glimmer_text", "nemotron_h",
    "xlstm", "minimax_m3_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text", "gpt-sw3", "gemma3n_text", "ultrabert",
    "luke", "tapas", "visual_bert", "tipsv2_text_model", "sam3_lite_text_text_model", "pixio", "radio", "mlcd",
    "yolos",
]
WIDER_TOWERS = [
    "emu3_text_model", "siglip_text_model", "siglip2_text_model", "metaclip_2_text_model", "videoprism_text_model",
    "kosmos_2_text_model", "kosmos_2_5_text_model", "owlvit_text_model", "owlv2_text_model", "mllama_text_model",
    "granite4_vision_text", "pp_formulanet_text", "aimv2_text_model", "clap_text_model", "groupvit_text_model",
    "xclip_text_model", "chinese_clip_text_model", "align_text_model", "bridgetower_text_model", "flava_text_model",
    "clipseg_text_model", "altclip_vision_model", "blip_vision_model", "blip_2_vision_model", "clipseg_vision_model",
    "git_vision_model", "groupvit_vision_model", "instructblip_vision_model", "janus_vision_model",
    "kosmos_2_vision_model", "metaclip_2_vision_model", "owlvit_vision_model", "owlv2_vision_model", "smolvlm_vision",
    "tipsv2_vision_model", "flava_image_model", "sam_vision_model", "pixtral", "ovis2_vision", "align_vision_model",
]
# video models, which take clips (batch, frames, channels, height, width): skipped until their inputs were built
WIDER_VIDEO = ["videomae", "vivit", "timesformer", "vjepa2", "videoprism_vision_model", "videoprism"]
# time-series models, which take past values (batch, context length[, channels]), and forecasting encoder-decoders,
# which take lagged time features, observation masks and the future too (Autoformer's cannot be traced)
WIDER_SERIES = ["patchtst", "patchtsmixer", "timesfm", "timesfm2_5", "time_series_transformer", "informer"]
# vision-language models that put image features at placeholder tokens (masked_scatter): skipped until the count
# of placeholders was measured from the model's image path (symgraph.inputs.model_example_inputs), and single
# towers and models the same probe found sound as they build
WIDER_PLACEHOLDER_VLM = ["gemma3", "paligemma", "mistral3", "lighton_ocr", "aya_vision", "cohere2_vision",
                         "deepseek_vl", "got_ocr2", "video_llava", "internvl", "qianfan_ocr", "fuyu", "llama4", "emu3",
                         "qwen3_5"]
WIDER_1207 = ["mgp-str", "seamless_m4t", "owlv2", "qwen2_audio_encoder", "metaclip_2", "trocr", "voxtral_encoder"]
# placeholder models whose image path takes (batch, tiles, channels, height, width): skipped until given that
# layout with the tiles each needs (symgraph.inputs._measured_tiles); Idefics and SmolVLM keep the real images by
# their pixel values (a count torch.export leaves symbolic), and data computed at the example's count met shapes
# at the stand-in's (analysis.walk.at_stand_in_sizes)
WIDER_TILED_VLM = ["smolvlm", "idefics3", "idefics2", "llava_next", "llava_onevision"]
# types no earlier sweep listed, found sound as they build once given their inputs (Wav2Vec2-BERT's stacked
# filterbank frames) or a config the shrink leaves consistent (VipLlava's feature layers, T5Gemma 2's image ids)
WIDER_1208 = ["wav2vec2-bert", "vipllava", "xclip", "qwen2_audio", "voxtral", "minicpmv4_6", "phi4_multimodal",
              "granite_speech", "seamless_m4t_v2", "t5gemma2"]
WIDER = (WIDER_DECODERS + WIDER_ENCODERS + WIDER_SEQ2SEQ + WIDER_VISION + WIDER_AUDIO + WIDER_MULTIMODAL
         + WIDER_REPAIRED + WIDER_GRID_VLM + WIDER_525 + WIDER_TOWERS + WIDER_VIDEO + WIDER_SERIES
         + WIDER_PLACEHOLDER_VLM + WIDER_1207 + WIDER_TILED_VLM + WIDER_1208)
# a type in two lists runs once (Emu3 is a grid model and a placeholder one)
TYPES = list(dict.fromkeys(DECODERS + ENCODERS + SEQ2SEQ + VISION + AUDIO + MULTIMODAL + WIDER))

# Size fields and the tiny value each gets wherever a config has it.
SHRINK = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64, "n_embed": 64, "embedding_size": 64,
    "emb_dim": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "kv_channels": 16, "d_kv": 16,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "d_ff": 128, "hidden_dim": 128, "ffn_hidden_size": 128, "intermediate_size_mlp": 128,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "top_k": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "n_group": 1, "topk_group": 1,
    "image_size": 32, "crop_size": 32, "patch_size": 8, "num_channels": 3, "num_labels": 3,
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "time_step_rank": 8, "mamba_n_heads": 4,
    "mamba_d_head": 32, "mamba_n_groups": 1, "n_groups": 1, "mamba_expand": 2, "expand": 2,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "sliding_window": 16, "first_k_dense_replace": 1,
    "projection_intermediate_dim": 128,  # GroupViT's 4096 made one Hungarian 2.3 s: past 800 s
    "dim_ff": 128, "dim_head": 16, "o_lora_rank": 32, "latent_query_num": 8,  # CPM-Ant, DeepSeek-V4, Kosmos-2.5
    "index_n_heads": 4, "index_head_dim": 16,  # the sparse-attention indexers of DeepSeek-V3.2 and HY-V4
    # widths the names above miss: each left one Hungarian over thousands of units (XLNet's 4096, Ergo's 32768
    # dense FFN) or 10^8 parameters (LUKE's 500,000 entities) in the pipeline sweep, past its time limit
    "d_inner": 128, "decoder_intermediate_size": 128, "dense_intermediate_size": 128,
    "first_dense_intermediate_size": 128, "shared_intermediate_size": 48, "moe_shared_expert_intermediate_size": 48,
    "moe_hidden_size": 32, "projection_intermediate_size": 128, "entity_vocab_size": 128,
    "vocab_size_per_layer_input": 128, "linear_num_heads": 4, "linear_head_dim": 16,  # GLM-5-Next's text model
}
WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed", "emb_dim")
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers")
HEAD_COUNTS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXTRA: dict[str, dict] = {  # where the generic shrink leaves an inconsistent config
    "xlnet": dict(d_head=16), "ctrl": dict(dff=128), "prophetnet": dict(ngram=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "recurrent_gemma": dict(lru_width=64, attention_window_size=16, block_types=["recurrent", "attention"]),
    "hunyuan_v1_moe": dict(moe_topk=[2, 2]),
    "granitemoehybrid": dict(mamba_d_head=32, layer_types=["mamba", "attention"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_d_head=16, mamba_n_heads=4),
    "zamba2": dict(mamba_headdim=16, n_mamba_heads=8, num_mem_blocks=1, hybrid_layer_ids=[1],
                   layer_types=["mamba", "hybrid"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # else no layer has experts
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0)),
    "glm5_next_text": dict(linear_num_heads=4, linear_head_dim=16),  # 64 x 128 linear-attention heads otherwise
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # the defaults are None
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=8, num_hidden_layers=4,  # 2 shared blocks
                  layers_block_type=["linear_attention", "hybrid"] * 2),
    "bamba": dict(attn_layer_indices=[1], mamba_d_head=16, mamba_n_heads=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "mamba2": dict(num_heads=8, head_dim=16),
    "swin": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
    "swinv2": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
    "focalnet": dict(embed_dim=16, depths=[1, 1], patch_size=4),
    "convnextv2": dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "dinov3_convnext": dict(hidden_sizes=[16, 32], depths=[1, 1]),
    "regnet": dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16, groups_width=8),
    "bit": dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16, num_groups=8),
    "hgnet_v2": dict(stage_in_channels=[16, 32], stage_mid_channels=[16, 16], stage_out_channels=[32, 32],
                     stage_num_blocks=[1, 1], stage_downsample=[False, True], stage_light_block=[False, False],
                     stage_kernel_size=[3, 3], stage_numb_of_layers=[2, 2], stem_channels=[3, 16, 16],
                     hidden_sizes=[32, 32], depths=[1, 1]),
    "poolformer": dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3],
                       strides=[4, 2], padding=[2, 1]),
    "pvt": dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sequence_reduction_ratios=[2, 1],
                num_attention_heads=[1, 2], patch_sizes=[4, 2], strides=[4, 2], mlp_ratios=[2, 2]),
    "pvt_v2": dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                   num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]),
    "segformer": dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                      num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                      decoder_hidden_size=32),
    "levit": dict(hidden_sizes=[32, 48], num_attention_heads=[2, 3], depths=[1, 1], key_dim=[8, 8],
                  drop_path_rate=0, mlp_ratio=[2, 2], attention_ratio=[2, 2], patch_size=16, image_size=64),
    "mobilevit": dict(hidden_sizes=[32, 32, 32], neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64], image_size=64),
    "mobilevitv2": dict(image_size=64, width_multiplier=0.25), "efficientnet": dict(width_coefficient=0.25,
                                                                                    depth_coefficient=0.25,
                                                                                    hidden_dim=320),
    "mobilenet_v1": dict(depth_multiplier=0.25), "mobilenet_v2": dict(depth_multiplier=0.25),
    "cvt": dict(embed_dim=[16, 32], num_heads=[1, 2], depth=[1, 1], patch_sizes=[7, 3], patch_stride=[4, 2],
                patch_padding=[2, 1], stride_kv=[2, 2], cls_token=[False, True], mlp_ratio=[2.0, 2.0],
                qkv_bias=[True, True], drop_rate=[0.0, 0.0], attention_drop_rate=[0.0, 0.0],
                drop_path_rate=[0.0, 0.0], qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3],
                padding_kv=[1, 1], padding_q=[1, 1], stride_q=[1, 1]),
    "hiera": dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], image_size=[64, 64], patch_size=[7, 7],
                  patch_stride=[4, 4], patch_padding=[3, 3], masked_unit_size=[8, 8], query_stride=[2, 2],
                  num_query_pool=1),
    "swiftformer": dict(embed_dims=[16, 32], depths=[1, 1], mlp_ratio=2),
    "vitdet": dict(image_size=32, pretrain_image_size=32),
    "glpn": dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                 num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                 decoder_hidden_size=16),
    "wav2vec2": dict(conv_dim=[16, 16], conv_kernel=[4, 2], conv_stride=[3, 2], num_conv_pos_embeddings=4,
                     num_conv_pos_embedding_groups=2),
    "speech_to_text": dict(input_feat_per_channel=16, conv_channels=32, max_source_positions=64),
    "audio-spectrogram-transformer": dict(num_mel_bins=16, max_length=32, patch_size=8, frequency_stride=8,
                                          time_stride=8),
    "big_bird": dict(attention_type="original_full"), "bigbird_pegasus": dict(attention_type="original_full"),
    "longformer": dict(attention_window=4), "led": dict(attention_window=4, max_encoder_position_embeddings=64,
                                                        max_decoder_position_embeddings=64),
    "reformer": dict(), "canine": dict(downsampling_rate=2, num_hash_buckets=8, num_hash_functions=2),
    "fsmt": dict(src_vocab_size=128, tgt_vocab_size=128), "nllb-moe": dict(expert_capacity=16),
    "pegasus_x": dict(block_size=4, num_global_tokens=2), "esm": dict(vocab_size=33, pad_token_id=1, mask_token_id=2),
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=4),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
    # routed and identity ("zero-computation") experts; the default sizes are not size fields the shrink knows
    "longcat_flash": dict(ffn_hidden_size=32, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2,
                          moe_topk=2),
}
for _audio in ("hubert", "wavlm", "unispeech", "unispeech-sat", "sew", "sew-d", "data2vec-audio",
               "wav2vec2-conformer"):
    EXTRA[_audio] = EXTRA["wav2vec2"]
EXTRA["sew"] = dict(EXTRA["wav2vec2"], conv_dim=[16, 16], squeeze_factor=2)
EXTRA["sew-d"] = dict(EXTRA["sew"], position_buckets=8, max_position_embeddings=64)
EXTRA["zaya"] = dict(num_experts_per_tok=1)  # one expert a token only
EXTRA["yolos"] = dict(image_size=[32, 48], num_detection_tokens=4)  # (512, 864) by default: 7,012 tokens, 26 s
EXTRA["vjepa2"] = dict(pred_hidden_size=64, pred_num_attention_heads=4, pred_num_hidden_layers=2,  # its predictor
                      frames_per_clip=8)  # 64 frames by default: 512 tokens a clip at 32 x 32
EXTRA["time_series_transformer"] = dict(prediction_length=4, context_length=8, num_time_features=2)  # None: no
EXTRA["informer"] = EXTRA["time_series_transformer"]  # horizon, no series to build
EXTRA["gemma3"] = dict(mm_tokens_per_image=4)  # 256 tokens pooled from the 4 x 4 patches of 32-pixel images: none
EXTRA["shieldgemma2"] = EXTRA["gemma3"]
EXTRA["t5gemma2"] = dict(  # its encoder pools images as Gemma 3 does; image ids within the shrunk vocabulary
    encoder=dict(mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126),
    image_token_index=127, boi_token_index=125, eoi_token_index=126)
# tiles of the sweep's 32-pixel images: the default grids are multiples of 336 (232 tiles of 32 pixels an image)
EXTRA["llava_next"] = dict(image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]])
EXTRA["llava_onevision"] = EXTRA["llava_next"]
EXTRA["vipllava"] = dict(vision_feature_layers=[-2, -1])  # the default reads layers 6 and -11 of 12: there are 2
EXTRA["paligemma"] = dict(projection_dim=64)  # image features projected to the text model's width
EXTRA["florence2"] = dict(vision_config=dict(projection_dim=64))
EXTRA["cohere2_vision"] = dict(alignment_intermediate_size=128)  # 36,864: one Hungarian of 18,432 units, past 500 s
EXTRA["timesfm2_5"] = dict(num_attention_heads=16, head_dim=4, context_length=128)  # fails at other head counts
EXTRA["align_vision_model"] = EXTRA["efficientnet"]  # ALIGN's EfficientNet tower: 62M parameters at 2x width
# Gemma 3n's text model: the last num_kv_shared_layers (15 of 35 by default) read earlier layers' keys and values,
# more than the shrunk depth has; 4 layers, the last two sharing, the first with its sparse (top-k) FFN activation
EXTRA["gemma3n_text"] = dict(num_hidden_layers=4, num_kv_shared_layers=2, intermediate_size=[64] * 4,
                             layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
                             activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], hidden_size_per_layer_input=8,
                             laurel_rank=4)
EXTRA["deepseek_v4"] = dict(mlp_layer_types=["hash_moe", "moe"])  # the default: 3 hash-routed layers, so no top-k one
EXTRA["kimi_linear"] = dict(num_experts_per_token=2,  # the config's own name of num_experts_per_tok
                            linear_head_dim=16, linear_num_heads=4)  # the delta-rule heads, 4096 wide by default
# text towers of multimodal-rotary models: the modeling code's default sections (for head 128) sum past head 16
for _mrope, _sections in (("qwen2_vl_text", [2, 3, 3]), ("qwen2_5_vl_text", [2, 3, 3]), ("glm4v_text", [2, 3, 3]),
                          ("glm_image_text", [2, 3, 3]), ("glm_ocr_text", [2, 3, 3]), ("glm4v_moe_text", [1, 1, 2])):
    EXTRA[_mrope] = dict(rope_parameters=dict(mrope_section=_sections))  # on top of the default's (tiny_config)
# the whole vision-language models: their text towers' sections, merged into the shrunk text_config (tiny_config)
for _whole, _text in (("qwen2_vl", "qwen2_vl_text"), ("qwen2_5_vl", "qwen2_5_vl_text"), ("glm4v", "glm4v_text"),
                      ("glm46v", "glm4v_text"), ("glmga", "glm4v_text"), ("glm_image", "glm_image_text"),
                      ("glm_ocr", "glm_ocr_text"), ("glm4v_moe", "glm4v_moe_text"), ("paddleocr_vl", "qwen2_vl_text")):
    EXTRA[_whole] = dict(text_config=EXTRA[_text])
# Types whose config the plain shrink leaves valid but inconsistent (the model then fails to build or run):
# shrunk with the repairs (:func:`repaired`) from the start
REPAIR = {"mistral4"}

# Config variants (issue 10's bar, beyond the defaults): (model_type, overrides[, heads]). Each is the shrunk default
# config with the overrides on top, built with the first of ``heads`` (default: HEADS) that fits; its floating
# buffers get noise too. Options chosen because they change the graph: biases, tied embeddings, head and KV-head
# counts, rotary layout and scaling, norms on queries and keys, parallel residuals, sliding windows, softcapping,
# multipliers, router shapes, task heads.
ROPE = {
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),  # with max_position_embeddings 8
    "yarn": dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=8),
    "llama3": dict(rope_type="llama3", factor=8.0, rope_theta=10000.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8),
    "longrope": dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=8,
                     short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[1.0 + i / 4 for i in range(8)]),
}
TOKEN_HEADS = {"seq1": ("AutoModelForSequenceClassification",), "token": ("AutoModelForTokenClassification",),
               "qa": ("AutoModelForQuestionAnswering",), "mlm": ("AutoModelForMaskedLM",), "base": ("AutoModel",)}
RESNET = dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
VARIANTS: list[tuple] = [
    # llama: the reference decoder, every switch it has
    ("llama", dict(tie_word_embeddings=True)), ("llama", dict(attention_bias=True)), ("llama", dict(mlp_bias=True)),
    ("llama", dict(head_dim=32)), ("llama", dict(num_key_value_heads=1)), ("llama", dict(num_key_value_heads=4)),
    ("llama", dict(rope_parameters=ROPE["linear"])),
    ("llama", dict(rope_parameters=ROPE["dynamic"], max_position_embeddings=8)),
    ("llama", dict(rope_parameters=ROPE["yarn"])), ("llama", dict(rope_parameters=ROPE["llama3"])),
    ("llama", dict(hidden_act="relu")), ("llama", dict(hidden_act="gelu")), ("llama", dict(hidden_act="relu2")),
    ("llama", dict(num_labels=1, pad_token_id=0), TOKEN_HEADS["seq1"]), ("llama", dict(), TOKEN_HEADS["token"]),
    ("llama", dict(), TOKEN_HEADS["qa"]), ("llama", dict(tie_word_embeddings=True), TOKEN_HEADS["base"]),
    ("mistral", dict(sliding_window=4)), ("mistral", dict(num_key_value_heads=1, head_dim=32)),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1, **SLIDING)),
    ("qwen2", dict(tie_word_embeddings=True)), ("qwen2", dict(num_labels=1, pad_token_id=0), TOKEN_HEADS["seq1"]),
    ("qwen3", dict(attention_bias=True)), ("qwen3", dict(num_key_value_heads=1)), ("qwen3", dict(head_dim=32)),
    ("qwen3", dict(use_sliding_window=True, **SLIDING)), ("qwen3", dict(rope_parameters=ROPE["yarn"])),
    ("qwen3", dict(), TOKEN_HEADS["qa"]),
    ("phi3", dict(partial_rotary_factor=0.5)), ("phi3", dict(rope_parameters=ROPE["longrope"])),
    ("phi3", dict(sliding_window=4)), ("phi3", dict(tie_word_embeddings=True)),
    # norms and scalars around attention
    ("gemma", dict(tie_word_embeddings=False)), ("gemma", dict(num_key_value_heads=1, head_dim=32)),
    ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=8, tie_word_embeddings=False)), ("gemma2", dict(sliding_window=4)),
    ("gemma2", dict(layer_types=["full_attention", "full_attention"])),
    ("gemma3_text", dict(attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    ("gemma3_text", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ("gemma3_text", dict(use_bidirectional_attention=True)), ("gemma3_text", dict(tie_word_embeddings=False)),
    ("olmo", dict(clip_qkv=0.05)), ("olmo", dict(attention_bias=True)),
    ("olmo2", dict(tie_word_embeddings=True)), ("olmo2", dict(attention_bias=True)),
    ("olmo2", dict(num_key_value_heads=1)), ("olmo3", dict(sliding_window=4)),
    ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                     logits_scaling=8.0)),
    ("granite", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    ("granitemoe", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                        logits_scaling=8.0)),
    ("cohere", dict(use_qk_norm=True)), ("cohere", dict(tie_word_embeddings=False, attention_bias=True)),
    ("cohere2", dict(sliding_window=4)),
    ("nemotron", dict(num_key_value_heads=2, partial_rotary_factor=1.0)),
    ("nemotron", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    ("exaone4", dict(sliding_window=4)), ("smollm3", dict(no_rope_layers=[1, 0])),
    ("smollm3", dict(use_sliding_window=True, sliding_window=4)),
    ("llama4_text", dict(use_qk_norm=False)), ("llama4_text", dict(no_rope_layers=[1, 0])),
    ("llama4_text", dict(attn_temperature_tuning=False, interleave_moe_layer_step=2)),
    # partial rotary, interleaved rotary, parallel residual, norms on queries and keys
    ("stablelm", dict(use_qkv_bias=True)), ("stablelm", dict(qk_layernorm=True)),
    ("stablelm", dict(use_parallel_residual=True)), ("stablelm", dict(partial_rotary_factor=0.5)),
    ("stablelm", dict(partial_rotary_factor=1.0)),
    ("gpt_neox", dict(use_parallel_residual=False)), ("gpt_neox", dict(attention_bias=False)),
    ("gpt_neox", dict(partial_rotary_factor=1.0)), ("gpt_neox", dict(tie_word_embeddings=True)),
    ("gpt_neox", dict(num_labels=1, pad_token_id=0), TOKEN_HEADS["seq1"]), ("gpt_neox", dict(), TOKEN_HEADS["token"]),
    ("phi", dict(qk_layernorm=True)), ("phi", dict(partial_rotary_factor=1.0)),
    ("phi", dict(tie_word_embeddings=True)),
    ("persimmon", dict(qk_layernorm=False)), ("persimmon", dict(partial_rotary_factor=1.0)),
    ("gptj", dict(rotary_dim=None)), ("gptj", dict(rotary_dim=4)), ("codegen", dict(rotary_dim=16)),
    ("gpt_neox_japanese", dict(partial_rotary_factor=0.5)),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)), ("falcon", dict(alibi=True)),
    ("falcon", dict(parallel_attn=False, bias=True)), ("falcon", dict(multi_query=False)),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1)),
    ("bloom", dict(apply_residual_connection_post_layernorm=True)), ("bloom", dict(), TOKEN_HEADS["token"]),
    # learned positions, post-LN, projections, ALiBi
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)),
    ("gpt2", dict(activation_function="relu")), ("gpt2", dict(tie_word_embeddings=False)),
    ("gpt2", dict(num_labels=1, pad_token_id=0), TOKEN_HEADS["seq1"]), ("gpt2", dict(), TOKEN_HEADS["token"]),
    ("gpt2", dict(), TOKEN_HEADS["qa"]), ("gpt2", dict(add_cross_attention=True)),
    ("gpt_bigcode", dict(multi_query=False)), ("gpt_bigcode", dict(scale_attn_weights=False)),
    ("opt", dict(do_layer_norm_before=False)), ("opt", dict(word_embed_proj_dim=32)),
    ("opt", dict(enable_bias=False)), ("opt", dict(layer_norm_elementwise_affine=False)),
    ("opt", dict(_remove_final_layer_norm=True)),
    ("mpt", dict(no_bias=False)), ("mpt", dict(logit_scale=2.0)), ("mpt", dict(tie_word_embeddings=False)),
    ("xglm", dict(scale_embedding=False)), ("biogpt", dict(scale_embedding=False)),
    # mixtures of experts
    ("mixtral", dict(num_key_value_heads=1)), ("mixtral", dict(sliding_window=4)),
    ("qwen2_moe", dict(decoder_sparse_step=2)), ("qwen2_moe", dict(mlp_only_layers=[0])),
    ("qwen2_moe", dict(norm_topk_prob=True)), ("qwen2_moe", dict(qkv_bias=False)),
    ("qwen3_moe", dict(norm_topk_prob=True)), ("qwen3_moe", dict(decoder_sparse_step=2)),
    ("qwen3_moe", dict(mlp_only_layers=[1])),
    ("olmoe", dict(norm_topk_prob=True)), ("olmoe", dict(clip_qkv=0.05)),
    ("longcat_flash", dict(zero_expert_num=0)), ("longcat_flash", dict(routed_scaling_factor=6.0, moe_topk=3)),
    ("deepseek_v3", dict(n_group=2, topk_group=1)), ("deepseek_v3", dict(q_lora_rank=None)),
    ("deepseek_v3", dict(rope_interleave=False)), ("deepseek_v3", dict(first_k_dense_replace=0)),
    ("deepseek_v3", dict(norm_topk_prob=False, routed_scaling_factor=2.5)),
    ("deepseek_v2", dict(num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    ("deepseek_v2", dict(num_experts_per_tok=2, q_lora_rank=None)),
    ("deepseek_v2", dict(num_experts_per_tok=2, first_k_dense_replace=1)),
    ("glm4_moe", dict(use_qk_norm=True)), ("glm4_moe", dict(n_group=2, topk_group=1)),
    ("glm4_moe", dict(first_k_dense_replace=0)), ("glm4_moe", dict(partial_rotary_factor=1.0)),
    ("ernie4_5_moe", dict(moe_layer_interval=2)), ("ernie4_5_moe", dict(use_bias=True)),
    ("ernie4_5_moe", dict(moe_num_shared_experts=0)),
    ("phimoe", dict(lm_head_bias=True, attention_bias=True)), ("granitemoeshared", dict(tie_word_embeddings=True)),
    ("flex_olmo", dict(norm_topk_prob=True)), ("minimax", dict(layer_types=["full_attention", "linear_attention"])),
    ("dbrx", dict(attn_config=dict(clip_qkv=0.05, kv_n_heads=2, rope_theta=10000.0))),
    # encoders
    ("bert", dict(), TOKEN_HEADS["token"]), ("bert", dict(), TOKEN_HEADS["qa"]),
    ("bert", dict(num_labels=1), TOKEN_HEADS["seq1"]), ("bert", dict(tie_word_embeddings=False), TOKEN_HEADS["mlm"]),
    ("bert", dict(is_decoder=True), ("AutoModelForCausalLM",)), ("bert", dict(hidden_act="relu")),
    ("bert", dict(type_vocab_size=1), TOKEN_HEADS["base"]),
    ("roberta", dict(), TOKEN_HEADS["token"]), ("roberta", dict(is_decoder=True), ("AutoModelForCausalLM",)),
    ("roberta-prelayernorm", dict(), TOKEN_HEADS["qa"]),
    ("electra", dict(embedding_size=32)), ("electra", dict(embedding_size=32), TOKEN_HEADS["mlm"]),
    ("albert", dict(embedding_size=32)), ("albert", dict(num_hidden_groups=2)), ("albert", dict(inner_group_num=2)),
    ("distilbert", dict(sinusoidal_pos_embds=True)), ("distilbert", dict(activation="relu")),
    ("distilbert", dict(), TOKEN_HEADS["qa"]),
    ("deberta-v2", dict(relative_attention=True, pos_att_type=["c2p"], max_relative_positions=16)),
    ("deberta-v2", dict(relative_attention=True, pos_att_type=["p2c"], max_relative_positions=16)),
    ("deberta-v2", dict(relative_attention=True, pos_att_type=["c2p", "p2c"], share_att_key=False,
                        position_buckets=8, max_relative_positions=16)),
    ("deberta-v2", dict(relative_attention=True, pos_att_type=["c2p", "p2c"], norm_rel_ebd="layer_norm",
                        position_biased_input=False, max_relative_positions=16)),
    ("deberta-v2", dict(conv_kernel_size=3, conv_act="gelu")),
    ("deberta", dict(relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16)),
    ("mobilebert", dict(use_bottleneck=False)), ("mobilebert", dict(normalization_type="layer_norm")),
    ("mobilebert", dict(key_query_shared_bottleneck=False)), ("mobilebert", dict(trigram_input=False)),
    ("roformer", dict(rotary_value=True)), ("roformer", dict(embedding_size=32)),
    ("modernbert", dict(layer_types=["sliding_attention", "full_attention"], local_attention=4)),
    ("modernbert", dict(local_attention=4)),
    ("modernbert", dict(attention_bias=True, mlp_bias=True, norm_bias=True)),
    ("modernbert", dict(), TOKEN_HEADS["token"]),
    ("esm", dict(position_embedding_type="rotary")), ("esm", dict(emb_layer_norm_before=True)),
    ("megatron-bert", dict(), TOKEN_HEADS["token"]), ("xlm-roberta-xl", dict(), TOKEN_HEADS["qa"]),
    ("funnel", dict(separate_cls=False)), ("funnel", dict(attention_type="factorized")),
    # encoder-decoders and vision
    ("t5", dict(feed_forward_proj="gated-gelu")), ("t5", dict(tie_word_embeddings=False)),
    ("t5", dict(feed_forward_proj="gated-relu")), ("mt5", dict(tie_word_embeddings=True)),
    ("bart", dict(scale_embedding=True)), ("bart", dict(activation_function="relu")),
    ("bart", dict(), TOKEN_HEADS["qa"]),
    ("mbart", dict(scale_embedding=False)),
    ("vit", dict(qkv_bias=False)), ("vit", dict(hidden_act="relu")), ("vit", dict(), TOKEN_HEADS["base"]),
    ("deit", dict(qkv_bias=False)), ("dinov2", dict(use_swiglu_ffn=True)), ("dinov2", dict(layerscale_value=0.5)),
    ("clip", dict(projection_dim=16)), ("siglip", dict()),
    # head sizes away from hidden / heads, and cross-attention left unused
    ("llama", dict(head_dim=8)), ("gemma2", dict(num_key_value_heads=1, head_dim=32)),
    ("qwen3_moe", dict(num_key_value_heads=1)), ("olmo2", dict(num_key_value_heads=4, head_dim=8)),
    ("bert", dict(is_decoder=True, add_cross_attention=True), ("AutoModelForCausalLM",)),
    ("t5", dict(d_kv=8)), ("bart", dict(encoder_attention_heads=2, decoder_attention_heads=8)),
    # batch norms with running statistics away from 0 and 1 (the buffers get noise in every variant)
    ("resnet", dict(RESNET, layer_type="basic")),
    ("resnet", dict(RESNET, layer_type="bottleneck", downsample_in_bottleneck=True)),
    ("resnet", RESNET, TOKEN_HEADS["base"]), ("regnet", dict()), ("mobilenet_v1", dict()), ("mobilenet_v2", dict()),
    ("mobilevit", dict()), ("swiftformer", dict()), ("hgnet_v2", dict()),
]

def variant_heads(variant: tuple) -> tuple[str, ...]:
    return variant[2] if len(variant) > 2 else HEADS


def variant_name(variant: tuple) -> str:
    """``model_type key=value ...`` (values as compact JSON), then ``@Head`` where the variant names its heads."""
    parts = [variant[0]] + [f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in variant[1].items()]
    if len(variant) > 2:
        parts.append("@" + (variant[2][0].removeprefix("AutoModelFor").removeprefix("AutoModel") or "base"))
    return " ".join(parts)


VARIANT_BY_NAME = {variant_name(v): v for v in VARIANTS}
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                  "cls_token_id", "mask_token_id", "unk_token_id")
IMAGE_TOKENS = ("image_token_index", "image_token_id", "boi_token_index", "eoi_token_index")
HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
         "AutoModelForImageClassification", "AutoModelForAudioClassification", "AutoModel")
# (batch, length, padding mask): none is the traced (2, 7); lengths 1 and 2 catch one-token paths and cuts that
# cross into learned tokens only there
SHAPES = ((1, 5, False), (3, 11, True), (1, 19, False), (2, 1, False), (2, 2, False))
DRAWS = 2  # random elements per group, none the identity
TOLERANCE = 1e-5  # relative; float64 end to end gives ~1e-15, HF's fp32 upcasts ~1e-7, a wrong group >= 1e-3
# Each model is checked against its own floor (Checker._floor: the output change of a one-rounding move of every
# state entry, with the model's float32 casts kept in float64 where it runs alike): FLOOR_FACTOR floors, never
# looser than TOLERANCE nor tighter than TOLERANCE_MIN
FLOOR_DRAWS = 2
FLOOR_FACTOR = 1e4
TOLERANCE_MIN = 1e-12


# -- building a tiny model -----------------------------------------------------------------------------------
def shrunk(fields: dict, model_type: str, repair: bool = False, widths: set[int] | None = None) -> dict:
    """The size fields a config dict holds, replaced by their tiny values (sub-config dicts too). With ``repair``,
    the fields that must agree with them too (:func:`repaired`); ``widths``: the widths of the whole config."""
    widths = all_widths(fields) if widths is None else widths
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = {**value, **shrunk(value, value.get("model_type", model_type), repair, widths)}
        elif key in SHRINK and (isinstance(value, int) or value is None and key in ("q_lora_rank", "head_dim")):
            out[key] = SHRINK[key]
    vocab = out.get("vocab_size", fields.get("vocab_size"))
    for key in SPECIAL_TOKENS:  # special ids must fit the tiny vocabulary
        if isinstance(fields.get(key), int) and isinstance(vocab, int) and fields[key] >= vocab:
            out[key] = min(3 + SPECIAL_TOKENS.index(key), vocab - 1)
    text = out.get("text_config")  # a vision-language model's image tokens: ids of its text model's vocabulary
    text_vocab = text.get("vocab_size") if isinstance(text, dict) and vocab is None else None
    for index, key in enumerate(IMAGE_TOKENS):
        if isinstance(fields.get(key), int) and isinstance(text_vocab, int) and fields[key] >= text_vocab:
            out[key] = text_vocab - 1 - index
    if fields.get("num_experts_per_tok", 0) is None and any(isinstance(out.get(k), int) for k in EXPERT_COUNTS):
        out["num_experts_per_tok"] = SHRINK["num_experts_per_tok"]  # routed experts need a top-k (DeepSeek-V2)
    if isinstance(fields.get("rotary_dim"), int):  # the same fraction of the shrunk head (GPT-J, CodeGen)
        old, new = head_size(fields), head_size({**fields, **out})
        if old and new:
            out["rotary_dim"] = max(2, fields["rotary_dim"] * new // old // 2 * 2)
    if "kv_lora_rank" in fields:  # multi-head latent attention: as many key heads as query heads, rotary head dim
        out.update(num_key_value_heads=SHRINK["num_attention_heads"], head_dim=SHRINK["qk_rope_head_dim"])
    if "layer_types" in fields and isinstance(fields["layer_types"], list):
        out["layer_types"] = fields["layer_types"][:2]
    return {**out, **repaired(fields, out, widths)} if repair else out


def repaired(fields: dict, out: dict, widths: set[int]) -> dict:
    """The fields a shrunk config dict ``out`` of ``fields`` must change besides its size fields, for configs the
    plain shrink breaks (:func:`tiny_config`): lists and ``per_layer_config`` entries with one entry per layer,
    fields copying a width, rotary sections. Kept apart so that the configs of types the plain shrink builds stay
    as they were swept."""
    out = {**out, **per_layer(fields, out), **backbone_outputs(fields, out)}
    out.update({k: SHRINK["vocab_size"] for k, v in fields.items()  # Gemma 4's per-layer input vocabulary
                if k.startswith("vocab_size") and k not in out and isinstance(v, int) and v > SHRINK["vocab_size"]})
    out.update({k: 0 for k in out if k in SHRINK and fields.get(k) == 0})  # 0 is "none" (GLM-5's NoPE rotary dim)
    mla = [fields.get(k) for k in ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")]
    if all(isinstance(v, int) for v in mla) and mla[0] == mla[1] + mla[2]:  # the rotary part stays qk_rope_head_dim
        out["head_dim"] = out.get("qk_nope_head_dim", mla[1]) + out.get("qk_rope_head_dim", mla[2])  # (Mistral 4)
    heads = next((k for k in HEAD_COUNTS if isinstance(fields.get(k), int)), None)
    if heads and fields.get("num_key_value_heads") == fields[heads] and heads in out:
        out["num_key_value_heads"] = out[heads]  # multi-head attention stays so (ESM C's validator)
    return {**out, **copied_widths(fields, out, widths), **rope_sections(fields, out)}


def backbone_outputs(fields: dict, out: dict) -> dict:
    """A backbone's output stages (``out_indices``, named by ``out_features``) moved to the last of the shrunk
    stages, with as many stages as outputs (up to 4): a DPT neck reads 4 (Depth Anything, ViTMatte, ViTPose)."""
    indices = fields.get("out_indices")
    key = next((k for k in LAYER_COUNTS if isinstance(out.get(k), int)), None)
    if not (key and isinstance(indices, list) and indices and all(isinstance(i, int) and i > 0 for i in indices)
            and isinstance(fields.get("stage_names"), list)):
        return {}
    depth = max(out[key], min(len(indices), 4))
    kept = list(range(depth + 1 - min(len(indices), depth), depth + 1))
    return {key: depth, "out_indices": kept, "out_features": [f"stage{i}" for i in kept]}


def per_layer(fields: dict, out: dict) -> dict:
    """Lists with one entry per layer (layer and MLP kinds, per-layer sizes, KV source layers) and the layers of
    ``per_layer_config`` cut to the shrunk depth: the first layers, and the first of each kind the first ones lack
    (validators want a full-attention layer among linear ones, a dense MLP among sparse ones), up to 4 layers."""
    key = next((k for k in LAYER_COUNTS if isinstance(fields.get(k), int) and isinstance(out.get(k), int)), None)
    if key is None or fields[key] <= out[key]:
        return {}
    old, new = fields[key], out[key]
    lists = {k: v for k, v in fields.items() if isinstance(v, list) and len(v) == old}
    overrides = fields.get("per_layer_config") if isinstance(fields.get("per_layer_config"), dict) else {}
    if not lists and not overrides:
        return {}
    kinds = {v.index(x) for v in lists.values() if len(set(map(str, v))) <= old // 2 for x in v}
    kinds |= {min(int(k) for k in overrides)} if overrides else set()
    layers = sorted(set(range(new)) | kinds)
    for spare in reversed(range(new)):  # the first layers make way for the kinds
        if len(layers) > new and spare not in kinds:
            layers.remove(spare)
    layers = layers[:4]
    index = {old_layer: i for i, old_layer in enumerate(layers)}
    cut = {k: list(range(len(layers))) if v == list(range(old)) else [v[i] for i in layers] for k, v in lists.items()}
    cut[key] = len(layers)
    cut.update({k: [SHRINK[k]] * len(layers) for k, v in lists.items() if k in SHRINK})  # per-layer sizes (Gemma 3n)
    if overrides:  # per-layer sizes shrink by the ratio of the layer's to the default size
        cut["per_layer_config"] = {index[int(k)]: {f: scaled(f, v, fields, out) for f, v in fields_.items()}
                                   for k, fields_ in overrides.items() if int(k) in index}
    return cut


def all_widths(fields: dict) -> set[int]:
    """The widths a config dict and its sub-config dicts hold."""
    found = {v for k, v in fields.items() if k in WIDTHS and isinstance(v, int) and not isinstance(v, bool)}
    return found.union(*(all_widths(v) for v in fields.values() if isinstance(v, dict)))


def copied_widths(fields: dict, out: dict, widths: set[int]) -> dict:
    """Fields that repeat a width of the config (a vision tower's output size for the text width, a head's input
    width, a codebook as wide as the model): the shrunk width, as validators of composite configs want."""
    return {k: SHRINK["hidden_size"] for k, v in fields.items()
            if k not in out and k not in SHRINK and isinstance(v, int) and not isinstance(v, bool) and v in widths
            and v >= 256 and "head" not in k and ("hidden" in k or k.endswith(("_dim", "_input_size")))}


def rope_sections(fields: dict, out: dict) -> dict:
    """Multimodal rotary sections (``mrope_section``) in proportion to the shrunk rotary head: they must sum to
    half of it (Qwen2-VL, GLM-4V, Cosmos3)."""
    head = "qk_rope_head_dim" if isinstance(fields.get("qk_rope_head_dim"), int) else None
    old = fields[head] if head else head_size(fields)
    new = out.get(head, old) if head else head_size({**fields, **out})
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = fields.get(key)
        sections = rope.get("mrope_section") if isinstance(rope, dict) else None
        if not (isinstance(sections, list) and old and new and old != new):
            continue
        cut = [max(1, s * new // old) for s in sections]
        cut[0] += max(0, sum(sections) * new // old - sum(cut))
        found[key] = {**rope, "mrope_section": cut}
    return found


def scaled(key: str, value, fields: dict, out: dict):
    """A per-layer ``value`` of ``key`` in proportion to the shrunk default (Gemma 4's global head_dim 2x)."""
    if isinstance(value, int) and isinstance(fields.get(key), int) and isinstance(out.get(key), int) and fields[key]:
        return max(1, round(out[key] * value / fields[key]))
    return value


def head_size(fields: dict) -> int | None:
    """The attention head size a config dict implies: its ``head_dim``, else its width over its head count."""
    if isinstance(fields.get("head_dim"), int):
        return fields["head_dim"]
    width = next((fields[k] for k in WIDTHS if isinstance(fields.get(k), int)), None)
    heads = next((fields[k] for k in HEAD_COUNTS if isinstance(fields.get(k), int)), None)
    return width // heads if width and heads else None


def tiny_config(model_type: str, overrides: dict | None = None):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = cls().to_dict()
    extra = {**EXTRA.get(model_type, {}), **(overrides or {})}
    if isinstance(extra.get("rope_parameters"), dict) and "mrope_section" in extra["rope_parameters"]:
        extra["rope_parameters"] = {**fields.get("rope_parameters", {}), **extra["rope_parameters"]}
    if model_type not in REPAIR:
        try:
            return cls(**merged(shrunk(fields, model_type), extra))
        except Exception:  # noqa: BLE001 -- a validator the plain shrink fails: shrink again, repairing
            pass
    return cls(**merged(shrunk(fields, model_type, repair=True), extra))


def merged(fields: dict, extra: dict) -> dict:
    """``fields`` with ``extra`` on top, dicts merged key by key (a text tower's ``rope_parameters`` sections on
    top of its shrunk default's, inside a whole model's ``text_config``)."""
    out = dict(fields)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build(model_type: str, overrides: dict | None = None, heads: tuple[str, ...] = HEADS, seed: int = 0):
    """The tiny model with the first Auto class of ``heads`` that builds it (none does, and ``heads`` has the bare
    ``AutoModel``: the config's own model class), initialised from ``seed``, noise on every parameter."""
    import transformers

    config = tiny_config(model_type, overrides)
    config.architectures = config.architectures or []  # Auto classes with two candidates (DeiT) iterate it
    for head in heads:
        auto = getattr(transformers, head)
        if type(config) in auto._model_mapping:
            model = from_config(auto, config, seed)
            perturb(model)
            return model.eval(), head
    own = own_model_class(type(config)) if "AutoModel" in heads else None
    if own is None:
        raise LookupError(f"no Auto class of {', '.join(heads)} builds {type(config).__name__}")
    model = from_config(own, config, seed)  # a tower's config no Auto class maps (SiglipTextConfig)
    perturb(model)
    return model.eval(), own.__name__


def own_model_class(config_class):
    """The bare model class of a config no Auto class maps (a text or vision tower: ``SiglipTextModel``), found in
    its model module as the one class ``<Prefix>Model`` whose ``config_class`` it is; None where there is none."""
    import importlib
    import inspect

    import transformers

    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    found = [cls for name, cls in inspect.getmembers(module, inspect.isclass)
             if name.endswith("Model") and not name.endswith("PreTrainedModel")
             and issubclass(cls, transformers.PreTrainedModel)
             and getattr(cls, "config_class", None) is config_class]
    return found[0] if len(found) == 1 else None


def from_config(auto, config, seed: int):
    """``auto``'s model of ``config`` (an Auto class, or a model class) initialised from ``seed``, with SDPA
    attention where it has it."""
    import torch

    make = getattr(auto, "from_config", None) or auto._from_config
    torch.manual_seed(seed)
    try:
        return make(copy.deepcopy(config), attn_implementation="sdpa")
    except (ValueError, ImportError):
        torch.manual_seed(seed)
        return make(copy.deepcopy(config), attn_implementation="eager")


def perturb(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_((0.02 if p.dim() >= 2 else 0.1) * torch.randn(p.shape, generator=generator).to(p.dtype))


def perturb_buffers(model) -> list[str]:
    """Noise on every floating buffer the state dict holds (a router's score-correction bias, running
    statistics), so a group that moves a weight but forgets its buffer shows; the names perturbed."""
    import torch

    generator = torch.Generator().manual_seed(2)
    names = []
    with torch.no_grad():
        for name, b in model.state_dict(keep_vars=True).items():
            if b.is_floating_point() and not isinstance(b, torch.nn.Parameter) and b.numel():
                b.add_(0.1 * torch.rand(b.shape, generator=generator).to(b.dtype))  # >= 0: variances stay positive
                names.append(name)
    return names


# -- the independent check -----------------------------------------------------------------------------------
def shaped_inputs(model, batch: int, length: int, pad: bool) -> dict:
    import inspect

    import torch

    from symgraph.inputs import forward_kwargs, model_example_inputs, optional_inputs

    params = inspect.signature(model.forward).parameters
    inputs = model_example_inputs(model, model.config, batch=batch, seq=length, seed=length, dtype=torch.float64)
    # the optional inputs that read parameters only when given (token_type_ids, encoder_hidden_states), wherever
    # forward takes them and the model runs with them: a group that holds without them may not hold with them
    extra = optional_inputs(model.config, params, inputs, seed=length, dtype=torch.float64)
    if extra and _runs_with(model, {**inputs, **extra, **forward_kwargs(model.config)}):
        inputs.update(extra)
    if pad and "input_ids" in inputs and "attention_mask" in params:
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, length - length // 3:] = 0  # the first row's last third is padding
        inputs["attention_mask"] = mask
    return {**inputs, **forward_kwargs(model.config)}


def _runs_with(model, kwargs) -> bool:
    """Whether ``model`` runs on ``kwargs`` (GPT-2 refuses encoder states where it has no cross-attention)."""
    import torch

    try:
        with torch.no_grad():
            model(**kwargs)
    except Exception:  # noqa: BLE001 -- any refusal means the input is not one this model takes
        return False
    return True


class Checker:
    """The model in float64 (reference experts loop), its outputs at every sweep shape, and a comparison.

    ``inputs_at(model, batch, length, pad)`` builds the keyword inputs at one sweep shape (default: from the
    Hugging Face config, :func:`shaped_inputs`)."""

    def __init__(self, model, inputs_at=None):
        import torch

        from symgraph.moe import REFERENCE, use_experts_implementation

        self.model = use_experts_implementation(copy.deepcopy(model), REFERENCE).to(torch.float64).eval()
        self.state = {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items()}
        self.tied = tied_names(self.model)
        self.forced = False
        self.inputs, self.refs, self.rejected = self._shapes(inputs_at)
        if self.inputs:
            self.forced = self._force_float64()
        else:  # code whose float32 casts meet float64 weights (Inkling 2's router): keep them float64
            self.forced = True
            inputs, refs, rejected = self._shapes(inputs_at)
            self.forced = bool(inputs)
            if inputs:
                self.inputs, self.refs, self.rejected = inputs, refs, rejected
        self.floor = self._floor() if self.inputs else None
        self.tolerance = tolerance_for(self.floor)

    def _shapes(self, inputs_at):
        """The sweep shapes this model runs at, their reference outputs, and why the others were rejected."""
        import torch

        inputs, refs, rejected = [], [], []
        for batch, length, pad in SHAPES:
            kwargs = (inputs_at or shaped_inputs)(self.model, batch, length, pad)
            try:
                ref = self.run(self.state, kwargs)
            except Exception as exc:  # noqa: BLE001 -- a shape this model does not take
                rejected.append(f"{batch}x{length}{' padded' if pad else ''}: {first_line(exc)}")
                continue
            if not bool(ref.isfinite().all()):
                rejected.append(f"{batch}x{length}: non-finite outputs")
                continue
            if not torch.equal(ref, self.run(self.state, kwargs)):  # ViT-MAE masks at random on every call
                rejected.append(f"{batch}x{length}: outputs differ between two identical calls")
                continue
            inputs.append((batch, length, pad, kwargs))
            refs.append(ref)
        return inputs, refs, rejected

    def _force_float64(self) -> bool:
        """Keep the casts to float32 the model's code makes (an RMSNorm or softmax upcast) in float64 from now on,
        when the model still runs alike that way (a relative change within the float32 rounding of the casts)."""
        import torch

        self.forced = True
        try:
            refs = [self.run(self.state, kw) for _, _, _, kw in self.inputs]
        except Exception:  # noqa: BLE001 -- code that needs its float32 (a complex op of one dtype): keep the casts
            refs = None
        if refs is None or not all(bool(r.isfinite().all()) and r.shape == old.shape and
                                   float((r - old).norm() / old.norm().clamp_min(1e-30)) < 1e-4
                                   for r, old in zip(refs, self.refs)):
            return False
        self.refs = refs
        return True

    def _floor(self) -> float:
        """The model's own floating-point floor: the worst relative output change when every floating state entry
        moves by one rounding (a relative 2**-52, random sign), the size of the rounding any group element makes."""
        import torch

        generator = torch.Generator().manual_seed(3)
        floors = []
        for _ in range(FLOOR_DRAWS):
            state = {k: torch.where(v.isfinite(), v * (1 + 2.0 ** -52 * torch.randn(
                v.shape, generator=generator, dtype=v.dtype)), v) if v.is_floating_point() else v
                     for k, v in self.state.items()}
            floors.append(self.error(state))
        return max(floors)

    def run(self, state, kwargs):
        import contextlib

        import torch
        from torch.utils._pytree import tree_flatten

        from symgraph.verify import Float64Casts

        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # constants built in the default dtype (XGLM) fit float64 values
        try:
            with torch.no_grad(), Float64Casts() if self.forced else contextlib.nullcontext():
                out = torch.func.functional_call(self.model, state, (), kwargs, tie_weights=False)
        finally:
            torch.set_default_dtype(previous)
        leaves = tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)[0]
        return torch.cat([t.reshape(-1).double() for t in leaves if hasattr(t, "is_floating_point")
                          and t.is_floating_point()])

    def error(self, state) -> float:
        """Worst relative output change over the sweep shapes."""
        import torch

        state = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()}
        for names in self.tied:
            changed = [n for n in names if state[n] is not self.state[n]]
            for n in names:
                state[n] = state[changed[0] if changed else names[0]]
        return max(float((self.run(state, kw) - ref).norm() / ref.norm().clamp_min(1e-30))
                   for (_, _, _, kw), ref in zip(self.inputs, self.refs))


def tolerance_for(floor: float | None) -> float:
    """The relative output change a group may make on a model whose floor is ``floor``: FLOOR_FACTOR floors,
    between TOLERANCE_MIN and TOLERANCE."""
    return TOLERANCE if floor is None else min(TOLERANCE, max(TOLERANCE_MIN, FLOOR_FACTOR * floor))


def tied_names(model) -> list[list[str]]:
    groups: dict = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.numel():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def sweep_one(model_type: str, variant: tuple | None = None) -> dict:
    """One row: ``model_type`` at its shrunk default config, or ``variant`` (an entry of :data:`VARIANTS`) with
    its overrides, its heads, and noise on the buffers too."""
    import symgraph
    from symgraph.errors import SymgraphError

    row = {"type": model_type, "named": model_type in NAMED}
    if variant:
        row.update(variant=variant_name(variant), overrides=variant[1])
    clock = time.perf_counter()
    try:
        model, head = build(model_type, *((variant[1], variant_heads(variant)) if variant else ()))
        row.update(head=head, params=sum(p.numel() for p in model.parameters()))
        if variant:
            row["buffers_perturbed"] = perturb_buffers(model)
        checker = Checker(model)
    except Exception as exc:  # noqa: BLE001 -- transformers could not build or run the tiny model
        return {**row, "class": "skipped", "reason": first_line(exc)}
    if not checker.inputs:
        return {**row, "class": "skipped", "reason": "runs at no sweep shape: " + "; ".join(checker.rejected)}
    row["shapes"] = [f"{b}x{n}{' padded' if p else ''}" for b, n, p, _ in checker.inputs]
    row["rejected_shapes"] = checker.rejected
    try:
        subject = symgraph.load(model)
        groups = subject.report.groups
    except SymgraphError as exc:
        return {**row, "class": "unsupported", "reason": first_line(exc), "seconds": elapsed(clock)}
    except Exception as exc:  # noqa: BLE001
        return {**row, "class": "crash", "reason": first_line(exc), "where": last_frame(exc),
                "seconds": elapsed(clock)}
    row["report_seconds"] = elapsed(clock)
    return {**row, **judged(subject, checker, clock)}


def judged(subject, checker: Checker, clock: float) -> dict:
    """The row fields of the independent check: the groups, the worst error, and the class."""
    import numpy as np

    import symgraph
    from symgraph.elements import apply
    from symgraph.errors import InvarianceError

    groups = subject.report.groups
    row = {"groups": dict(Counter(f"{g.motif}/{g.kind}" for g in groups)),
           "unknown_ops": sorted(subject.report.unknown_ops)[:10],
           "float64_casts": checker.forced, "floor": checker.floor, "tolerance": checker.tolerance}
    tolerance = checker.tolerance
    rng = np.random.default_rng(0)
    bad, worst = [], 0.0
    elements = []
    for group in groups:
        draws = [non_identity(group, rng) for _ in range(DRAWS)]
        elements.append(draws[0])
        err = max(checker.error(apply(checker.state, [e])) for e in draws)
        worst = max(worst, err)
        if err > tolerance:
            bad.append(f"{group.id} {group.motif}/{group.kind} ({err:.1e})")
    if groups and not bad:
        joint = checker.error(apply(checker.state, elements))
        worst = max(worst, joint)
        if joint > tolerance:
            bad.append(f"all groups together ({joint:.1e})")
    row["max_error"] = worst
    if bad:
        return {**row, "class": "unsound", "bad_groups": bad, "seconds": elapsed(clock)}
    if groups:
        try:
            symgraph.transform(subject, seed=0)
        except InvarianceError as exc:
            return {**row, "class": "refused", "reason": first_line(exc), "seconds": elapsed(clock)}
        except Exception as exc:  # noqa: BLE001
            return {**row, "class": "crash", "reason": "transform: " + first_line(exc), "where": last_frame(exc),
                    "seconds": elapsed(clock)}
    return {**row, "class": "sound" if groups else "nothing", "seconds": elapsed(clock)}


def non_identity(group, rng):
    """A random element of ``group`` other than the identity where the group has one (a random permutation of two
    heads is the identity half the time: a check of nothing)."""
    from symgraph.elements import sample

    for _ in range(20):
        element = sample(group, rng)
        if not element.is_identity():
            break
    return element


def elapsed(clock: float) -> float:
    return round(time.perf_counter() - clock, 1)


def last_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "symgraph" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else ""


# -- driver ----------------------------------------------------------------------------------------------------
def run_isolated(model_type: str, timeout: float) -> dict:
    return run_script_isolated(__file__, model_type, timeout, {"type": model_type, "named": model_type in NAMED})


def run_variant_isolated(name: str, timeout: float) -> dict:
    variant = VARIANT_BY_NAME[name]
    identity = {"type": variant[0], "named": variant[0] in NAMED, "variant": name, "overrides": variant[1]}
    return run_script_isolated(__file__, name, timeout, identity)


def run_script_isolated(script: str, name: str, timeout: float, identity: dict, options: tuple = ()) -> dict:
    """``script --one name [options]`` in its own process: the JSON line it prints, or ``identity`` with a timeout
    or crash class and its reason."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        done = subprocess.run([sys.executable, script, "--one", name, *options], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**identity, "class": "timeout", "reason": f">{timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {**identity, "class": "crash", "reason": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def run_all(names, run, shown: tuple[str, ...], jsonl: Path | None) -> list[dict]:
    """``run(name)`` for each name, in order: a progress line of the ``shown`` fields on stderr, and each row
    appended to ``jsonl`` as soon as it is done."""
    rows = []
    for name in names:
        row = run(name)
        print(json.dumps({k: row.get(k) for k in shown}), file=sys.stderr, flush=True)
        rows.append(row)
        if jsonl:
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def report_summary(rows: list[dict], summarize, key: str, before_paths: list[Path], output: Path | None) -> None:
    """Print the summary of ``rows`` (written atomically to ``output`` as well); with ``before_paths``, as
    'before' (their rows) and 'after' (those rows updated by ``rows``, matched on ``key``)."""
    summary = summarize(rows)
    if before_paths:
        before = [json.loads(ln) for path in before_paths for ln in path.read_text().splitlines()]
        summary = {"before": summarize(before), "after": summarize(before + rows),
                   "rerun_after_fixes": sorted({r[key] for r in rows})}
    text = json.dumps(summary, indent=1)
    if output:
        write_atomically(output, text + "\n")
    print(text)


def checker_settings() -> dict:
    """The summary fields that say how rows were judged."""
    return {"tolerance": TOLERANCE, "draws_per_group": DRAWS,
            "tolerance_rule": f"per model: {FLOOR_FACTOR:g} x its floor (the relative output change of one rounding "
                              f"of every state entry, float32 casts kept in float64 where the model runs alike), "
                              f"within [{TOLERANCE_MIN:g}, {TOLERANCE:g}]"}


def largest_errors(rows: list[dict], key: str) -> dict:
    """The 5 largest errors of sound and unsound rows, and the 5 largest as multiples of their model's floor (a
    wrong group whose effect is small in a tiny model sits far above its floor even under the tolerance)."""
    measured = [r for r in rows if r.get("max_error") is not None]
    by_floor = [r for r in measured if r.get("floor")]
    return {"largest_errors": {r[key]: r["max_error"] for r in sorted(measured, key=lambda r: -r["max_error"])[:5]},
            "largest_errors_in_floors": {r[key]: round(r["max_error"] / r["floor"], 1) for r in sorted(
                by_floor, key=lambda r: -r["max_error"] / r["floor"])[:5]}}


def summarize(rows: list[dict]) -> dict:
    latest = {r["type"]: r for r in rows}
    rows = list(latest.values())
    unnamed = [r for r in rows if not r["named"] and r["class"] != "skipped"]
    counts = Counter(r["class"] for r in rows)
    counts_unnamed = Counter(r["class"] for r in unnamed)
    sound = counts_unnamed["sound"]
    return {
        **checker_settings(),
        "shapes": sorted({s for r in rows for s in r.get("shapes", [])}),
        "types": len(rows), "counts": dict(counts), "unnamed_built": len(unnamed),
        "counts_unnamed": dict(counts_unnamed),
        "unnamed_sound_nontrivial_fraction": round(sound / len(unnamed), 3) if unnamed else None,
        "unsound_groups": sum(len(r.get("bad_groups", [])) for r in rows),
        **largest_errors(rows, "type"),
        "failures": {r["type"]: {k: r[k] for k in ("class", "reason", "bad_groups", "where") if k in r}
                     for r in rows if r["class"] not in ("sound",)},
        "rows": sorted(rows, key=lambda r: r["type"]),
    }


def summarize_variants(rows: list[dict]) -> dict:
    """The variants table: how many ran (built by transformers), and of those how many were sound with groups,
    unsound, crashed (or stopped with symgraph's own error), found nothing; every row that was not sound. Rows of
    variants no longer in :data:`VARIANTS` (an entry since corrected) are left out."""
    latest = [r for r in {r["variant"]: r for r in rows}.values() if r["variant"] in VARIANT_BY_NAME]
    counts = Counter(r["class"] for r in latest)
    return {
        **checker_settings(),
        "shapes": sorted({s for r in latest for s in r.get("shapes", [])}),
        "variants": len(latest), "counts": dict(counts),
        "table": {"run": len(latest) - counts["skipped"], "sound_with_groups": counts["sound"],
                  "unsound": counts["unsound"], "refused": counts["refused"],
                  "crash": counts["crash"], "timeout": counts["timeout"], "unsupported": counts["unsupported"],
                  "nothing_found": counts["nothing"], "skipped_by_transformers": counts["skipped"]},
        "unsound_groups": sum(len(r.get("bad_groups", [])) for r in latest),
        **largest_errors(latest, "variant"),
        "failures": {r["variant"]: {k: r[k] for k in ("class", "reason", "bad_groups", "where") if k in r}
                     for r in latest if r["class"] != "sound"},
        "rows": sorted(latest, key=lambda r: r["variant"]),
    }


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.chmod(f.name, 0o644)  # a temporary file is private; the result is not
    os.replace(f.name, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one type in this process and print its JSON line")
    parser.add_argument("--types", help="comma-separated model types (default: the whole list)")
    parser.add_argument("--variants", action="store_true",
                        help="sweep the config variants (VARIANTS) instead of the default configs; --types then "
                             "keeps the variants of those types")
    parser.add_argument("--skip-done", action="store_true", help="leave out types already in --jsonl")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    parser.add_argument("--jsonl", type=Path, help="append one line per type here (accumulates across chunks)")
    parser.add_argument("--summarize", action="store_true", help="only summarize --jsonl")
    parser.add_argument("--before", type=Path, action="append", default=[],
                        help="rows of an earlier run (JSON lines; repeatable): the summary then shows it as "
                             "'before' and, as 'after', those rows updated by the rows of --jsonl")
    parser.add_argument("-o", "--output", type=Path, help="also write the summary JSON here (atomically)")
    args = parser.parse_args(argv)
    if args.one:
        import warnings

        warnings.filterwarnings("ignore")
        variant = VARIANT_BY_NAME.get(args.one)
        print(json.dumps(sweep_one(variant[0], variant) if variant else sweep_one(args.one)))
        return
    rows = [json.loads(ln) for ln in args.jsonl.read_text().splitlines()] if args.jsonl and args.jsonl.exists() else []
    key = "variant" if args.variants else "type"
    if not args.summarize:
        types = args.types.split(",") if args.types else None
        if args.variants:
            names = [n for n, v in VARIANT_BY_NAME.items() if types is None or v[0] in types]
            run = lambda name: run_variant_isolated(name, args.timeout)  # noqa: E731
        else:
            names, run = types or TYPES, lambda name: run_isolated(name, args.timeout)  # noqa: E731
        done = {r[key] for r in rows} if args.skip_done else set()
        rows += run_all([n for n in names if n not in done], run, (key, "class", "reason", "bad_groups", "seconds"),
                        args.jsonl)
    report_summary(rows, summarize_variants if args.variants else summarize, key, args.before, args.output)


if __name__ == "__main__":
    main()
