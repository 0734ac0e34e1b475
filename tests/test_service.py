"""The embedded service with two CPU workers: exactly-once delivery, parity with one in-process engine,
streaming, isolation of concurrent calls, cancellation, and errors raised at the call."""

from __future__ import annotations

import concurrent.futures
import re
import time
from pathlib import Path

import pyarrow as pa
import pytest

import rollout
from rollout import SamplingParams
from rollout.schema import SAMPLE_SCHEMA
from tests.conftest import make_engine, random_prompts
from trainer_client import RolloutClient

DESIGN = Path(__file__).resolve().parents[2] / "shared" / "DESIGN.md"


def design_type(text: str) -> pa.DataType:
    """The Arrow type that DESIGN.md's table writes as `text` (`list<int32>`, `dictionary<int8, string>`)."""
    inner = text[text.find("<") + 1:-1]
    if text.startswith("list<"):
        return pa.list_(design_type(inner))
    if text.startswith("dictionary<"):
        return pa.dictionary(*(design_type(part) for part in inner.split(", ")))
    return getattr(pa, text)()


@pytest.mark.skipif(not DESIGN.exists(), reason="needs ../shared/DESIGN.md beside the checkout")
def test_the_schema_is_design_mds_table_column_for_column():
    table = DESIGN.read_text().split("## A sample", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?)(, nullable)? \|", table, re.M)
    assert len(rows) == 13
    assert [(f.name, f.type, f.nullable) for f in SAMPLE_SCHEMA] == [
        (name, design_type(kind), bool(nullable)) for name, kind, nullable in rows]


@pytest.fixture(scope="module")
def service(model_dir):
    """Two CPU workers sized so that a call runs in several waves (max_num_seqs=8) and flushes often."""
    model = model_dir("qwen3")
    rollout.init(model=model, num_workers=2, flush_rows=4, flush_delay_s=0.02, max_num_seqs=8,
                 num_blocks=256, object_store_memory_gib=0.5)
    yield model
    rollout.shutdown()


@pytest.fixture(scope="module")
def client(service):
    """The running service reached by name, as a trainer would (same driver)."""
    return RolloutClient.connect(name="rollout", namespace="rollout")


def keys(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))


