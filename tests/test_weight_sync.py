"""The trainer's `WeightSync`, over a stand-in service (no Ray): `close` (which `rollout.shutdown` and a new
`init_weight_sync` call) does not wait for an update in flight in another thread, which leaves the group as it
ends."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from rollout import weight_sync
from rollout.weight_sync import WeightSync
from workers.messages import WeightGroup


def test_close_leaves_the_group_once_the_update_in_flight_ends(monkeypatch):
    applying, drained, closed = threading.Event(), threading.Event(), []

    def get_result(ref: str) -> None:
        if ref == "applied":  # the service's update: a "finish" drain waits for the samples started before it
            applying.set()
            assert drained.wait(30)

    monkeypatch.setattr(weight_sync, "service_calls", lambda service: contextlib.nullcontext())
    monkeypatch.setattr(weight_sync, "get_result", get_result)
    monkeypatch.setattr(weight_sync, "broadcast", lambda group, tensor: None)
    monkeypatch.setattr(weight_sync, "close_group", closed.append)
    service = SimpleNamespace(check_weights=SimpleNamespace(remote=lambda update: "checked"),
                              update_weights=SimpleNamespace(remote=lambda update: "applied"))
    group = object()
    sync = WeightSync(service, object(), group, WeightGroup("127.0.0.1", 1, 2, "gloo", 5.0), 1 << 20)
    state = {"w": torch.ones(4)}
    update = threading.Thread(target=sync.update_weights, args=(state, 1, "finish"))
    update.start()
    assert applying.wait(30)
    closing = threading.Thread(target=sync.close)
    closing.start()
    closing.join(5)
    try:
        assert not closing.is_alive(), "close() waited for the update in flight"
        assert closed == []  # not aborted under the update
    finally:
        drained.set()
        update.join(30)
    assert closed == [group] and sync.group is None
    sync.close()
    with pytest.raises(RuntimeError, match=r"closed \(by init_weight_sync\(\) or shutdown\); call init_weight_sync"):
        sync.update_weights(state, 2)
    assert [g for g in closed if g is not None] == [group]  # aborted once
