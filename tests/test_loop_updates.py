"""The engine loop applies weight updates between steps; rows of samples that end during the update reach
their calls as they end, also while a "finish" update drains. No Ray."""

from __future__ import annotations

import threading
from typing import Callable

import pytest

from rollout import SamplingParams
from tests.conftest import hf_model, make_engine, random_prompts
from workers.engine import pipeline
from workers.loop import EngineLoop
from workers.messages import PromptGroup


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_finish_update_streams_rows_while_its_drain_runs(model_dir, async_batching):
    """A short and a long sample run; a "finish" update drains both on the old weights. The short one's
    batch must reach its call while the long one still runs (inside the update), not after the drain;
    with async batching too (a step in flight when the update arrives)."""
    loop = EngineLoop(lambda: make_engine(model_dir("qwen3"), async_batching=async_batching), flush_rows=64,
                      flush_delay_s=0.01)
    new_weights = hf_model(model_dir("qwen3", seed=1)).state_dict()
    seen: dict[str, list] = {"short": [], "long": []}
    done = {name: threading.Event() for name in seen}

    def emit(name: str):
        def receive(item):
            seen[name].append((item, loop.engine.has_unfinished()))  # runs on the loop thread
            if item is None or isinstance(item, BaseException):
                done[name].set()
        return receive

    prompts = random_prompts(2, 512, (8, 8), seed=60)
    for name, prompt, new in [("short", prompts[0], 30), ("long", prompts[1], 150)]:
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        loop.open(name, [PromptGroup(0, prompt, [0])], params, emit(name)).result()
    while loop.submit(loop.engine.stats).result()["decode_tokens"] < 2:  # both have started
        pass
    paused, resume = threading.Event(), threading.Event()
    loop.submit(lambda: (paused.set(), resume.wait()))  # hold the loop between two steps
    paused.wait()
    assert not seen["short"], "the short sample must still be running when the update starts"
    update = loop.update(new_weights, 1, "finish")
    resume.set()
    update.result(timeout=60)
    assert all(event.wait(10) for event in done.values())
    assert seen["short"][0][1], "the short sample's batch was sent while the drain still ran"
    for name, new in [("short", 30), ("long", 150)]:
        row = seen[name][0][0].to_pylist()[0]
        assert (row["finish_reason"], len(row["token_ids"]), row["policy_version"]) == ("length", new, 0)
    assert loop.submit(loop.engine.stats).result()["policy_version"] == 1


class _IdleEngine:
    """Records the thread that built it; never has work."""

    def __init__(self) -> None:
        self.thread = threading.current_thread().name

    def has_unfinished(self) -> bool:
        return False


def test_the_engine_is_built_on_the_loop_thread_and_its_errors_reach_the_caller():
    """One thread of a worker runs torch's parallel kernels: the engine (model load included) is built
    on the loop thread that steps it."""
    loop = EngineLoop(_IdleEngine, flush_rows=1, flush_delay_s=0.0)
    assert loop.engine.thread == "engine-loop"
    assert loop.submit(lambda: threading.current_thread().name).result(timeout=10) == "engine-loop"

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(broken, flush_rows=1, flush_delay_s=0.0)


def receivers(*names: str) -> tuple[dict[str, list], dict[str, threading.Event], Callable]:
    """Per call name: the items its emit received, an event set at its end (None or an error), and
    `emit(name)`, the receiver to open the call with."""
    items: dict[str, list] = {name: [] for name in names}
    done = {name: threading.Event() for name in names}

    def emit(name: str) -> Callable[[object], None]:
        def receive(item: object) -> None:
            items[name].append(item)
            if item is None or isinstance(item, BaseException):
                done[name].set()
        return receive
    return items, done, emit


