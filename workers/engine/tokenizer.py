"""The model's tokenizer: loading it, and turning a string prompt into the token ids a trainer would get."""

from __future__ import annotations

import transformers

from rollout.config import EngineConfig


def load_tokenizer(config: EngineConfig) -> transformers.PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None when it has none, it needs a package that is not installed or
    code of its own without `trust_remote_code`: token-id prompts still work, string prompts are then refused.
    A directory without tokenizer files gets an empty tokenizer from transformers 5 (special tokens only): none."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError):
        return None
    return tokenizer if set(tokenizer.get_vocab().values()) - set(tokenizer.all_special_ids) else None


def encode_prompt(tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s token ids as `tokenizer(text)` gives them (and vLLM and Hugging Face pipelines): with the
    tokenizer's special tokens, such as the BOS of Llama, Gemma and Mistral tokenizers. A text that already
    begins with the BOS token (a chat template rendered to text) is encoded as it is, without a second BOS."""
    bos = tokenizer.bos_token
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=add)["input_ids"]
