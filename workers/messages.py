"""Messages between a trainer, the service and its workers (msgspec structs in an importable module, so Ray can
pickle them)."""

from __future__ import annotations

from typing import Any

import msgspec


class PromptGroup(msgspec.Struct, frozen=True):
    """One prompt of a call and the sample indices a worker must produce for it (all of range(n), or the
    ones a dead worker still owed)."""

    prompt_index: int
    token_ids: list[int]
    sample_indices: list[int]
    repeat: int = 0  # which copy of an identical prompt of the call (rollout.params.prompt_repeats)


class Caller(msgspec.Struct, frozen=True):
    """The process that made a `sample` call (hex Ray ids of its job and worker: a driver, or an actor or task),
    so that the service can abort the call when that process dies."""

    job_id: str
    worker_id: str


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """Name, dtype (torch's name, e.g. "bfloat16") and shape of one tensor of a weight update."""

    name: str
    dtype: str
    shape: list[int]


TRANSPORTS = ("object_store", "checkpoint", "broadcast")


class WeightGroup(msgspec.Struct, frozen=True):
    """Where the broadcast group of a trainer (rank 0) and the workers (ranks 1..world_size-1) meets: the
    trainer's TCP store, the torch.distributed backend ("gloo" or "nccl"), the collectives' timeout."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


class WeightUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """One policy update as the service and its workers see it: the new version, what happens to samples
    already started (`mode`), every tensor's metadata, and where the data comes from (`transport`):
    `arrays`, an ObjectRef of {name: numpy array} ("object_store"); `path`, a directory of *.safetensors
    on shared disk ("checkpoint"); or the flat buckets the trainer broadcasts, each a list of indices into
    `tensors` of one dtype ("broadcast") over `group`, the group the trainer formed. A checkpoint's `stamp`
    (each file's name, size and modification time in ns, when the update was sent) is kept for replays only: a
    worker that loads the directory later (a replacement) refuses it if rewritten since. Live updates skip it:
    a shared filesystem may show another node's stale attributes of a reused directory for a while (NFS
    caches them up to a minute), which would refuse a rewrite that is this very update."""

    version: int
    mode: str
    transport: str
    tensors: list[TensorMeta]
    arrays: Any = None
    path: str | None = None
    buckets: list[list[int]] = []
    group: WeightGroup | None = None
    stamp: list[tuple[str, int, int]] = []


BACKENDS = ("gloo", "nccl")
