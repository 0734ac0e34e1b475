"""The trainer's `WeightSync`, over a stand-in service (no Ray): `close` (which `rollout.shutdown` and a new
`init_weight_sync` call) does not wait for an update in flight in another thread, which leaves the group as it
ends; bad update arguments, and tied names given two values, are refused before anything is sent."""

from __future__ import annotations

import contextlib
import re
import threading
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from rollout import weight_sync
from rollout.weight_sync import WeightSync
from workers.messages import WeightGroup, WeightUpdate


def stand_in_sync(check: Callable[[WeightUpdate], object], apply: Callable[[WeightUpdate], object],
                  group: object) -> WeightSync:
    """A `WeightSync` on `group` whose service answers `check_weights` with `check` and `update_weights` with
    `apply`."""
    service = SimpleNamespace(check_weights=SimpleNamespace(remote=check), update_weights=SimpleNamespace(remote=apply))
    return WeightSync(service, object(), group, WeightGroup("127.0.0.1", 1, 2, "gloo", 5.0), 1 << 20)


def test_close_leaves_the_group_once_the_update_in_flight_ends(monkeypatch):
    applying, drained, closed = threading.Event(), threading.Event(), []

    def get_result(ref: str) -> list:
        if ref == "applied":  # the service's update: a "finish" drain waits for the samples started before it
            applying.set()
            assert drained.wait(30)
        return []  # the check's: no names tied

    monkeypatch.setattr(weight_sync, "service_calls", lambda service: contextlib.nullcontext())
    monkeypatch.setattr(weight_sync, "get_result", get_result)
    monkeypatch.setattr(weight_sync, "broadcast", lambda group, tensor: None)
    monkeypatch.setattr(weight_sync, "close_group", closed.append)
    group = object()
    sync = stand_in_sync(lambda update: "checked", lambda update: "applied", group)
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


@pytest.mark.parametrize("version, mode, message", [(-1, "continue", "version=-1"), (True, "continue", "version=True"),
                                                    (1, "later", "mode='later'")])
def test_bad_update_arguments_are_refused_before_anything_is_sent(monkeypatch, version, mode, message):
    sent = []
    monkeypatch.setattr(weight_sync, "service_calls", lambda service: contextlib.nullcontext())
    monkeypatch.setattr(weight_sync, "get_result", lambda ref: None)
    monkeypatch.setattr(weight_sync, "broadcast", lambda group, tensor: sent.append("bucket"))
    sync = stand_in_sync(lambda update: sent.append("check"), lambda update: sent.append("apply"), object())
    with pytest.raises(ValueError, match=re.escape(message)):
        sync.update_weights({"w": torch.ones(4)}, version, mode)
    assert sent == []


def test_names_of_one_tied_tensor_given_two_values_are_refused_before_anything_is_sent(monkeypatch):
    """The service's check returns the names the engines tie into one tensor; their values are only here (the
    workers would find them different once they held every bucket)."""
    sent = []
    monkeypatch.setattr(weight_sync, "service_calls", lambda service: contextlib.nullcontext())
    monkeypatch.setattr(weight_sync, "get_result", lambda ref: ref)
    monkeypatch.setattr(weight_sync, "broadcast", lambda group, tensor: sent.append(tensor.clone()))
    sync = stand_in_sync(lambda update: [["embed.weight", "head.weight"]], lambda update: [], object())
    embed = torch.ones(2, 3)
    with pytest.raises(ValueError, match="'embed.weight' and 'head.weight' are one tied tensor in this model, but "
                                         "the update gives them different values"):
        sync.update_weights({"embed.weight": embed, "head.weight": embed + 1}, 1)
    assert sent == []
    sync.update_weights({"embed.weight": embed, "head.weight": embed.clone()}, 1)
    sync.update_weights({"embed.weight": embed, "head.weight": embed}, 2)
    assert len(sent) == 2
