"""The client's stream of a call, over a stand-in generator: it delivers every batch, and a stream the
service ends short of (or past) the total it announced raises rather than lose samples silently."""

from __future__ import annotations

import contextlib

import pytest

from rollout import stream
from rollout.schema import samples_to_batch
from rollout.stream import RolloutStream


def rows(prompt: int, n: int) -> list[dict]:
    return [{"request_id": f"r{prompt}/{i}", "prompt_index": prompt, "sample_index": i, "prompt_token_ids": [1],
             "token_ids": [2], "logprobs": [-0.5], "finish_reason": "length", "policy_version": 0,
             "first_policy_version": 0, "token_policy_versions": None, "num_preemptions": 0, "worker_id": 0,
             "text": None} for i in range(n)]


@pytest.fixture
def offline(monkeypatch):
    """No Ray: the generator's items are the values themselves."""
    monkeypatch.setattr(stream, "service_calls", lambda service: contextlib.nullcontext())
    monkeypatch.setattr(stream, "get_result", lambda ref: ref)


@pytest.mark.parametrize("sent, fine", [([2, 2], True), ([2, 1], False), ([2, 2, 1], False)],
                         ids=["all", "short", "more"])
def test_a_stream_checks_its_samples_against_the_total(offline, sent, fine):
    batches = [samples_to_batch(rows(prompt, n)) for prompt, n in enumerate(sent)]
    call = RolloutStream(None, iter([4, *batches]))
    if fine:
        assert call.to_table().num_rows == 4
        return
    received = []
    with pytest.raises(RuntimeError, match=rf"ended this call after {sum(sent)} of its 4 samples"):
        for batch in call:
            received.append(batch)
    assert received == batches
