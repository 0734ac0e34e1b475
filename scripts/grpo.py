"""The trainer-side pieces of `train_grpo.py`: the reward, group-normalised advantages, the clipped
policy-gradient loss, and the trainer's own logprobs, including those of samples whose tokens came from two
policy versions (see `producing_logprobs`)."""

from __future__ import annotations

import inspect

import pyarrow as pa
import torch
import transformers

from trainer_client import to_torch


def target_token_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> torch.Tensor:
    """The ids of every token whose text is made of ASCII digits only ("7", "20", " 3", ...)."""
    texts = (tokenizer.decode([i]).strip() for i in range(len(tokenizer)))
    ids = [i for i, text in enumerate(texts) if text.isascii() and text.isdigit()]
    if not ids:
        raise ValueError("the tokenizer has no digit tokens: the reward needs some")
    return torch.tensor(ids)


def score(batch: pa.RecordBatch, targets: torch.Tensor, pad_token_id: int | None) -> pa.RecordBatch:
    """`batch` with a `reward` column: the share of each sample's generated tokens that are in `targets`."""
    tensors = to_torch(batch, pad_token_id)
    mask = tensors["response_mask"].bool()
    hits = (torch.isin(tensors["input_ids"], targets) & mask).sum(1)
    reward = hits / mask.sum(1).clamp(min=1)
    return batch.append_column("reward", pa.array(reward.numpy(), pa.float32()))


def group_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its prompt group's mean, over the group's standard deviation; 0 in a
    group of equal rewards (computed in float64: in float32 the mean of equal rewards can miss them by a unit in
    the last place, and that rounding over a std of the same size pushed the whole group one way)."""
    advantages = torch.zeros_like(rewards)
    for group in prompt_index.unique():
        rows = prompt_index == group
        r = rewards[rows].double()
        centred = r - r.mean()
        std = centred.square().mean().sqrt()
        if std > eps:
            advantages[rows] = (centred / std).to(rewards.dtype)
    return advantages


def token_logprobs(model: transformers.PreTrainedModel, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, L] logprob of `input_ids[b, t]` given the tokens before it (0 at t = 0), laid out like
    `to_torch(...)["logprobs"]`; temperature 1 and no filtering, which is what the rollout's "processed"
    logprobs are at temperature 1, top_p 1, top_k 0, min_p 0."""
    ids = tensors["input_ids"]
    logits = model(input_ids=ids, attention_mask=tensors["attention_mask"]).logits.float()
    chosen = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(chosen, (1, 0))


@torch.no_grad()
def resumed_logprobs(old: transformers.PreTrainedModel, new: transformers.PreTrainedModel,
                     ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logprobs of `ids[split + 1:]` computed the way an engine does after a "continue" update at `split`:
    the keys and values of positions before `split` come from `old` (cached before the update), those from
    `split` on from `new`, which also makes the logits."""
    name = _cache_name(new)
    cache = old(input_ids=ids[None, :split], use_cache=True)[name]
    logits = new(input_ids=ids[None, split:], **{name: cache}).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[split + 1:, None])[:, 0]


def _cache_name(model: transformers.PreTrainedModel) -> str:
    """The name of the KV cache in the model's forward and outputs: `cache` from transformers 5.24
    (`past_key_values`, deprecated there, goes in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def producing_logprobs(policies: dict[int, transformers.PreTrainedModel], current: torch.Tensor,
                       tensors: dict[str, torch.Tensor], token_versions: list[list[int]],
                       current_version: int) -> torch.Tensor:
    """[B, L] trainer logprobs of every generated token under the weights that produced it.

    `current` holds the logprobs under `policies[current_version]`. A sample drawn wholly under an older
    version is recomputed with that version's weights. A sample that spans a "continue" update (first tokens
    under v, later ones under v + 1) is recomputed like the engine ran it: the logprob of generated token j
    comes from the step that read token j - 1, so the step that sampled the first new-version token j_s read
    position P + j_s - 1 (P: prompt length) with the new weights, attending over keys and values that the
    old weights cached for every position before it. (A sample preempted and recomputed after the update would
    have new-weight KV before the switch too; none is at the trainer's sizes, and the mismatch would show it.)"""
    out = current.detach().clone()
    prompt_lens = (tensors["attention_mask"] - tensors["response_mask"]).sum(1)
    older = [b for b, v in enumerate(token_versions) if v and v[0] != current_version]
    for version in {token_versions[b][0] for b in older}:
        rows = [b for b in older if token_versions[b][0] == version]
        sub = {k: tensors[k][rows] for k in ("input_ids", "attention_mask")}
        out[rows] = token_logprobs(policies[version], sub)
    for b in older:
        versions = token_versions[b]
        if versions[-1] != versions[0]:
            first_new = versions.index(versions[-1])
            split = int(prompt_lens[b]) + first_new - 1
            length = int(tensors["attention_mask"][b].sum())
            out[b, split + 1:length] = resumed_logprobs(policies[versions[0]], policies[versions[-1]],
                                                         tensors["input_ids"][b, :length], split)
    return out


def grpo_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip: float) -> torch.Tensor:
    """The clipped policy-gradient loss: per token min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A) with
    ratio = exp(trainer logprob - rollout logprob), averaged over each sample's tokens, then over samples."""
    ratio = torch.exp(logprobs - rollout_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    mask = mask.float()
    return -((surrogate * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def mismatch(trainer: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Max and mean of |trainer logprob - rollout logprob| over the generated tokens."""
    diff = (trainer - rollout_logprobs).abs()[mask.bool()]
    return float(diff.max()), float(diff.mean())
