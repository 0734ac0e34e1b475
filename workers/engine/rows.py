"""A sample as the dict of one Arrow row (`rollout.schema.SAMPLE_SCHEMA`)."""

from __future__ import annotations

import transformers

from workers.engine.sequence import Sequence
from workers.engine.tokenizer import CONTEXT_REACH, decode_after


def sample_row(seq: Sequence, sample_index: int, reason: str, worker_id: int, policy_version: int,
               tokenizer: transformers.PreTrainedTokenizerBase | None) -> dict:
    """The row of sample `sample_index` of `seq`, ended for `reason`. `policy_version` stands in for the
    versions of a sample that has no token yet; `text` (None without a tokenizer) is what the completion
    adds after the prompt's last tokens."""
    group = seq.group
    generated = seq.token_ids[seq.num_prompt_tokens:]
    text = None
    if tokenizer is not None:
        text = decode_after(tokenizer, [group.prompt_token_ids[-CONTEXT_REACH:]], [generated])[0]
    versions = seq.versions or [policy_version]
    return {"request_id": f"{group.request_id}/{sample_index}", "prompt_index": group.prompt_index,
            "sample_index": sample_index, "prompt_token_ids": group.prompt_token_ids,
            "token_ids": generated, "logprobs": seq.logprobs[: len(generated)], "finish_reason": reason,
            "policy_version": versions[-1], "first_policy_version": versions[0],
            "token_policy_versions": seq.versions if group.params.return_token_versions else None,
            "num_preemptions": seq.num_preemptions, "worker_id": worker_id, "text": text}