def wait_until_idle(client: RolloutClient, timeout_s: float = 20.0) -> dict[int, dict]:
    """Worker stats once nothing runs, waits or is owed anywhere and every block is free or cached."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if all(s["running"] == s["waiting"] == s["outstanding"] == 0
               and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"] for s in stats.values()):
            return stats
        assert time.monotonic() < deadline, f"workers still busy: {stats}"
        time.sleep(0.1)


def test_every_sample_arrives_exactly_once(service, client):
    prompts = [*random_prompts(5, 512, (3, 20), seed=1), "The capital of France is"]
    stream = rollout.sample(prompts, n=4, max_new_tokens=12)
    assert stream.total == 24
    table = stream.to_table()
    assert table.schema == SAMPLE_SCHEMA
    assert keys(table) == [(p, s) for p in range(6) for s in range(4)]
    assert set(table.column("worker_id").to_pylist()) == {0, 1}
    for row in table.to_pylist():
        assert len(row["token_ids"]) == len(row["logprobs"]) <= 12
        if row["prompt_index"] < 5:
            assert row["prompt_token_ids"] == prompts[row["prompt_index"]]
    wait_until_idle(client)


def test_greedy_rows_equal_one_in_process_engine(service):
    prompts = random_prompts(6, 512, (3, 30), seed=2)
    params = dict(n=2, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    served = rollout.sample(prompts, **params).to_table()
    local = make_engine(service).generate(prompts, SamplingParams(**params))
    assert served.column("token_ids").to_pylist() == local.column("token_ids").to_pylist()
    for a, b in zip(served.column("logprobs").to_pylist(), local.column("logprobs").to_pylist()):
        assert a == pytest.approx(b, abs=1e-4)


def test_seeded_rows_equal_one_in_process_engine_with_copies_of_a_prompt(service):
    """Copies of a prompt in one seeded call get different samples, the ones an in-process engine gives,
    wherever the service routes them."""
    a, b, c = random_prompts(3, 512, (5, 20), seed=8)
    prompts = [a, b, a, c, a]
    params = dict(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=5)
    served = rollout.sample(prompts, **params).to_table().column("token_ids").to_pylist()
    assert served == make_engine(service).generate(prompts, SamplingParams(**params))["token_ids"].to_pylist()
    assert len({tuple(served[2 * i + s]) for i in (0, 2, 4) for s in (0, 1)}) == 6


def test_stop_strings_end_served_samples_as_they_end_in_process(service):
    """`stop` reaches the workers: seeded samples end where an in-process engine's end, at the token whose
    text completes the string."""
    prompts = random_prompts(4, 512, (4, 12), seed=9)
    params = dict(n=2, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7, stop=["e "])
    served = rollout.sample(prompts, **params).to_table()
    local = make_engine(service).generate(prompts, SamplingParams(**params))
    assert served.column("token_ids").to_pylist() == local.column("token_ids").to_pylist()
    reasons = served.column("finish_reason").to_pylist()
    assert reasons == local.column("finish_reason").to_pylist() and "stop" in reasons
    assert all(("e " in text) == (reason == "stop") for text, reason in zip(served.column("text").to_pylist(), reasons))


def test_first_batch_arrives_before_the_last_sample_finishes(service, client):
    stream = rollout.sample(random_prompts(8, 512, (4, 12), seed=3), n=4, max_new_tokens=64, ignore_eos=True)
    batches = iter(stream)
    first = next(batches)
    still_busy = sum(s["running"] + s["waiting"] for s in client.stats().values())
    rest = list(batches)
    assert first.num_rows < 32 and still_busy > 0
    assert first.num_rows + sum(b.num_rows for b in rest) == 32


def test_concurrent_calls_get_only_their_own_rows(service):
    prompts_a = random_prompts(4, 512, (5, 10), seed=4)
    prompts_b = random_prompts(3, 512, (11, 16), seed=5)
    stream_a = rollout.sample(prompts_a, n=3, max_new_tokens=24)
    stream_b = rollout.sample(prompts_b, n=5, max_new_tokens=8)
    table_b, table_a = stream_b.to_table(), stream_a.to_table()
    for table, prompts, n in [(table_a, prompts_a, 3), (table_b, prompts_b, 5)]:
        assert keys(table) == [(p, s) for p in range(len(prompts)) for s in range(n)]
        for row in table.to_pylist():
            assert row["prompt_token_ids"] == prompts[row["prompt_index"]]
    calls_a = {r.split(":")[0] for r in table_a.column("request_id").to_pylist()}
    calls_b = {r.split(":")[0] for r in table_b.column("request_id").to_pylist()}
    assert not calls_a & calls_b


def test_cancel_break_off_or_drop_aborts_the_samples_and_frees_the_blocks(service, client):
    """Each way of leaving a call early aborts its samples at once: `cancel()`, breaking off the iteration of a
    stream still held, dropping a stream unread. They make a small part of their 64 x 400 tokens, and every
    block comes back."""
    prompts = random_prompts(16, 512, (20, 40), seed=6)

    def started() -> rollout.RolloutStream:
        stream = rollout.sample(prompts, n=4, max_new_tokens=400, ignore_eos=True)
        assert sum(s["running"] + s["waiting"] for s in client.stats().values()) > 0
        return stream

    def decoded() -> int:
        return sum(s["decode_tokens"] for s in wait_until_idle(client).values())

    before = decoded()
    stream = started()
    stream.cancel()
    for batch in (stream := started()):
        break
    started()
    assert decoded() - before < 64 * 400 // 2


def test_cancel_ends_the_read_with_a_runtime_error(service, client):
    """Cancelled from another thread while one reads it, or between two reads in the reading thread."""
    cancelled = r"this stream was cancelled \(cancel\(\)\) before it was read to its end"
    stream = rollout.sample(random_prompts(4, 512, (4, 8), seed=8), n=2, max_new_tokens=1000, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        read = pool.submit(stream.to_table)
        time.sleep(0.5)
        stream.cancel()
        with pytest.raises(RuntimeError, match=cancelled):
            read.result(timeout=60)
    stream = rollout.sample(random_prompts(4, 512, (4, 8), seed=8), n=2, max_new_tokens=1000, ignore_eos=True)
    batches = iter(stream)
    next(batches)
    stream.cancel()
    with pytest.raises(RuntimeError, match=cancelled):
        next(batches)
    wait_until_idle(client)


def test_a_stream_is_read_once(service, client):
    """A second read, or a read after `cancel()`, raises instead of giving a table with no rows."""
    stream = rollout.sample(random_prompts(3, 512, (3, 8), seed=7), n=2, max_new_tokens=4)
    assert stream.to_table().num_rows == 6
    cancelled = rollout.sample(random_prompts(3, 512, (3, 8), seed=7), n=2, max_new_tokens=4)
    cancelled.cancel()
    for done in (stream, cancelled):
        with pytest.raises(RuntimeError, match="this stream was already read or cancelled"):
            done.to_table()
    wait_until_idle(client)


@pytest.mark.parametrize("prompts, sampling, message", [
    ([[5, 6, 99999]], {}, "prompt 0 has token id 99999 outside the vocabulary"),
    ([[5, 6], []], {}, "prompt 1 is empty"),
    ("not a list", {}, "prompts must be a non-empty list"),
    ((prompt for prompt in [[5, 6]]), {}, "prompts must be a non-empty list, got <generator"),
    ({"a": [5, 6]}, {}, "prompts must be a non-empty list"),
    ([[7] * 2000], {}, "prompt 0 has 2000 tokens"),
    ([[5, 6]], {"n": 0}, "SamplingParams.n=0 must be >= 1"),
    ([[5, 6]], {"temperature": -1.0}, "SamplingParams.temperature=-1.0"),
    ([[5, 6]], {"max_new_tokens": "many"}, "Expected `int`, got `str` - at `$.max_new_tokens`"),
    ([[5, 6]], {"bogus": 1}, "unknown field `bogus`"),
])
def test_bad_prompts_and_sampling_arguments_fail_at_the_call(service, client, prompts, sampling, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("$", r"\$")):
        rollout.sample(prompts, **sampling)
    wait_until_idle(client)
