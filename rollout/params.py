"""Sampling parameters, the per-call contract between a trainer and the engines, and the arguments of a
weight update."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Union

import msgspec

from rollout.checks import check_types

GREEDY_TEMPERATURE = 1e-5  # below it (0 included) sampling is greedy: logits / T would overflow
LOGPROBS_MODES = ("processed", "raw")
UPDATE_MODES = ("continue", "abort", "finish")  # what a weight update does to samples already started
# New policy weights: a state dict of tensors, or a directory of safetensors files.
WeightSource = Union[Mapping[str, "torch.Tensor"], str, Path]  # noqa: F821 (torch is not imported here)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample the completions of one prompt; validated on construction.

    `temperature=0` (or below 1e-5) means greedy. `top_k=0` and `top_p=1` disable those filters. `seed=None` draws a
    fresh seed per request; a fixed seed makes each sample independent of what shares its batch (a prompt
    given twice in one call still gets different samples: see `prompt_repeats`).
    `logprobs_mode="processed"` reports each token's logprob under the distribution it was drawn from (after
    temperature, top-k, top-p, min-p, in that order, as in transformers, save that tokens tied at the top-p cut
    keep the lower ids where transformers keeps the higher), "raw" under the model's own; a greedy sample reports
    the model's own in both modes (as vLLM does; top_k=1 at a temperature is processed: 0).
    A sample also ends with finish reason "length" where prompt and completion reach the engine's `max_model_len`,
    before `max_new_tokens` if that comes first (as in vLLM).
    `return_token_versions` fills the row's `token_policy_versions` (the weights version of each token).
    `stop` strings end a sample at the token whose text completes one of them (finish reason "stop"); that
    token stays in the sample, and the string in its text, so the tokens are what the model made. A string that is
    a special token's own text (`"<|im_end|>"`) ends the sample at that token, which the text leaves out.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str = "processed"
    return_token_versions: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(1e-30 <= self.top_p <= 1, "top_p", self.top_p, "must be in [1e-30, 1]")
        _check(0 <= self.top_k < 2**63, "top_k", self.top_k, "must be in [0, 2**63) (0 disables it)")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "must be non-negative token ids")
        _check(all(self.stop), "stop", self.stop, "must be non-empty strings")
        _check(self.seed is None or 0 <= self.seed < 2**64, "seed", self.seed, "must be None or in [0, 2**64)")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               f"must be one of {LOGPROBS_MODES}")

    @property
    def greedy(self) -> bool:
        """True when the sample is the argmax at every step."""
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments, turning unknown or ill-typed ones (numeric strings too) into a
        ValueError; numpy and torch scalars count as the Python numbers they hold."""
        return msgspec.convert({k: plain_number(v) for k, v in kwargs.items()}, cls, strict=True)


def check_prompt_list(prompts: object) -> None:
    """Refuse `prompts` that are not a non-empty list (or tuple) of prompts, or hold a prompt of no prompt type,
    in the caller's process too, so that a generator or a dict gets this error rather than Ray's when sent."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list, got {prompts!r:.80}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list, tuple)) and not hasattr(prompt, "tolist"):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")


def prompt_repeats(prompts: list[list[int]]) -> list[int]:
    """Which copy of an identical earlier prompt each prompt of a call is (0 for the first). A seeded sample's
    noise depends on its prompt's tokens and this, so the copies of a prompt given k times in one call draw
    the samples of one prompt with k * n, never the same ones."""
    seen: dict[tuple[int, ...], int] = {}
    repeats = []
    for ids in prompts:
        key = tuple(ids)
        repeats.append(seen.get(key, 0))
        seen[key] = repeats[-1] + 1
    return repeats


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {why}")


def check_update(version: int, mode: str) -> int:
    """`version` as a Python int; ValueError unless it is an integer in [0, 2**63) (rows hold it as int64; numpy
    and torch integer scalars count, as in `SamplingParams`) and `mode` one of UPDATE_MODES (the arguments
    every `update_weights` takes, checked where it is called)."""
    number = plain_number(version)
    if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**63:
        raise ValueError(f"version={version!r} must be an integer in [0, 2**63)")
    if mode not in UPDATE_MODES:
        raise ValueError(f"mode={mode!r} must be one of {UPDATE_MODES}")
    return number


def plain_number(value: Any) -> Any:
    """A numpy or torch scalar as the Python number it holds; anything else as it is."""
    return value.item() if getattr(value, "ndim", None) == 0 else value
