"""Start-up work once the KV cache exists: warm-up steps that compile the kernels a step can launch before
the first real one, and the capture of the decode graphs. Each start-up phase is timed (`startup_phase`)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from workers.engine.graphs import DecodeGraphs, HostSync
from workers.engine.step_inputs import profile_plan

if TYPE_CHECKING:
    from workers.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@contextmanager
def startup_phase(times: dict[str, float], name: str, device: torch.device) -> Iterator[None]:
    """Record the seconds the block takes as `times[name]`, its device work included."""
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times[name] = time.perf_counter() - start


def warm_up(runner: ModelRunner) -> None:
    """A two-token step through every layer, so a model our attention can't serve fails at load, and
    the kernels of prefill steps are compiled before the first; with per-sequence state, a second that
    continues it (prefill kernels that read a state: fla autotunes them apart, 18 s on an H100); without
    decode graphs (which warm their own), the eager decode kernels too."""
    try:
        tokens = min(2, runner.max_model_len)  # no longer than max_model_len: the rings' table is no wider
        runner.forward(runner.send(profile_plan(tokens, 1, runner.block_size, runner.ring_tokens, 0,
                                                runner.num_blocks)))
        if runner.states is not None:
            context = min(2, runner.max_model_len - tokens)
            runner.forward(runner.send(profile_plan(tokens, 1, runner.block_size, runner.ring_tokens, context,
                                                    runner.num_blocks)))
        if not runner.decode_graphs:
            warm_decode(runner)
    except NotImplementedError as err:
        raise ValueError(f"model {runner.config.model!r} ({runner.model.config.model_type}): {err}") from err


def warm_decode(runner: ModelRunner) -> None:
    """One-token steps that compile each kernel variant an eager decode step can launch."""
    decode = runner.send(profile_plan(1, 1, runner.block_size, runner.ring_tokens))
    for length in runner.backend.decode_warmup_lengths(runner.max_model_len):
        decode.meta.max_seqlen_k = length
        runner.forward(decode)


def capture_graphs(runner: ModelRunner) -> DecodeGraphs | None:
    """The decode graphs; when the model's decode step waits on the host, which a capture refuses, None
    (decode steps run eagerly, their kernels warmed) by default, and ValueError if graphs were asked for."""
    try:
        return DecodeGraphs(runner)
    except HostSync as err:
        if runner.config.cuda_graphs is not None:
            raise ValueError(f"EngineConfig.cuda_graphs={runner.config.cuda_graphs!r}: {err}; use "
                             "cuda_graphs=(False, False) or None") from err
        logger.warning("decode graphs off: %s", err)
        runner.decode_graphs = False
        warm_decode(runner)
        return None
