"""`rollout.shutdown()` while other threads use the service: a thread blocked in a stream, and one busy between
two batches of its stream, each get `ServiceUnavailable` naming the shutdown (a read racing Ray's shutdown
could end the whole process, or raise Ray's internals), and a later `sample` does not start a service by
itself; calls that meet a service while it stops (`rollout stop` from another process) are refused as stopped."""

from __future__ import annotations

import threading
import time

import pytest
import ray

import rollout
from rollout import SamplingParams, api, service_lost
from rollout.service import MAX_CALLS, RolloutService
from rollout.service_lost import ServiceUnavailable, service_calls
from tests.conftest import hf_model, random_prompts
from tests.test_service_hangs import hang_next_step
from trainer_client import RolloutClient
from workers.messages import Caller


def read(new_tokens: int, reading: threading.Event, pause: threading.Event, out: dict, name: str) -> None:
    """Read a stream, waiting on `pause` after each batch; `reading` is set once the stream is open (a long
    one) or has given its first batch (a short one); record how it ended."""
    try:
        stream = rollout.sample(random_prompts(4, 512, (4, 8), seed=1), n=2, ignore_eos=True,
                                max_new_tokens=new_tokens)
        if new_tokens > 100:
            reading.set()
        for _ in stream:
            reading.set()
            pause.wait(30)
        out[name] = None
    except Exception as err:  # noqa: BLE001 - the test asserts which
        out[name] = err
        reading.set()


def test_shutdown_while_other_threads_read_streams(model_dir):
    rollout.init(model=model_dir("qwen3"), num_workers=2, flush_rows=1, flush_delay_s=0.0, max_num_seqs=8,
                 num_blocks=512, object_store_memory_gib=0.5)
    out, pause = {}, threading.Event()
    readers = {"between batches": 4, "blocked": 1000}
    opened = {name: threading.Event() for name in readers}
    threads = [threading.Thread(target=read, args=(new_tokens, opened[name], pause, out, name), daemon=True)
               for name, new_tokens in readers.items()]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in opened.values())
    with pytest.raises(RuntimeError, match=r"rollout is already initialised; call rollout.shutdown\(\) first"):
        rollout.init(model=model_dir("qwen3"))
    rollout.shutdown()
    assert not ray.is_initialized(), "the embedded Ray that init started is stopped"
    pause.set()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    for name, err in out.items():
        assert isinstance(err, ServiceUnavailable) and "rollout.shutdown()" in str(err), (name, repr(err))
    with pytest.raises(RuntimeError, match=r"rollout was shut down; call rollout.init\(...\)"):
        rollout.sample([[5, 6]], n=1)
    with pytest.raises(RuntimeError, match=r"rollout was shut down; call rollout.init\(...\)"):
        rollout.update_weights({}, version=1)


def test_shutdown_stops_ray_once_the_threads_inside_a_call_have_returned(monkeypatch):
    """Ray stops only after every thread inside a service call has left it: a thread inside a Ray call when
    Ray shuts down can end the whole process."""
    monkeypatch.setattr(service_lost.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(api, "_owns_ray", True)
    inside_at_stop = []
    monkeypatch.setattr(api, "stop_local_ray", lambda: inside_at_stop.append(service_lost._CALLS.inside))
    entered = threading.Event()

    def call() -> None:
        with service_calls(None):
            entered.set()
            time.sleep(0.3)

    thread = threading.Thread(target=call)
    thread.start()
    assert entered.wait(10)
    rollout.shutdown()
    thread.join(10)
    assert inside_at_stop == [0]


def test_calls_once_the_service_began_to_stop_are_refused_as_stopped(model_dir):
    """Between the service's own shutdown (its calls aborted, its workers killed) and the kill of its actor, as
    `rollout stop` from another process runs them, a call is refused naming the stop: not `{}` from `stats`,
    "every worker has died" from `sample`, or an update that reached no worker."""
    rollout.init(model=model_dir("qwen3"), num_workers=1, max_num_seqs=8, num_blocks=512)
    try:
        client = RolloutClient(api._service)
        state = {name: tensor.clone() for name, tensor in hf_model(model_dir("qwen3")).state_dict().items()}
        ray.get(api._service.shutdown.remote())
        for call in (client.stats, lambda: rollout.sample([[5, 6]], n=1), lambda: client.update_weights(state, 1)):
            with pytest.raises(ServiceUnavailable, match=r"the rollout service was stopped \(rollout.shutdown\(\) or"):
                call()
    finally:
        rollout.shutdown()


@pytest.mark.parametrize("failed", [False, True])
def test_a_call_running_when_the_stop_began_is_refused_as_stopped(failed):
    """A call already running when the stop began (an update waiting for samples to finish) ends refused, whether
    the emptied pool made it fail or return; a sample call that returned gave all its samples and stands."""
    service = object.__new__(RolloutService)
    service.stopping = False
    with pytest.raises(ServiceUnavailable, match="was stopped"):
        with service._serving():
            service.stopping = True
            if failed:
                raise RuntimeError("every worker of the service has died")
    service.stopping = False
    with service._serving(finished=False):
        service.stopping = True


@pytest.mark.timeout(300)
def test_the_service_answers_beside_more_calls_than_run_at_once(model_dir):
    """Sample calls beyond `MAX_CALLS` wait inside the service, leaving the actor's slots to the rest: with more
    calls open than run at once, all stuck behind engines whose step never returns, `ready` (what `connect`
    waits on) is answered and `shutdown` ends them. Ray queued those calls ahead of every other in 1,000 slots,
    so `stats` and `rollout stop` waited for a call to end (43 s and 31 s seen) or for good."""
    rollout.init(model=model_dir("qwen3"), num_workers=1, max_num_seqs=4, num_blocks=64, object_store_memory_gib=0.5)
    try:
        service, context = api._service, ray.get_runtime_context()
        worker = ray.get_actor("rollout-worker-0", namespace="rollout")
        ray.get(worker.__ray_call__.remote(hang_next_step))
        caller, params = Caller(context.get_job_id(), context.get_worker_id()), SamplingParams(max_new_tokens=4)
        calls = [service.sample.remote([[5, 6, 7]], params, caller) for _ in range(MAX_CALLS + 8)]
        assert ray.get(service.ready.remote(), timeout=60) == 1 and len(calls) == MAX_CALLS + 8
    finally:
        rollout.shutdown()
