"""`to_torch` on real engine rows: tokens, masks and logprobs line up with a plain transformers forward."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from tests.conftest import hf_model, make_engine, random_prompts
from trainer_client import to_torch

PAD = 1


def test_tensors_align_with_a_transformers_forward(model_dir):
    model = model_dir("qwen3")
    prompts = random_prompts(3, 512, (3, 15), seed=8)
    params = SamplingParams(n=2, max_new_tokens=10, seed=0, logprobs_mode="raw", stop_token_ids=[7, 8, 9])
    table = make_engine(model).generate(prompts, params)
    t = to_torch(table, pad_token_id=PAD)
    rows = table.to_pylist()
    assert t["input_ids"].shape == t["logprobs"].shape == (6, max(len(r["prompt_token_ids"]) + len(r["token_ids"])
                                                               for r in rows))
    for b, row in enumerate(rows):
        p, c = len(row["prompt_token_ids"]), len(row["token_ids"])
        assert t["input_ids"][b, :p + c].tolist() == row["prompt_token_ids"] + row["token_ids"]
        assert set(t["input_ids"][b, p + c:].tolist()) <= {PAD}
        assert t["attention_mask"][b].tolist() == [1] * (p + c) + [0] * (t["input_ids"].shape[1] - p - c)
        assert t["response_mask"][b].nonzero().flatten().tolist() == list(range(p, p + c))
        assert torch.allclose(t["logprobs"][b, p:p + c], torch.tensor(row["logprobs"]))
        assert (t["logprobs"][b][t["response_mask"][b] == 0] == 0).all()
    assert t["prompt_index"].tolist() == [0, 0, 1, 1, 2, 2] and t["sample_index"].tolist() == [0, 1] * 3

    with torch.no_grad():
        logits = hf_model(model)(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    # the logprob at position t belongs to input_ids[t], predicted from position t - 1
    recomputed = torch.log_softmax(logits[:, :-1], -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
    mask = t["response_mask"][:, 1:].bool()
    assert torch.allclose(recomputed[mask], t["logprobs"][:, 1:][mask], atol=1e-4)


def test_a_record_batch_and_an_empty_table(model_dir):
    rows = make_engine(model_dir("qwen3")).generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=3))
    batch = rows.to_batches()[0]
    assert to_torch(batch, PAD)["input_ids"].tolist() == to_torch(rows, PAD)["input_ids"].tolist()
    assert to_torch(rows, None)["input_ids"].tolist() == to_torch(rows, 0)["input_ids"].tolist()  # no pad token
    empty = to_torch(rows.schema.empty_table(), PAD)
    assert empty["input_ids"].shape == (0, 0) and empty["prompt_index"].shape == (0,)


@pytest.mark.parametrize("pad", ["0", 1.5, True, 2**70])
def test_a_pad_that_is_no_token_id_is_refused_naming_it(model_dir, pad):
    rows = make_engine(model_dir("qwen3")).generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=3))
    with pytest.raises(ValueError, match=re.escape(f"pad_token_id={pad!r}")):
        to_torch(rows, pad)
    assert to_torch(rows, np.int32(PAD))["input_ids"].tolist() == to_torch(rows, PAD)["input_ids"].tolist()
