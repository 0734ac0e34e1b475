"""Tiny random-weight Hugging Face models with a small tokenizer, for tests, the demo and benchmarks.

Nothing is downloaded: configs come from transformers' config classes, weights are random, and the
byte-level BPE tokenizer is trained on a few built-in sentences.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
    "gemma2": transformers.Gemma2Config,
    "qwen3_5_text": transformers.Qwen3_5TextConfig,  # linear-attention hybrid: pass its layer_types, linear_*
    "deepseek_v2": transformers.DeepseekV2Config,  # multi-head latent attention: pass kv_lora_rank, qk_*, v_head_dim
    "gpt_oss": transformers.GptOssConfig,  # sliding-window and full layers alternating, attention sinks, MoE
}

EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<s>"

_CORPUS = """The quick brown fox jumps over the lazy dog. Reinforcement learning from human feedback trains
a policy on rewards. A rollout samples several completions of each prompt, and a trainer scores them.
Large language models predict the next token. Paged attention keeps keys and values in fixed blocks.
Two plus two equals four. The capital of France is Paris. Write a short poem about the sea and the sky.
def add(a, b): return a + b. Solve for x: 3x + 5 = 20. Explain why the sky is blue in one sentence."""


def build_tokenizer(vocab_size: int, bos: bool = False) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids; filler tokens pad the vocabulary. With
    `bos`, encoding a text prepends the BOS token `<s>`, as Llama's tokenizer does."""
    specials = [EOS, PAD, BOS] if bos else [EOS, PAD]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    budget = max(len(pre_tokenizers.ByteLevel.alphabet()) + len(specials), min(vocab_size - len(specials), 1024))
    trainer = trainers.BpeTrainer(vocab_size=budget, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                                bos_token=BOS if bos else None)
    missing = vocab_size - len(fast)
    if missing < 0:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's base vocabulary {len(fast)}")
    fast.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return fast


def build_tiny_model(path: str | Path, arch: str = "qwen3", *, vocab_size: int = 512, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                     max_position_embeddings: int = 1024, initializer_range: float = 0.2, seed: int = 0,
                     bos: bool = False, **config_overrides) -> Path:
    """Write a random-weight `arch` model (float32 safetensors) and its tokenizer (with a BOS token when
    `bos`) into `path`."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} must be one of {sorted(ARCHS)}")
    path = Path(path)
    tokenizer = build_tokenizer(vocab_size, bos)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = ARCHS[arch](
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=eos_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{"tie_word_embeddings": False, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
