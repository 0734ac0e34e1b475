"""Weights updates between two steps: new policy weights are validated, the samples already started settled
as the update's mode says, and the weights copied in place under their version.

The step in flight is collected first (its tokens are the old weights'), and every prompt still in prefill
restarts, so that no context is computed partly under each. KV computed before is never matched by later
prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

import torch

from rollout.params import WeightSource, check_update
from workers.engine.weights import check_weights, copy_weights, load_source, tied_sources

if TYPE_CHECKING:
    from workers.engine.engine import Engine

Rows = Callable[[list[dict]], None]


def swap_weights(engine: Engine, source: WeightSource, version: int, mode: str = "continue",
                 on_rows: Rows | None = None) -> list[dict]:
    """Swap `engine`'s weights for those of `source` (a state dict or a safetensors checkpoint directory).

    `mode` decides what happens to samples already started: "continue" (they go on under the new
    weights), "abort" (they end now, finish_reason "abort"), "finish" (they finish on the old
    weights first). Returns the rows of samples that ended meanwhile, or, with `on_rows`, hands
    them to it as they end (each step of a "finish" drain) and returns []; unstarted requests stay
    queued and run on the new weights, and so does a prompt still in prefill, computed again.
    """
    version = check_update(version, mode)
    pairs = check_weights(engine.runner.model, load_source(source), checkpoint=not isinstance(source, Mapping))
    rows: list[dict] = []
    emit = on_rows or rows.extend
    try:
        engine._collect()  # the tokens of the step in flight are the old weights'
        emit(engine._take_ready())
        engine.scheduler.restart_prefills()
        if mode == "abort":
            emit(engine._abort([s for s in engine.scheduler.sequences() if s.started]))
        elif mode == "finish":
            _drain(engine, emit)
    except BaseException:  # Ctrl-C in a drain: the rows of samples ended so far come from the next step
        engine.ready[:0] = rows
        raise
    try:
        copy_weights(pairs)
    finally:  # a Ctrl-C comes once every tensor is copied: they are this version's
        engine.policy_version = version
        engine.scheduler.roots.weights_changed()
    return rows


def _drain(engine: Engine, emit: Rows) -> None:
    """Step until every started sample has finished, admitting nothing new; each step's rows go to `emit`."""
    with engine.scheduler.started_only():
        while engine.in_flight or any(s.started for s in engine.scheduler.sequences()):
            emit(engine.step())


def validate_source(model: torch.nn.Module, source: WeightSource, checkpoint: bool = False) -> list[list[str]]:
    """Raise the ValueError `swap_weights` would (names, shapes, dtypes); copies nothing. Tensors on the
    "meta" device are enough; with `checkpoint` they stand for a checkpoint directory's. Returns the groups of
    given names that the model ties into one tensor, whose values only the sender can compare."""
    state = load_source(source)
    check_weights(model, state, values=False, checkpoint=checkpoint or not isinstance(source, Mapping))
    return tied_sources(model, state)
