"""The service's weight updates, with a stand-in worker pool: an update that fails on some workers only says
which version each worker now holds (each row's policy_version stays true; the trainer must know to update
again), and the failed update is not kept as the replay source of replacement workers; a checkpoint's stamp
is checked by replays only. The weight keeper, with stand-ins for Ray: what it recalls, and how it is started."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorAlreadyExistsError

from rollout import weight_keeper
from rollout.config import EngineConfig, ServiceConfig
from rollout.weight_keeper import WeightKeeper, start_keeper
from rollout.weight_updates import WeightUpdates
from workers.messages import TensorMeta, WeightUpdate

CONFIG = ServiceConfig(engine=EngineConfig(model="unused", device="cpu"))


class Pool:
    """Two workers on version 1; an update reaches worker 0 and fails on worker 1."""

    def __init__(self, stats_fail: bool = False, fail: bool = True) -> None:
        self.workers = {0: "worker-0", 1: "worker-1"}
        self.versions = {0: 1, 1: 1}
        self.stats_fail, self.fail, self.sent = stats_fail, fail, []

    async def call_any(self, method: str, *args: object) -> None:
        return None

    async def call_all(self, method: str, *args: object) -> dict[int, dict]:
        if method == "update_weights":
            self.sent.append(args[0])
            self.versions[0] = args[0].version
            if self.fail:
                raise OSError("worker 1: the checkpoint is not readable")
        if self.stats_fail:
            raise TimeoutError("stats")
        return {worker: {"policy_version": v} for worker, v in self.versions.items()}


def update(version: int, stamp: list | None = None) -> WeightUpdate:
    return WeightUpdate(version=version, mode="continue", transport="checkpoint", tensors=[], path="/ckpt",
                        stamp=stamp or [])


def test_an_update_failed_on_one_worker_names_the_versions_held():
    updates = WeightUpdates(CONFIG)
    with pytest.raises(OSError, match="not readable") as err:
        asyncio.run(updates.apply(Pool(), update(2)))
    assert err.value.__notes__ == ["version 2 reached workers [0] of [0, 1] (versions held: {0: 2, 1: 1}); "
                                   "update again to bring every worker to one version"]
    assert updates.latest is None


def test_the_note_says_when_the_versions_are_unknown():
    with pytest.raises(OSError) as err:
        asyncio.run(WeightUpdates(CONFIG).apply(Pool(stats_fail=True), update(2)))
    assert err.value.__notes__ == ["the workers' versions are unknown (TimeoutError('stats'))"]


def test_only_a_replay_checks_the_checkpoints_stamp():
    """Workers load a live checkpoint update at once, unchecked (a shared filesystem may show them stale
    attributes of a reused directory); the replay kept for replacements carries the stamp they check."""
    updates, pool, stamp = WeightUpdates(CONFIG), Pool(fail=False), [("model.safetensors", 10, 5)]
    asyncio.run(updates.apply(pool, update(2, stamp)))
    assert [sent.stamp for sent in pool.sent] == [[]]
    assert updates.latest.stamp == stamp and updates.latest.version == 2


def test_a_replacement_gets_the_latest_weights_before_it_takes_work():
    """A fresh worker is admitted to routing only once it holds the latest update: admitted first, it could
    make samples of a call in flight with the model's own weights."""
    updates, events = WeightUpdates(CONFIG), []
    updates.latest = update(2)

    async def update_weights(sent: WeightUpdate) -> None:
        events.append(("update", sent.version))

    handle = SimpleNamespace(update_weights=SimpleNamespace(remote=update_weights))
    asyncio.run(updates.replay(handle, lambda: events.append("admit")))
    assert events == [("update", 2), "admit"]


def test_the_keeper_replays_the_latest_update_and_a_broadcasts_exported_copy():
    """A restarted service recalls the newest update kept, never an older one; a broadcast's replay source is
    the worker's exported copy as an object-store update of that version (its buckets are of the broadcast)."""
    keeper, meta = WeightKeeper(), [TensorMeta("w", "float32", [2])]
    assert keeper.recall() is None
    keeper.keep(update(2))
    keeper.keep(update(3))
    assert keeper.recall() == update(3)

    async def exported_tensors() -> list[TensorMeta]:  # the first of export_weights' two ObjectRefs
        return meta

    worker = SimpleNamespace(export_weights=SimpleNamespace(remote=lambda: (exported_tensors(), "arrays-ref")))
    broadcast = WeightUpdate(version=4, mode="continue", transport="broadcast", tensors=[], buckets=[[0]])
    kept = asyncio.run(keeper.keep_export(worker, broadcast))
    assert kept == WeightUpdate(version=4, mode="continue", transport="object_store", tensors=meta, arrays="arrays-ref")
    assert keeper.recall() is kept


@pytest.mark.parametrize("held_s, started", [(0.4, True), (61.0, False)])
def test_a_new_keeper_waits_for_the_killed_ones_name(monkeypatch, held_s, started):
    """Ray releases a killed keeper's name shortly after the kill: start_keeper tries again every 0.2 s while the
    name is held, for up to 60 s, then raises Ray's error."""
    clock = [0.0]

    def create() -> str:
        if clock[0] < held_s:
            raise ActorAlreadyExistsError("CONFIG-weights")
        return "keeper"

    actor = SimpleNamespace(options=lambda **options: SimpleNamespace(remote=create))
    monkeypatch.setattr(weight_keeper, "stop_keeper", lambda config: None)
    monkeypatch.setattr(weight_keeper.ray, "remote", lambda cls: actor)
    monkeypatch.setattr(weight_keeper, "time", SimpleNamespace(
        monotonic=lambda: clock[0], sleep=lambda seconds: clock.__setitem__(0, clock[0] + seconds)))
    if started:
        assert start_keeper(CONFIG) == "keeper" and clock[0] == pytest.approx(0.4)
    else:
        with pytest.raises(ActorAlreadyExistsError):
            start_keeper(CONFIG)
        assert 60 < clock[0] <= 60.2 + 1e-9