def test_rows_that_cannot_be_sent_fail_their_call_and_the_loop_serves_on(model_dir, monkeypatch):
    """An error outside a step (here building a call's record batch) reaches the open calls at once
    instead of ending the loop thread (which would leave every call waiting); later calls are served."""
    loop = EngineLoop(lambda: make_engine(model_dir("qwen3")), flush_rows=1, flush_delay_s=0.0)
    items, done, emit = receivers("bad", "good")
    def unsendable(rows):
        raise TypeError("cannot build the batch")

    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    prompt = random_prompts(1, 512, (6, 6), seed=61)[0]
    with monkeypatch.context() as patch:
        patch.setattr("workers.loop.samples_to_batch", unsendable)
        loop.open("bad", [PromptGroup(0, prompt, [0])], params, emit("bad")).result()
        assert done["bad"].wait(30)
    assert isinstance(items["bad"][-1], TypeError)
    loop.open("good", [PromptGroup(0, prompt, [0])], params, emit("good")).result()
    assert done["good"].wait(30) and items["good"][-1] is None
    assert len(items["good"][0].to_pylist()[0]["token_ids"]) == 4


def test_a_step_whose_tokens_never_arrive_fails_its_calls_and_the_loop_serves_on(model_dir, monkeypatch):
    """A step that fails while its tokens are awaited (with async batching, inside the next step) fails the
    open calls; their samples held its placeholders, whose abort rows could not be decoded, so the worker
    refused every later call though its blocks all came back."""
    loop = EngineLoop(lambda: make_engine(model_dir("qwen3"), async_batching=True), flush_rows=1, flush_delay_s=0.0)
    wait, calls = pipeline.Sampled.wait, []

    def failing_wait(sampled: pipeline.Sampled) -> tuple[list[int], list[float]]:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the step failed")
        return wait(sampled)

    monkeypatch.setattr(pipeline.Sampled, "wait", failing_wait)
    items, done, emit = receivers("bad", "good")
    params = SamplingParams(temperature=0, n=2, max_new_tokens=6, ignore_eos=True)
    prompt = random_prompts(1, 512, (6, 6), seed=62)[0]
    for name in items:
        loop.open(name, [PromptGroup(0, prompt, [0, 1])], params, emit(name)).result()
        assert done[name].wait(30)
    assert isinstance(items["bad"][-1], RuntimeError) and items["good"][-1] is None
    assert sorted(len(row["token_ids"]) for batch in items["good"][:-1] for row in batch.to_pylist()) == [6, 6]


def test_a_call_refused_part_way_leaves_none_of_its_groups_in_the_engine(model_dir):
    """A call whose second group the engine refuses (a replacement with a smaller cache judges it, say) fails
    at `open` with its first group aborted too: else its samples would run for nobody, holding blocks."""
    loop = EngineLoop(lambda: make_engine(model_dir("qwen3")), flush_rows=1, flush_delay_s=0.0)
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)  # runs on unless aborted
    prompt = random_prompts(1, 512, (6, 6), seed=63)[0]
    groups = [PromptGroup(0, prompt, [0]), PromptGroup(1, [5, 99999], [0])]
    with pytest.raises(ValueError, match="prompt 1 has token id 99999"):
        loop.open("call", groups, params, lambda item: None).result(timeout=30)
    assert loop.submit(loop.engine.has_unfinished).result(timeout=10) is False


def test_a_call_flushes_its_rows_once_flush_rows_are_pending(model_dir):
    """Rows go out as soon as `flush_rows` of a call are pending, not only after `flush_delay_s` or at the call's
    end: the first group (prefilled a step earlier) arrives on its own, ahead of the second."""
    loop = EngineLoop(lambda: make_engine(model_dir("qwen3"), max_batch_tokens=32), flush_rows=2, flush_delay_s=3600)
    items, done, emit = receivers("call")
    first, second = random_prompts(2, 512, (40, 40), seed=64)
    groups = [PromptGroup(0, first, [0, 1]), PromptGroup(1, second, [0, 1])]
    loop.open("call", groups, SamplingParams(n=2, temperature=0, max_new_tokens=2, ignore_eos=True), emit("call"))
    assert done["call"].wait(30) and items["call"][-1] is None
    assert [batch.column("prompt_index").to_pylist() for batch in items["call"][:-1]] == [[0, 0], [1, 1]]
