"""The trainer's side of weight updates, shared by `rollout.update_weights` and `RolloutClient.update_weights`.
The transport follows the source: a state dict goes through Ray's object store (put once, read zero-copy by
every worker), a path is a checkpoint directory of safetensors on shared disk; `transport="broadcast"` sends
over a torch.distributed group formed once with `WeightSync.open`."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Any, Mapping

import ray
import torch
from ray.actor import ActorHandle

from rollout.local_ray import get_result
from rollout.params import WeightSource, check_update
from rollout.service_lost import service_calls
from workers.engine.checkpoint_files import tied_conflicts
from workers.messages import TRANSPORTS, WeightGroup, WeightUpdate
from workers.weight_format import (
    check_bucket_bytes,
    check_state_dict,
    checkpoint_stamp,
    checkpoint_tensors,
    describe,
    pack,
    plan_buckets,
    to_numpy,
)
from workers.weight_group import (
    broadcast,
    check_group_options,
    check_port_free,
    close_group,
    group_device,
    host_store,
    open_group,
)

DEFAULT_BUCKET_BYTES = 256 * 2**20


def push_weights(service: ActorHandle, source: WeightSource, version: int, mode: str = "continue",
                 transport: str | None = None, sync: WeightSync | None = None) -> None:
    """Make `source` policy `version` on every worker of `service`; returns once all hold it. `transport`
    defaults to "checkpoint" for a path and "object_store" for a state dict; "broadcast" goes through `sync`.
    Bad arguments raise ValueError before anything is sent; tensors the engines refuse (a missing name, a
    wrong shape or dtype) raise ValueError with every worker left on its old weights and version."""
    version = check_update(version, mode)
    transport = transport or ("checkpoint" if isinstance(source, (str, Path)) else "object_store")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} must be one of {TRANSPORTS}")
    if transport == "broadcast":
        if sync is None:
            raise RuntimeError("transport='broadcast' needs a broadcast group: call init_weight_sync() first")
        sync.update_weights(source, version, mode)
        return
    with service_calls(service):
        get_result(service.update_weights.remote(_update(source, version, mode, transport)))


def _update(source: WeightSource, version: int, mode: str, transport: str) -> WeightUpdate:
    """The message of an object-store or checkpoint update (an object-store update puts the data once)."""
    if transport == "checkpoint":
        if not isinstance(source, (str, Path)):
            raise ValueError(f"transport='checkpoint' needs a directory path, got {type(source).__name__}")
        path = Path(source).expanduser().resolve()  # workers do not share this process's working directory
        return WeightUpdate(version=version, mode=mode, transport=transport, tensors=checkpoint_tensors(path),
                            path=str(path), stamp=checkpoint_stamp(path))
    state = check_state_dict(source)
    return WeightUpdate(version=version, mode=mode, transport=transport, tensors=describe(state),
                        arrays=ray.put(to_numpy(state)))


class WeightSync:
    """A broadcast group between this process (rank 0, serving the group's TCP store) and every worker of a
    service (ranks 1..W), formed once by `open`. Each `update_weights` sends the metadata (names, shapes,
    dtypes, bucket layout) in one Ray call per worker and the tensors as flat one-dtype buckets."""

    def __init__(self, service: ActorHandle, store: Any, group: Any, spec: WeightGroup, bucket_bytes: int) -> None:
        self.service, self.store, self.group = service, store, group
        self.spec, self.backend, self.bucket_bytes = spec, spec.backend, bucket_bytes
        self.lock = threading.Lock()  # one update on the group at a time: two threads' buckets would interleave
        self.leaving = threading.Lock()  # the group is left once, by `close` or by the update that ends after it
        self.closed: str | None = None  # why the group was (or is being) left, for the error of a later update

    @classmethod
    def open(cls, service: ActorHandle, *, host: str | None = None, port: int = 0, backend: str | None = None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0,
             replaces: WeightSync | None = None) -> WeightSync:
        """Form the group with every live worker of `service`. This process serves the TCP store and listens
        for its peers on `host` (default: this node's Ray address; 127.0.0.1 under an embedded local Ray),
        `port` 0 picks a free port. `backend` defaults to "nccl" for CUDA engines and "gloo" otherwise. A
        collective that waits longer than `timeout_s` fails. The group this one `replaces` is closed once the
        options are accepted (a refused one leaves it working), before this one takes its port."""
        check_bucket_bytes(bucket_bytes)
        check_group_options(host, port, timeout_s)
        host = host or ray.util.get_node_ip_address()
        if port and (replaces is None or (replaces.spec.host, replaces.spec.port) != (host, port)):
            check_port_free(host, port)  # the port of the group replaced is free once that group is closed
        with service_calls(service):
            world_size, backend = get_result(service.weight_group_spec.remote(backend))
            if replaces is not None:
                replaces.close()
            store = host_store(host, port, timeout_s)
            spec = WeightGroup(host, store.port, world_size, backend, timeout_s)
            joined = service.join_weight_group.remote(spec)
            group = open_group(store, 0, world_size, backend, host, timeout_s)  # returns once every worker joined
            get_result(joined)
        return cls(service, store, group, spec, bucket_bytes)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "continue") -> None:
        """Broadcast `state_dict` as policy `version`; returns once every worker holds it. Tensors the engines
        refuse raise ValueError before anything is sent. Updates from several threads go one after another."""
        version = check_update(version, mode)
        tensors = describe(check_state_dict(state_dict))
        update = WeightUpdate(version=version, mode=mode, transport="broadcast", tensors=tensors,
                              buckets=plan_buckets(tensors, self.bucket_bytes), group=self.spec)
        try:
            with self.lock, service_calls(self.service):
                if self.closed:
                    raise RuntimeError(f"{self.closed}; call init_weight_sync() again before a broadcast update")
                _refuse_tied_conflicts(state_dict, get_result(self.service.check_weights.remote(update)))
                applied = self.service.update_weights.remote(update)
                device = group_device(self.backend)
                try:
                    for bucket in update.buckets:
                        broadcast(self.group, pack(state_dict, tensors, bucket, device))
                except BaseException as err:  # Ctrl-C too: the workers must not take the next update's buckets
                    self.closed = f"an earlier broadcast update failed part way ({err!r})"
                    self._leave()  # before `_outcome`: the workers waiting for buckets fail at once, peer gone
                    traceback.clear_frames(err.__traceback__)  # a frame of `broadcast` may still hold the group
                    err.add_note(f"the broadcast of version {version} stopped part way: {_outcome(applied)}; "
                                 "call init_weight_sync() again before the next broadcast update")
                    raise
                get_result(applied)
        finally:
            if self.closed:  # `close` ran while this update did: the group is left now that it is done
                self._leave()

    def close(self) -> None:
        """Leave the group, freeing its communicators (when `init_weight_sync` forms a new one, or at shutdown);
        later updates through this object raise. An update in flight in another thread is not waited for (a
        "finish" update waits for the samples started before it; shutdown must not): it leaves the group as it
        ends, and torch cannot abort a group under a gloo broadcast anyway."""
        self.closed = self.closed or "this broadcast group was closed (by init_weight_sync() or shutdown)"
        if self.lock.acquire(blocking=False):  # no update in flight, and any later one sees `closed`
            self.lock.release()
            self._leave()

    def _leave(self) -> None:
        """Free the group's communicators, once. After a broadcast failed part way, the workers still waiting
        for its buckets then fail at once (their peer is gone) and keep their weights, rather than take a later
        update's buckets as the rest of this one, or wait `timeout_s`."""
        with self.leaving:
            group, self.group, self.store = self.group, None, None
        close_group(group)


def _refuse_tied_conflicts(state: Mapping[str, torch.Tensor], tied: list[list[str]]) -> None:
    """ValueError, before a byte is sent, where `state` gives names the engines tie into one tensor (`tied`,
    from the service's check) different values; the workers could only find it once they hold every bucket."""
    problems = tied_conflicts(tied, state)
    if problems:
        raise ValueError(f"weights refused, nothing was changed: {'; '.join(problems)}")


def _outcome(applied: ray.ObjectRef) -> str:
    """What the service says of an update whose broadcast stopped: the workers' receive fails at once once
    the trainer has left the group, and they keep their weights."""
    try:
        get_result(applied)
    except Exception as err:  # noqa: BLE001 - reported in the note of the error that stopped the broadcast
        return f"the service reports {err!r}"
    return "every worker received it all and holds it"
