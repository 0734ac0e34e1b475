"""The staging buffers' CUDA ordering, emulated on the CPU: a send waits only for a copy that has not landed,
and never for one queued after the step in flight (which would stall async batching for a whole step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.engine.staging import Staging


class _Device:
    """A fake device stream: events complete in the order they were recorded, up to `landed`."""

    def __init__(self) -> None:
        self.recorded = 0
        self.landed = 0
        self.waits: list[int] = []


class _Event:
    """torch.cuda.Event on the fake stream: done once the device has landed its record (or never recorded)."""

    device: _Device

    def __init__(self) -> None:
        self.at = 0

    def record(self) -> None:
        self.device.recorded += 1
        self.at = self.device.recorded

    def query(self) -> bool:
        return self.at <= self.device.landed

    def synchronize(self) -> None:
        self.device.waits.append(self.at)
        self.device.landed = max(self.device.landed, self.at)


@pytest.fixture
def emulated(monkeypatch) -> tuple[Staging, _Device]:
    """A packing Staging that takes its CPU tensors for CUDA ones, over the fake stream."""
    device = _Device()
    monkeypatch.setattr(_Event, "device", device, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: type("S", (), {"synchronize": lambda s: None})())
    staging = Staging(torch.device("cpu"), pack=True)
    staging.cuda = True
    return staging, device


def _send(staging: Staging, value: int) -> None:
    """One send of a small array, checked to arrive whole."""
    out = staging.send({"x": np.full(5, value, np.int64)})
    assert out["x"].tolist() == [value] * 5


def test_a_fork_steps_extra_sends_leave_the_next_step_unblocked(emulated):
    """A step of a recurrent model that forks sends its inputs, then (after its launch) the prompts' state
    copies and the partial blocks' copies: three sends. The next step's inputs must not wait for those copies,
    which are queued behind the step in flight; only the first send's copy has landed when it is prepared."""
    staging, device = emulated
    for step in range(4):
        _send(staging, 10 * step)  # the step's inputs, queued before its forward
        device.landed = device.recorded  # the step before has finished: everything queued so far ran
        _send(staging, 10 * step + 1)  # fork_states, queued behind the step's forward
        _send(staging, 10 * step + 2)  # copy_blocks, behind it too
    assert device.waits == [], f"a send waited for a copy queued behind the step in flight: {device.waits}"


def test_a_send_waits_for_the_oldest_copy_when_every_buffer_is_in_use(emulated):
    """Buffers are bounded: when none is free, a send waits for the oldest copy, never overwriting one unread."""
    staging, device = emulated
    for value in range(40):
        _send(staging, value)
    assert device.waits and len(staging.host) <= 8
    assert all(at <= device.landed for at in device.waits)
