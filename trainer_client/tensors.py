"""`to_torch`: sample rows as the padded tensors a PPO/GRPO trainer consumes."""

from __future__ import annotations

import numbers

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


def to_torch(data: pa.RecordBatch | pa.Table, pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` (prompt then completion, [B, L]), `attention_mask` (1 on real tokens),
    `response_mask` (1 on completion tokens), `logprobs` (the logprob of `input_ids[b, t]` at each
    completion position t, 0 elsewhere), and `prompt_index`, `sample_index` ([B]). Any `pad_token_id` will
    do, as the masks cover the padding: None (a tokenizer without a pad token, as GPT-2's) pads with 0."""
    _check_pad(pad_token_id)
    table = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
    prompts = table.column("prompt_token_ids").combine_chunks()
    completions = table.column("token_ids").combine_chunks()
    prompt_lens = pc.list_value_length(prompts).to_numpy(zero_copy_only=False).astype(np.int64)
    completion_lens = pc.list_value_length(completions).to_numpy(zero_copy_only=False).astype(np.int64)
    width = int((prompt_lens + completion_lens).max(initial=0))
    shape = (table.num_rows, width)
    input_ids = np.full(shape, 0 if pad_token_id is None else pad_token_id, dtype=np.int64)
    logprobs = np.zeros(shape, dtype=np.float32)
    _scatter(input_ids, prompts, np.zeros_like(prompt_lens))
    _scatter(input_ids, completions, prompt_lens)
    _scatter(logprobs, table.column("logprobs").combine_chunks(), prompt_lens)
    positions = np.arange(width)
    ends = prompt_lens + completion_lens
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(positions < ends[:, None]).long(),
        "response_mask": torch.from_numpy((positions >= prompt_lens[:, None]) & (positions < ends[:, None])).long(),
        "logprobs": torch.from_numpy(logprobs),
        "prompt_index": torch.from_numpy(table.column("prompt_index").to_numpy().astype(np.int64)),
        "sample_index": torch.from_numpy(table.column("sample_index").to_numpy().astype(np.int64)),
    }


def _check_pad(pad_token_id: object) -> None:
    """Refuse a pad that is not None or an int64 (a string or a float would pad with something else)."""
    if pad_token_id is None:
        return
    if not isinstance(pad_token_id, numbers.Integral) or isinstance(pad_token_id, bool) \
            or not -2**63 <= pad_token_id < 2**63:
        raise ValueError(f"pad_token_id={pad_token_id!r} must be None or an int64 token id")


def _scatter(out: np.ndarray, lists: pa.ListArray, starts: np.ndarray) -> None:
    """Write row b's list into `out[b, starts[b]:]`."""
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    offsets = np.cumsum(lengths) - lengths
    columns = np.arange(lengths.sum()) - np.repeat(offsets - starts, lengths)
    out[rows, columns] = lists.flatten().to_numpy(zero_copy_only=False)
