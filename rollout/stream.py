"""The client side of a `sample` call: `RolloutStream`, and `open_stream` shared by `rollout.sample` and
`RolloutClient.sample`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pyarrow as pa
import ray
from ray import ObjectRefGenerator
from ray.actor import ActorHandle
from ray.exceptions import TaskCancelledError
from tqdm.auto import tqdm

from rollout.local_ray import get_result
from rollout.params import SamplingParams, check_prompt_list
from rollout.schema import SAMPLE_SCHEMA, sort_samples
from rollout.service_lost import ServiceUnavailable, reachable, service_calls
from workers.messages import Caller


def open_stream(service: ActorHandle, prompts: list[str] | list[list[int]], params: SamplingParams,
                progress: bool) -> "RolloutStream":
    """Start a `sample` call on `service`; prompts the service rejects raise ValueError here. The call names
    this process, so that the service aborts it if this process dies."""
    check_prompt_list(prompts)
    with service_calls(service):
        context = ray.get_runtime_context()
        generator = service.sample.remote(prompts, params, Caller(context.get_job_id(), context.get_worker_id()))
    return RolloutStream(service, generator, progress)


def sampling_params(n: int, sampling: dict[str, Any]) -> SamplingParams:
    """`SamplingParams` from `sample(...)` keywords; unknown names or bad values raise ValueError."""
    try:
        return SamplingParams.from_kwargs(n=n, **sampling)
    except ValueError as err:
        raise ValueError(f"invalid sampling arguments: {err}") from None


class RolloutStream:
    """The samples of one call: iterate for `pyarrow.RecordBatch`es in arrival order, or `to_table()`.
    `total` is the number of samples the call will deliver.

    A stream is read once. Breaking off the iteration, `cancel()`, leaving a `with` block or dropping the
    stream aborts the samples not yet received and frees their KV blocks. `progress=True` shows a tqdm
    bar. If the service actor dies meanwhile, or `rollout.shutdown()` runs (in any thread), iterating raises
    `ServiceUnavailable` at once.
    """

    def __init__(self, service: ActorHandle, generator: ObjectRefGenerator, progress: bool = False) -> None:
        self._service, self._generator = service, generator
        self._open, self._read = True, False
        try:
            with service_calls(service):
                self.total: int = get_result(next(generator))  # the acknowledgement: prompts valid and queued
        except BaseException:
            self.cancel()
            raise
        self._bar = tqdm(total=self.total, unit="sample", desc="rollout", disable=not progress)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        if self._read:
            raise RuntimeError("this stream was already read or cancelled: it delivers its samples once (keep "
                               "the batches, or call to_table() once)")
        self._read = True
        delivered = 0
        try:
            while (batch := self._next()) is not None:
                self._bar.update(batch.num_rows)
                delivered += batch.num_rows
                yield batch
            self._open = False
            if delivered != self.total:
                raise RuntimeError(f"the service ended this call after {delivered} of its {self.total} samples "
                                   "(a defect of the service: please report it)")
        finally:
            self.cancel()

    def _next(self) -> pa.RecordBatch | None:
        """The next batch, or None once every sample came (one service call: none is open between batches)."""
        with service_calls(self._service):
            try:
                ref = next(self._generator, None)
                return None if ref is None else get_result(ref)
            except TaskCancelledError:
                raise RuntimeError("this stream was cancelled (cancel()) before it was read to its end") from None

    def to_table(self) -> pa.Table:
        """Every sample, ordered by prompt then sample."""
        return sort_samples(pa.Table.from_batches(list(self), schema=SAMPLE_SCHEMA))

    def cancel(self) -> None:
        """Abort the samples not yet received (a no-op once the stream has ended); the stream cannot be read
        after it."""
        self._read = True
        if self._open:
            self._open = False
            with contextlib.suppress(ServiceUnavailable):  # the service is gone, and its call with it
                with service_calls(self._service):
                    ray.cancel(self._generator)
        if hasattr(self, "_bar"):
            self._bar.close()

    def __enter__(self) -> "RolloutStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if getattr(self, "_open", False) and reachable(self._service):
            self.cancel()
