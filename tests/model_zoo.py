"""Tiny random configs of many transformers architectures, for the model-coverage tests.

Each entry is the smallest config of its family that still exercises what makes the family
different (GQA, partial rotary, sliding windows, LongRoPE, hybrid layers, ...).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

VOCAB = 128
_LLAMA_LIKE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
_GPT = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}
# Four layers, so that every per-layer pattern of the newer families (3 windowed : 1 global, NoPE every
# fourth layer, dense-then-MoE) shows; a window shorter than the long prompts.
_FOUR = {**_LLAMA_LIKE, "num_hidden_layers": 4, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1}
_WINDOWED = {**_FOUR, "sliding_window": 12}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
_LAGUNA_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
_GEMMA4 = {**_WINDOWED, "num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3,
           "global_head_dim": 16, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
           "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
           "final_logit_softcapping": 3.0}
_GEMMA4_UNIFIED = {k: v for k, v in _GEMMA4.items() if "per_layer_input" not in k}  # no per-layer inputs
_MLA = {**{k: v for k, v in _FOUR.items() if k != "head_dim"}, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8}
_MLA_MOE = {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
_MLA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
_LINEAR_FULL = ["linear_attention", "full_attention"]
_DELTA = {"layer_types": _LINEAR_FULL, "linear_num_value_heads": 4, "linear_num_key_heads": 2,  # Gated DeltaNet
          "linear_key_head_dim": 8, "linear_value_head_dim": 8}
_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5],
             "long_factor": [2.0, 3.0, 5.0, 9.0], "original_max_position_embeddings": 32}

ZOO: dict[str, tuple[type, dict]] = {
    # families the engine serves exactly
    "llama": (tf.LlamaConfig, _LLAMA_LIKE),
    "llama_stray_window": (tf.LlamaConfig, {**_LLAMA_LIKE, "sliding_window": 12}),  # a key its attention ignores
    "qwen2": (tf.Qwen2Config, _LLAMA_LIKE),
    "qwen3": (tf.Qwen3Config, {**_LLAMA_LIKE, "head_dim": 8}),
    "mistral": (tf.MistralConfig, {**_LLAMA_LIKE, "sliding_window": 12}),
    "gemma2": (tf.Gemma2Config, {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": 12,
                                 "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 12}),
    "gemma3_text": (tf.Gemma3TextConfig, {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": 12,
                                          "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (tf.Phi3Config, {**_LLAMA_LIKE, "pad_token_id": 0}),
    "phi3_longrope": (tf.Phi3Config, {**_LLAMA_LIKE, "pad_token_id": 0, "hidden_size": 64, "num_attention_heads": 8,
                                      "num_key_value_heads": 4, "max_position_embeddings": 128,
                                      "original_max_position_embeddings": 32, "rope_parameters": _LONGROPE}),
    "llama3_rope": (tf.LlamaConfig, {**_LLAMA_LIKE, "rope_parameters": _LLAMA3_ROPE}),  # Llama 3.1's scaling
    "llama_linear_rope": (tf.LlamaConfig, {**_LLAMA_LIKE, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "qwen2_yarn": (tf.Qwen2Config, {**_LLAMA_LIKE, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}),
    "olmo2": (tf.Olmo2Config, {**_LLAMA_LIKE, "pad_token_id": 0}),
    "stablelm": (tf.StableLmConfig, {**_LLAMA_LIKE, "partial_rotary_factor": 0.5}),
    "cohere": (tf.CohereConfig, {**_LLAMA_LIKE, "pad_token_id": 0}),
    "granite": (tf.GraniteConfig, {**_LLAMA_LIKE, "attention_multiplier": 0.3, "residual_multiplier": 0.7,
                                   "embedding_multiplier": 2.0, "logits_scaling": 1.5}),
    "starcoder2": (tf.Starcoder2Config, {**_LLAMA_LIKE, "sliding_window": 12}),
    "gpt2": (tf.GPT2Config, _GPT),
    "gpt_neox": (tf.GPTNeoXConfig, {**_LLAMA_LIKE, "rotary_pct": 0.5}),
    "opt": (tf.OPTConfig, {"vocab_size": VOCAB, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "max_position_embeddings": 256, "word_embed_proj_dim": 32}),
    "persimmon": (tf.PersimmonConfig, {**_LLAMA_LIKE, "num_key_value_heads": 4}),
    "gemma": (tf.GemmaConfig, {**_LLAMA_LIKE, "head_dim": 8}),
    "phi": (tf.PhiConfig, {**_LLAMA_LIKE, "partial_rotary_factor": 0.5}),
    "olmo": (tf.OlmoConfig, {**_LLAMA_LIKE, "pad_token_id": 0}),
    "mixtral": (tf.MixtralConfig, {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (tf.Qwen2MoeConfig, {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": (tf.Qwen3MoeConfig, {**_LLAMA_LIKE, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16}),
    "olmoe": (tf.OlmoeConfig, {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0}),
    # a trainer's saved config asking for the router logits of an auxiliary loss
    "qwen3_moe_router_logits": (tf.Qwen3MoeConfig, {**_LLAMA_LIKE, "head_dim": 8, "num_experts": 4,
                                                    "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                                    "output_router_logits": True}),
    "olmo3": (tf.Olmo3Config, _WINDOWED),
    "smollm3": (tf.SmolLM3Config, _FOUR),
    "glm": (tf.GlmConfig, _FOUR),
    "glm4": (tf.Glm4Config, _FOUR),
    "cohere2": (tf.Cohere2Config, _WINDOWED),
    "exaone4": (tf.Exaone4Config, _WINDOWED),
    "ernie4_5": (tf.Ernie4_5Config, {**_FOUR, "use_bias": True}),
    "seed_oss": (tf.SeedOssConfig, {**_FOUR, "attention_bias": True, "attention_out_bias": True}),
    "apertus": (tf.ApertusConfig, {**_FOUR, "rope_parameters": _LLAMA3_ROPE}),
    "arcee": (tf.ArceeConfig, _FOUR),
    "ministral": (tf.MinistralConfig, _WINDOWED),
    "ministral3": (tf.Ministral3Config, {**_FOUR, "rope_parameters": {  # YaRN and Llama 4's query scaling
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "llama_4_scaling_beta": 0.5, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "helium": (tf.HeliumConfig, _FOUR),
    "vaultgemma": (tf.VaultGemmaConfig, {**_WINDOWED, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
                                         "final_logit_softcapping": 5.0}),
    "nemotron": (tf.NemotronConfig, _FOUR),
    "hunyuan_v1_dense": (tf.HunYuanDenseV1Config, _FOUR),
    # dynamic NTK, with the longest sample (40 + 10 tokens) reaching max_position_embeddings, past which alone
    # transformers would change its frequencies; HunYuan's checkpoints label a fixed NTK alpha "dynamic"
    "llama_dynamic_rope": (tf.LlamaConfig, {**_LLAMA_LIKE, "max_position_embeddings": 50, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "hunyuan_v1_dense_alpha": (tf.HunYuanDenseV1Config, {**_FOUR, "rope_parameters": {
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}}),
    "gpt_bigcode": (tf.GPTBigCodeConfig, _GPT),
    "nanochat": (tf.NanoChatConfig, {**_FOUR, "final_logit_softcapping": 5.0}),
    "cwm": (tf.CwmConfig, {**_WINDOWED, "rope_parameters": _LLAMA3_ROPE}),
    "jais2": (tf.Jais2Config, _FOUR),
    "granitemoe": (tf.GraniteMoeConfig, {**_FOUR, "num_local_experts": 4, "num_experts_per_tok": 2,
                                         "attention_multiplier": 0.3, "residual_multiplier": 0.7,
                                         "embedding_multiplier": 2.0, "logits_scaling": 1.5}),
    "granitemoeshared": (tf.GraniteMoeSharedConfig, {**_FOUR, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                     "shared_intermediate_size": 16}),
    "phimoe": (tf.PhimoeConfig, {**_FOUR, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "hunyuan_v1_moe": (tf.HunYuanMoEV1Config, {**_FOUR, "num_experts": 4, "moe_topk": 2}),
    "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, {**_FOUR, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
                                             "moe_intermediate_size": 16, "moe_layer_start_index": 1}),
    "glm4_moe": (tf.Glm4MoeConfig, {**_FOUR, **_MOE, "n_routed_experts": 4, "n_shared_experts": 1,
                                    "first_k_dense_replace": 1, "use_qk_norm": True}),
    "flex_olmo": (tf.FlexOlmoConfig, {**_FOUR, "num_experts": 4, "num_experts_per_tok": 2}),
    "cohere2_moe": (tf.Cohere2MoeConfig, {**_WINDOWED, "num_experts": 4, "num_experts_per_tok": 2,
                                          "num_shared_experts": 1}),
    "exaone_moe": (tf.ExaoneMoeConfig, {**_WINDOWED, **_MOE, "num_experts": 4, "num_shared_experts": 1}),
    "afmoe": (tf.AfmoeConfig, {**_WINDOWED, **_MOE, "num_experts": 4, "num_shared_experts": 1,
                               "num_dense_layers": 1, "global_attn_every_n_layers": 2}),
    "solar_open": (tf.SolarOpenConfig, {**_FOUR, **_MOE, "n_routed_experts": 4, "n_shared_experts": 1}),
    "dots1": (tf.Dots1Config, {**_FOUR, **_MOE, "n_routed_experts": 4, "n_shared_experts": 1,
                               "first_k_dense_replace": 1}),
    "mellum": (tf.MellumConfig, {**_WINDOWED, **_MOE, "num_local_experts": 4, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
    "gemma3": (tf.Gemma3Config, {  # Gemma 3 4B and up: a vision tower beside the text model, served text-only
        "text_config": {**_WINDOWED, "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 4, "image_size": 28, "patch_size": 14},
        "mm_tokens_per_image": 4, "boi_token_index": 125, "eoi_token_index": 126, "image_token_index": 127}),
    # the first three are missing from older transformers (5.17 among them): None there, and their tests skip
    "exaone": (getattr(tf, "ExaoneConfig", None), _FOUR),
    "internlm3": (getattr(tf, "InternLM3Config", None), _FOUR),
    "iquestcoder": (getattr(tf, "IQuestCoderConfig", None), _FOUR),
    "hyperclovax": (tf.HyperCLOVAXConfig, {**_FOUR, "attention_multiplier": 0.3, "residual_multiplier": 0.7,
                                           "embedding_multiplier": 2.0, "logits_scaling": 1.5, "use_post_norm": True}),
    "jetmoe": (tf.JetMoeConfig, {**_FOUR, "kv_channels": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "minimax_m2": (tf.MiniMaxM2Config, {**_FOUR, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "hy_v3": (tf.HYV3Config, {**_FOUR, **_MOE, "num_experts": 4, "num_shared_experts": 1}),
    "laguna": (tf.LagunaConfig, {  # windowed and global layers with their own RoPE, heads per layer, MoE
        **_WINDOWED, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "num_attention_heads_per_layer": [4, 8, 4, 8],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "moe_router_logit_softcapping": 3.0,
        "rope_parameters": _LAGUNA_ROPE}),
    # Gemma 4: global layers with other head sizes and KV head counts than the windowed ones (K = V there),
    # the last two layers reusing earlier layers' K/V, per-layer input embeddings, final logit softcapping
    "gemma4_text": (getattr(tf, "Gemma4TextConfig", None), _GEMMA4),
    "gemma4_text_moe": (getattr(tf, "Gemma4TextConfig", None), {
        **_GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}),
    "gemma4": (getattr(tf, "Gemma4Config", None), {  # the multimodal checkpoint, served text-only
        "text_config": _GEMMA4, "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                  "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8},
        "audio_config": None, "boi_token_id": 120, "eoi_token_id": 121, "image_token_id": 122,
        "video_token_id": 123, "boa_token_id": 124, "eoa_token_index": 125, "audio_token_id": 126}),
    "gemma4_unified_text": (getattr(tf, "Gemma4UnifiedTextConfig", None), _GEMMA4_UNIFIED),
    "gemma4_unified": (getattr(tf, "Gemma4UnifiedConfig", None), {"text_config": _GEMMA4_UNIFIED}),
    # Gemma 3n: AltUp, Laurel, per-layer inputs, activation sparsity, KV sharing (the multimodal gemma3n needs timm)
    "gemma3n_text": (tf.Gemma3nTextConfig, {
        **_WINDOWED, "num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3,
        "intermediate_size": [64] * 6, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
        "laurel_rank": 4, "altup_num_inputs": 2}),
    # absent from transformers 5.17: their tests skip there
    "apertus1p5_text": (getattr(tf, "Apertus1p5TextConfig", None), _FOUR),
    "kolibri1": (getattr(tf, "Kolibri1Config", None), {
        **_WINDOWED, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "minimax_m3_vl_text": (getattr(tf, "MiniMaxM3VLTextConfig", None), {**_FOUR, "num_local_experts": 4,
                                                                       "num_experts_per_tok": 2}),
    "sarvam_moe": (getattr(tf, "SarvamMoEConfig", None), {**_FOUR, **_MOE, "n_routed_experts": 4}),
    # attention sinks (a learned logit per head in every softmax); MiMo-V2-Flash's values are narrower than its keys
    "gpt_oss": (tf.GptOssConfig, {**_WINDOWED, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "granite_swa": (tf.GraniteSWAConfig, _WINDOWED),
    "granitemoe_swa": (tf.GraniteMoeSWAConfig, {**_WINDOWED, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "mimo_v2_flash": (tf.MiMoV2FlashConfig, {
        **_WINDOWED, "head_dim": 12, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "layer_types": ["full_attention", "sliding_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}),
    "flint": (getattr(tf, "FlintConfig", None), {
        **_WINDOWED, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16, "mlp_only_layers": [0],
        "layer_types": ["full_attention", "sliding_attention"] * 2}),
    # multi-head latent attention: keys (nope + rope parts) wider than values; DeepSeek-V3 with its YaRN scaling
    "deepseek_v2": (tf.DeepseekV2Config, _MLA_MOE),
    "deepseek_v3": (tf.DeepseekV3Config, {**_MLA_MOE, "rope_parameters": _MLA_YARN}),
    "glm4_moe_lite": (tf.Glm4MoeLiteConfig, _MLA_MOE),
    "sarvam_mla": (getattr(tf, "SarvamMLAConfig", None), _MLA_MOE),
    "minicpm3": (tf.MiniCPM3Config, {**_MLA, "q_lora_rank": 16}),
    # no pad id: transformers zeroes Youtu's padding row on load, whatever the checkpoint holds there
    "youtu": (tf.YoutuConfig, {**_MLA, "q_lora_rank": 16, "pad_token_id": None}),
    "axk1": (getattr(tf, "AXK1Config", None), {**_MLA_MOE, "q_lora_rank": 16}),  # A.X K1: DeepSeek-V3's layout
    "dbrx": (tf.DbrxConfig, {"vocab_size": VOCAB, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
                             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}),
    "longcat_flash": (tf.LongcatFlashConfig, {  # MLA, and "zero" experts that return their input
        "vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "ffn_hidden_size": 64, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "head_dim": 4, "v_head_dim": 8, "qk_head_dim": 12, "moe_topk": 2, "n_routed_experts": 4, "zero_expert_num": 2,
        "expert_ffn_hidden_size": 16, "max_position_embeddings": 256, "pad_token_id": 0}),
    # linear-attention and state-space hybrids, their state kept per sequence (workers/engine/recurrent.py)
    "qwen3_next": (tf.Qwen3NextConfig, {**_LLAMA_LIKE, **_DELTA, "head_dim": 8, "num_experts": 2,
                                        "num_experts_per_tok": 1, "moe_intermediate_size": 16}),
    "qwen3_5_text": (tf.Qwen3_5TextConfig, {**_LLAMA_LIKE, **_DELTA, "head_dim": 8}),
    "qwen3_5_moe_text": (tf.Qwen3_5MoeTextConfig, {**_LLAMA_LIKE, **_DELTA, **_MOE, "head_dim": 8, "num_experts": 4,
                                                   "shared_expert_intermediate_size": 16}),
    # Qwen3.5's checkpoints: the vision-language model, served text-only
    "qwen3_5": (tf.Qwen3_5Config, {"text_config": {**_LLAMA_LIKE, **_DELTA, "head_dim": 8},
                                   "vision_config": _QWEN_VISION}),
    "qwen3_5_moe": (tf.Qwen3_5MoeConfig, {"text_config": {**_LLAMA_LIKE, **_DELTA, **_MOE, "head_dim": 8,
                                                          "num_experts": 4, "shared_expert_intermediate_size": 16},
                                          "vision_config": _QWEN_VISION}),
    "olmo_hybrid": (getattr(tf, "OlmoHybridConfig", None), {**_LLAMA_LIKE, **_DELTA, "pad_token_id": 0,
                                                             "linear_value_head_dim": 16}),
    "kimi_linear": (tf.KimiLinearConfig, {**_LLAMA_LIKE, "pad_token_id": 0, "layer_types": _LINEAR_FULL,
                                          "mlp_layer_types": ["dense", "sparse"], "num_experts": 4,
                                          "num_experts_per_token": 2, "moe_intermediate_size": 16,
                                          "linear_head_dim": 8, "linear_num_heads": 4, "num_key_value_heads": 4,
                                          "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                          "kv_lora_rank": 16, "q_lora_rank": None}),
    "lara_mini": (getattr(tf, "LaraMiniConfig", None), {
        **_WINDOWED, **_DELTA, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}),
    "bailing_hybrid": (getattr(tf, "BailingHybridConfig", None), {
        **_MLA_MOE, "layer_types": _LINEAR_FULL * 2, "layer_group_size": 2, "num_experts": 4,
        "num_experts_per_token": 2, "num_expert_group": 1, "num_nextn_predict_layers": 0}),
    "lfm2": (tf.Lfm2Config, {**_LLAMA_LIKE, "layer_types": ["conv", "full_attention"]}),
    "lfm2_moe": (tf.Lfm2MoeConfig, {**_LLAMA_LIKE, **_MOE, "layer_types": ["conv", "full_attention"],
                                    "num_experts": 4, "num_dense_layers": 1}),
    "lfm3": (getattr(tf, "Lfm3Config", None), {**_WINDOWED, "layer_types": [
        "conv", "full_attention", "conv", "sliding_attention"]}),
    "granitemoehybrid": (tf.GraniteMoeHybridConfig, {**_LLAMA_LIKE, "layer_types": ["mamba", "attention"],
                                                     "mamba_n_heads": 4, "mamba_d_head": 16,
                                                     "num_local_experts": 4, "num_experts_per_tok": 2}),
    "bamba": (tf.BambaConfig, {**_LLAMA_LIKE, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 16}),
    "falcon_h1": (tf.FalconH1Config, {**_LLAMA_LIKE, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64,
                                      "mamba_d_state": 8}),  # attention and Mamba side by side in every layer
    "nemotron_h": (tf.NemotronHConfig, {**_LLAMA_LIKE, "hybrid_override_pattern": "M*", "mamba_num_heads": 4,
                                        "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 8}),
    # Nemotron-H's published patterns hold MLP ("-") and MoE ("E") blocks between its Mamba and attention layers
    "nemotron_h_blocks": (tf.NemotronHConfig, {**_LLAMA_LIKE, "hybrid_override_pattern": "M-*E", "num_hidden_layers": 4,
                                               "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1,
                                               "ssm_state_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 16, "n_shared_experts": 1,
                                               "moe_shared_expert_intermediate_size": 16, "n_group": 1,
                                               "topk_group": 1}),
    # Mamba layers that restart from zero state at a multi-token forward: prompt chunks after the first go stepwise
    "jamba": (tf.JambaConfig, {**_LLAMA_LIKE, "num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
                               "use_mamba_kernels": False}),
    # no attention at all: the state is all there is (Mamba and Falcon-Mamba restart like Jamba)
    "mamba2": (tf.Mamba2Config, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
                                 "head_dim": 16, "state_size": 8, "n_groups": 1, "expand": 2}),
    "mamba": (tf.MambaConfig, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}),
    "falcon_mamba": (tf.FalconMambaConfig, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                            "state_size": 4}),
    # families the engine refuses, with the feature it names
    "gptj": (tf.GPTJConfig, {**_GPT, "rotary_dim": 4}),
    "falcon": (tf.FalconConfig, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "new_decoder_architecture": True, "num_kv_heads": 2,
                                 "max_position_embeddings": 256}),
    "minimax": (tf.MiniMaxConfig, {**_LLAMA_LIKE, "layer_types": ["linear_attention", "full_attention"],
                                   "num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 8}),
    "llama4_text": (tf.Llama4TextConfig, {**_LLAMA_LIKE, "head_dim": 8, "attention_chunk_size": 8,
                                          "intermediate_size_mlp": 64, "num_local_experts": 2}),
    "phimoe_mscale_rope": (tf.PhimoeConfig, {**_FOUR, "num_local_experts": 4, "num_experts_per_tok": 2,
                                             "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0, "short_mscale": 1.0,
                                                                 "long_mscale": 1.5,
                                                                 "original_max_position_embeddings": 32}}),
    "bloom": (tf.BloomConfig, {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2, "n_head": 4}),
    "mpt": (tf.MptConfig, {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 256}),
    "codegen": (tf.CodeGenConfig, {**_GPT, "rotary_dim": 4, "n_ctx": 256}),
    "xglm": (tf.XGLMConfig, {"vocab_size": VOCAB, "d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4,
                                 "max_position_embeddings": 256}),
    "falcon_alibi": (tf.FalconConfig, {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                           "num_attention_heads": 4, "alibi": True, "max_position_embeddings": 256}),
    "gpt_neo": (tf.GPTNeoConfig, {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                      "attention_types": [[["global", "local"], 1]], "window_size": 8,
                                      "max_position_embeddings": 256}),
    "recurrent_gemma": (tf.RecurrentGemmaConfig, {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "lru_width": 32, "attention_window_size": 16}),
    "doge": (tf.DogeConfig, _FOUR),
    "llama_not_causal": (tf.LlamaConfig, {**_LLAMA_LIKE, "is_causal": False}),
    # OLMoE hands a config's window to attention but masks without it
    "olmoe_stray_window": (tf.OlmoeConfig, {**_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2,
                                            "sliding_window": 6}),
    # bidirectional attention everywhere (embedding models such as EmbeddingGemma)
    "gemma3_bidirectional": (tf.Gemma3TextConfig, {**_LLAMA_LIKE, "head_dim": 8, "use_bidirectional_attention": True}),
    "gemma4_bidirectional": (getattr(tf, "Gemma4TextConfig", None), {**_GEMMA4, "use_bidirectional_attention": "all"}),
}


def zoo_model(name: str, **overrides) -> tf.PreTrainedModel:
    """A float32 model of zoo entry `name` (its config fields updated by `overrides`), as transformers initialises
    it (on the meta device within `with torch.device("meta")`); a vision-language entry with its vision tower."""
    config_class, kwargs = ZOO[name]
    kwargs = {**kwargs, **overrides}
    config = config_class(**kwargs, tie_word_embeddings=False)
    config.eos_token_id = config.get_text_config().eos_token_id = None  # no EOS: samples run to their length
    auto = tf.AutoModelForImageTextToText if "vision_config" in kwargs else tf.AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32)


def build_zoo_model(name: str, path: str | Path, seed: int = 0, **overrides) -> str:
    """Save a random-weight float32 model of zoo entry `name` (its config fields updated by `overrides`)
    into `path`; returns the path. Vectors are perturbed too, so that no zero-initialised bias or gate hides
    what it feeds. A vision-language entry is saved as its checkpoints are, vision tower included."""
    torch.manual_seed(seed)
    model = zoo_model(name, **overrides)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
            else:
                param.add_(torch.randn_like(param), alpha=0.1)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return str(path)
