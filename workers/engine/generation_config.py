"""What a checkpoint's generation_config.json means to the engine. Its EOS ids end samples. The logits
processors `generate` applies by default, even when greedy, are not applied: samples come from the model's
own distribution under `SamplingParams` alone (as vLLM given explicit sampling parameters), which is what
a trainer's logprobs are computed under. The engine names those it leaves out when it starts."""

from __future__ import annotations

import logging

import transformers

logger = logging.getLogger(__name__)

# generation_config fields that change `generate`'s greedy tokens, and the value at which they do nothing
_GREEDY_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                      "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                      "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
                      "min_new_tokens": 0, "exponential_decay_length_penalty": None, "num_beams": 1,
                      "watermarking_config": None}


def eos_token_ids(model: transformers.PreTrainedModel) -> frozenset[int]:
    """The generation config's EOS ids, or the model config's when it names none (a vision-language config's
    are in its text config)."""
    eos = model.generation_config.eos_token_id
    for config in (model.config, model.config.get_text_config()):
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else eos or [])


def unapplied_processors(model: transformers.PreTrainedModel) -> dict[str, object]:
    """The fields of the model's generation config that `generate` would apply and the engine does not."""
    config = model.generation_config
    values = {name: getattr(config, name, None) for name in _GREEDY_PROCESSORS}
    return {name: value for name, value in values.items() if value not in (None, [], {}, _GREEDY_PROCESSORS[name])}


def warn_unapplied_processors(model: transformers.PreTrainedModel) -> None:
    """Log, once per engine, the generation-config processors this engine leaves out."""
    unapplied = unapplied_processors(model)
    if unapplied:
        fields = ", ".join(f"{name}={value!r}" for name, value in unapplied.items())
        logger.warning("generation_config.json sets %s, which transformers' generate applies by default; this "
                       "engine samples only as SamplingParams say, from the model's own distribution", fields)


def warn_silent_tokenizer_eos(tokenizer: transformers.PreTrainedTokenizerBase | None, eos: frozenset[int]) -> None:
    """Log when the tokenizer's EOS token ends no sample: as `generate`, the engine stops on the generation
    config's EOS ids only, where vLLM stops on the tokenizer's too (a fine-tune that changed its chat's end
    token in the tokenizer alone would run every sample to its length)."""
    token_id = getattr(tokenizer, "eos_token_id", None)
    if isinstance(token_id, int) and token_id not in eos:
        logger.warning("the tokenizer's eos_token %r (id %d) ends no sample: the generation config's EOS ids are "
                       "%s; pass stop_token_ids=[%d] or add it to generation_config.json to stop on it",
                       tokenizer.eos_token, token_id, sorted(eos), token_id)
