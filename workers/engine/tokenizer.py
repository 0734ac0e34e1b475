"""The model's tokenizer: loading it, turning a string prompt into the token ids a trainer would get, and
generated tokens into text."""

from __future__ import annotations

import logging
from pathlib import Path

import transformers

from rollout.config import EngineConfig

logger = logging.getLogger(__name__)


def load_tokenizer(config: EngineConfig) -> tuple[transformers.PreTrainedTokenizerBase | None, str]:
    """The model's tokenizer and "", or None and why there is none (said in the errors of string prompts and
    stop strings, which are then refused; token-id prompts still work): no tokenizer files, or files that did
    not load (a package not installed, code of its own without `trust_remote_code`, a broken file). A
    directory without tokenizer files gets an empty tokenizer from transformers 5 (special tokens only): none."""
    none = f"model {config.model!r} has no tokenizer"
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as err:
        if not _has_tokenizer_files(config.model):
            return None, none
        why = f"the tokenizer of {config.model!r} did not load ({type(err).__name__}: {err})"
        logger.warning("%s: string prompts and stop strings are refused and rows have no text", why)
        return None, why
    if set(tokenizer.get_vocab().values()) - set(tokenizer.all_special_ids):
        return tokenizer, ""
    return None, none


def _has_tokenizer_files(model: str) -> bool:
    """Whether directory `model` holds a tokenizer's files (one that failed to load is then worth a warning)."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")
    return any((Path(model) / name).is_file() for name in names)


def encode_prompt(tokenizer: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s token ids as `tokenizer(text)` gives them (and vLLM and Hugging Face pipelines): with the
    tokenizer's special tokens, such as the BOS of Llama, Gemma and Mistral tokenizers. A text that already
    begins with the BOS token (a chat template rendered to text) is encoded as it is, without a second BOS."""
    bos = tokenizer.bos_token
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return tokenizer(text, add_special_tokens=add)["input_ids"]


# Tokens before a completion that its text is decoded after (vLLM's detokenizer starts from five too), and
# how many a context may take: a character's bytes span at most four tokens, so one that starts inside a
# character is clean three tokens earlier.
CONTEXT_TOKENS = 5
CONTEXT_REACH = CONTEXT_TOKENS + 3


def decode(tokenizer: transformers.PreTrainedTokenizerBase, batch: list[list[int]]) -> list[str]:
    """The texts `tokenizer.batch_decode` gives (special tokens skipped), in one call of a fast tokenizer's
    Rust backend when decoding adds nothing to it (no clean-up of spaces): a third of the time."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode_batch(batch, skip_special_tokens=True)
    return tokenizer.batch_decode(batch, skip_special_tokens=True)


def decode_after(tokenizer: transformers.PreTrainedTokenizerBase, befores: list[list[int]],
                 batch: list[list[int]]) -> list[str]:
    """The text each of `batch` adds to the tokens before it (`befores`, up to `CONTEXT_REACH` of them; none for
    some), as one decode of both gives it: a tokenizer that drops the leading space of a decode's first word
    (Llama 2's, Mistral's) keeps the one a completion starts with. Where the context's own text is not how that
    decode starts (a character split at the cut), the tokens are decoded alone."""
    contexts, heads = _contexts(tokenizer, befores)
    texts = decode(tokenizer, [context + list(b) for context, b in zip(contexts, batch)])
    alone = []
    for i, head in heads.items():
        if texts[i].startswith(head):
            texts[i] = texts[i][len(head):]
        else:
            alone.append(i)
    for i, text in zip(alone, decode(tokenizer, [list(batch[i]) for i in alone]) if alone else []):
        texts[i] = text
    return texts


def _contexts(tokenizer: transformers.PreTrainedTokenizerBase,
              befores: list[list[int]]) -> tuple[list[list[int]], dict[int, str]]:
    """The last `CONTEXT_TOKENS` of each of `befores`, and the text of each non-empty one, by index; where that
    text has U+FFFD (a cut inside a character, which a byte-fallback decoder, SentencePiece's in Llama 2, Mistral
    and Gemma, spreads over the whole run of byte tokens it starts, the completion's too), the shortest of up to
    `CONTEXT_REACH` tokens whose text has none, as vLLM primes its detokenizer; where it is empty (special tokens
    only, after which a decoder that strips a decode's leading space would strip the completion's), the shortest
    whose text is not."""
    contexts = [list(before[-CONTEXT_TOKENS:]) for before in befores]
    having = [i for i, context in enumerate(contexts) if context]
    heads = dict(zip(having, decode(tokenizer, [contexts[i] for i in having]) if having else []))
    redo = [i for i, head in heads.items() if _unclean(head) and len(befores[i]) > CONTEXT_TOKENS]
    sizes = range(CONTEXT_TOKENS + 1, CONTEXT_REACH + 1)
    wider = [list(befores[i][-size:]) for i in redo for size in sizes]
    texts = decode(tokenizer, wider) if wider else []
    for k, i in enumerate(redo):
        tried = range(k * len(sizes), (k + 1) * len(sizes))
        clean = next((j for j in tried if not _unclean(texts[j])), None)
        if clean is not None:
            contexts[i], heads[i] = wider[clean], texts[clean]
    return contexts, heads


def _unclean(text: str) -> bool:
    """Whether a context's text cannot start a decode that a completion's text is cut from."""
    return not text or "\ufffd" in text
