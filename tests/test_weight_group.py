"""A worker's member of the broadcast group: joining a new group closes the old one first (its communicators
freed at once: NCCL's hold GPU memory), and closing asks torch to abort the group, pending work included."""

from __future__ import annotations

from workers import weight_receiver
from workers.messages import WeightGroup
from workers.weight_group import close_group
from workers.weight_receiver import WeightReceiver


def test_joining_anew_closes_the_old_group(monkeypatch):
    opened, closed = [], []
    monkeypatch.setattr(weight_receiver, "join_store", lambda host, port, timeout_s: object())
    monkeypatch.setattr(weight_receiver, "open_group", lambda *args: opened.append(object()) or opened[-1])
    monkeypatch.setattr(weight_receiver, "close_group", closed.append)
    receiver = WeightReceiver(loop=None)
    spec = WeightGroup("127.0.0.1", 1, 2, "gloo", 5.0)
    receiver.join(spec, 1, "127.0.0.1")
    receiver.join(spec, 1, "127.0.0.1")
    assert closed == [None, opened[0]] and receiver.group is opened[1]


def test_close_group_aborts_the_group_where_torch_can():
    class Group:
        aborted = 0

        def abort(self) -> None:
            self.aborted += 1
    group = Group()
    close_group(group)
    close_group(None)
    close_group(object())  # gloo before torch 2.7: no abort, only dropped
    assert group.aborted == 1
