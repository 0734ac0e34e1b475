"""The engine loop: one thread owns an `Engine`, steps it (and swaps its weights between steps), and hands
every call's finished samples back as record batches, flushed by row count or after a short delay. Ray-free,
so it runs under any actor."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from rollout.params import SamplingParams
from rollout.schema import samples_to_batch
from workers.messages import PromptGroup

Emit = Callable[[Any], None]  # receives record batches, then None when the call is complete, or an exception


@dataclass
class _Call:
    emit: Emit
    request_ids: list[str]
    remaining: int
    rows: list[dict] = field(default_factory=list)
    first_pending_at: float = 0.0


class EngineLoop:
    """Builds an engine with `make_engine` and drives it on a daemon thread; every engine call goes
    through that thread (the engine is not thread-safe).

    The engine is built on the loop thread too, so that one thread of the process runs torch's
    parallel CPU kernels: a second thread with an OpenMP team of its own (the actor's, from loading
    the model) makes libgomp throttle its idle spinning once its threads outnumber the cores, and every
    parallel region of a step then waits on a futex wake-up (a step ran ~2x slower).
    """

    def __init__(self, make_engine: Callable[[], Any], flush_rows: int, flush_delay_s: float) -> None:
        self.flush_rows = flush_rows
        self.flush_delay_s = flush_delay_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[str, _Call] = {}
        self._owners: dict[str, str] = {}  # engine request id -> call id
        self._error: BaseException | None = None
        # Progress, written by the loop thread only and read by the actor's watchdog probe: loop iterations
        # finished (a step, or the commands run between two), and whether it waits for work with none to do.
        self.ticks = 0
        self.idle = False
        built: Future = Future()
        threading.Thread(target=self._run, args=(make_engine, built), name="engine-loop", daemon=True).start()
        self.engine = built.result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the loop thread between two steps; the future holds its result or exception."""
        future: Future = Future()
        self._commands.put((future, fn, args))
        return future

    def open(self, call_id: str, groups: list[PromptGroup], params: SamplingParams, emit: Emit) -> Future:
        """Queue the groups of a call; `emit` then gets its batches, and None once every sample was sent."""
        return self.submit(self._open, call_id, groups, params, emit)

    def close(self, call_id: str) -> Future:
        """Abort the unfinished samples of a call and drop its pending rows: its consumer went away."""
        return self.submit(self._close, call_id)

    def update(self, source: Any, version: int, mode: str) -> Future:
        """Swap the engine's weights between two steps (`Engine.update_weights`). Rows of the samples that
        end meanwhile (aborted, or finished by a "finish" drain) go to their calls like rows from a step,
        and a drain keeps flushing them while it runs."""
        return self.submit(self.engine.update_weights, source, version, mode, self._deliver_now)

    def _open(self, call_id: str, groups: list[PromptGroup], params: SamplingParams, emit: Emit) -> None:
        if self._error is not None:
            raise RuntimeError(f"this worker's engine failed earlier: {self._error!r}")
        if call_id in self._calls:
            raise ValueError(f"call {call_id!r} is already open")
        added: list[str] = []
        try:
            for group in groups:
                added.append(self.engine.add_request(
                    group.token_ids, params, request_id=f"{call_id}:{group.prompt_index}",
                    prompt_index=group.prompt_index, sample_indices=group.sample_indices, repeat=group.repeat))
        except Exception:
            self.engine.abort(*added)
            raise
        self._calls[call_id] = _Call(emit, added, sum(len(g.sample_indices) for g in groups))
        self._owners.update(dict.fromkeys(added, call_id))

    def _close(self, call_id: str) -> None:
        call = self._calls.pop(call_id, None)
        if call is None:
            return
        for request_id in call.request_ids:
            self._owners.pop(request_id, None)
        self.engine.abort(*call.request_ids)

    def _run(self, make_engine: Callable[[], Any], built: Future) -> None:
        try:
            self.engine = make_engine()
        except BaseException as err:  # raised in the constructor's thread
            built.set_exception(err)
            return
        built.set_result(self.engine)
        while True:
            try:
                self._iterate()
            except Exception as err:  # a step, or rows that cannot be sent: fail the calls, keep the thread
                self._fail(err)
            self.ticks += 1

    def _iterate(self) -> None:
        """Run the queued commands, one step when there is work, then send what is due."""
        busy = self._error is None and self.engine.has_unfinished()
        self._run_commands(block=not busy)
        if self._error is None and self.engine.has_unfinished():
            self._deliver(self.engine.step(), time.monotonic())
        self._flush(time.monotonic())

    def _run_commands(self, block: bool) -> None:
        """Run the queued commands; wait for the first one when the engine has nothing to do."""
        try:
            self.idle = block
            item = self._commands.get(block=block)
            self.idle = False
            while True:
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as err:  # handed to the caller, who raises it
                        future.set_exception(err)
                item = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _deliver_now(self, rows: list[dict]) -> None:
        """Hand rows to their calls and flush what is due, from inside a long engine call (each step of a
        "finish" drain: progress for the watchdog)."""
        self.ticks += 1
        now = time.monotonic()
        self._deliver(rows, now)
        self._flush(now)

    def _deliver(self, rows: list[dict], now: float) -> None:
        """Queue each finished sample's row on its call (rows of closed calls are dropped)."""
        for row in rows:
            call = self._calls.get(self._owners.get(row["request_id"].rsplit("/", 1)[0], ""))
            if call is None:
                continue
            if not call.rows:
                call.first_pending_at = now
            call.rows.append(row)
            call.remaining -= 1

    def _fail(self, err: Exception) -> None:
        """A step (or sending rows) raised: fail every open call and abort its requests. The engine keeps
        serving only if its block accounting still balances; otherwise every later call is refused."""
        for call in self._calls.values():
            call.emit(err)
        try:
            for call_id in list(self._calls):
                self._close(call_id)
            self.engine.check_integrity()
        except Exception:
            self._error = err
            self._calls.clear()
            self._owners.clear()

    def _flush(self, now: float) -> None:
        """Send each call's pending rows that are numerous or old enough, and end the complete calls."""
        for call_id, call in list(self._calls.items()):
            if call.rows and (call.remaining == 0 or len(call.rows) >= self.flush_rows
                              or now - call.first_pending_at >= self.flush_delay_s):
                call.emit(samples_to_batch(call.rows))
                call.rows = []
            if call.remaining == 0:
                call.emit(None)
                del self._calls[call_id]
                for request_id in call.request_ids:
                    self._owners.pop(request_id, None)
