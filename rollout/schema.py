"""The Arrow schema of one finished sample, and helpers to build record batches of them."""

from __future__ import annotations

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "abort")

# Columns in the order of DESIGN.md's table.
SAMPLE_SCHEMA = pa.schema([
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("prompt_index", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("finish_reason", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("num_preemptions", pa.int32(), nullable=False),
    pa.field("worker_id", pa.int32(), nullable=False),
    pa.field("first_policy_version", pa.int64(), nullable=False),
    pa.field("token_policy_versions", pa.list_(pa.int64()), nullable=True),
    pa.field("text", pa.string(), nullable=True),
])


def samples_to_batch(rows: list[dict]) -> pa.RecordBatch:
    """One record batch in SAMPLE_SCHEMA from dicts keyed by column name (`text` may be missing)."""
    columns = {name: [row.get(name) for row in rows] for name in SAMPLE_SCHEMA.names}
    reasons = [FINISH_REASONS.index(r) for r in columns["finish_reason"]]
    columns["finish_reason"] = pa.DictionaryArray.from_arrays(
        pa.array(reasons, pa.int8()), pa.array(FINISH_REASONS, pa.string()))
    arrays = [columns[f.name] if f.name == "finish_reason" else pa.array(columns[f.name], f.type)
              for f in SAMPLE_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=SAMPLE_SCHEMA)


def sort_samples(table: pa.Table) -> pa.Table:
    """Rows ordered by prompt, then sample: the order `generate` and `to_table` promise."""
    return table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")])
