"""The embedded API: `rollout.init`, `rollout.sample`, `rollout.update_weights`, `rollout.init_weight_sync`,
`rollout.shutdown` (loaded lazily by `rollout`)."""

from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from rollout.config import LOCAL_CONFIG, ServiceConfig, load_service_config
from rollout.local_ray import no_ray_after_exit, start_local_ray, stop_local_ray
from rollout.params import WeightSource, check_prompt_list
from rollout.service import launch, stop
from rollout.service_lost import calls_refused, reached, wait_for_calls
from rollout.stream import RolloutStream, open_stream, sampling_params
from rollout.weight_sync import WeightSync, push_weights

__all__ = ["init", "sample", "update_weights", "init_weight_sync", "shutdown", "RolloutStream"]

_service: ActorHandle | None = None
_owns_ray = False  # True when init started the local Ray, which shutdown then stops
_weight_sync: WeightSync | None = None  # init_weight_sync's group, for update_weights(transport="broadcast")
_lock = threading.RLock()  # one init (explicit, or the first sample's) at a time
_shut_down = False  # True once shutdown stopped a service: a later sample does not start another by itself
_SHUT_DOWN = "rollout was shut down; call rollout.init(...) to start it again"


def init(config: str | Path | ServiceConfig = LOCAL_CONFIG, **overrides: Any) -> None:
    """Start the service from a TOML path or a `ServiceConfig` plus field overrides (engine fields such as
    `model` or `dtype` may be given at top level). Without a running Ray it starts a local one on
    127.0.0.1; inside an initialised Ray (e.g. a Ray job) it starts the workers there."""
    global _service, _owns_ray, _shut_down
    with _lock:
        if _service is not None:
            raise RuntimeError("rollout is already initialised; call rollout.shutdown() first")
        _shut_down = False
        config = load_service_config(config, **overrides)
        if not ray.is_initialized():
            if not (Path(config.engine.model) / "config.json").is_file():
                raise ValueError(f"engine.model={config.engine.model!r} is not a model directory (no config.json); "
                                 "pass rollout.init(model=DIR) (`--model DIR` on the command line), or run "
                                 "`rollout demo` once to build the tiny default")
            if config.placement_strategy == "STRICT_SPREAD" and (config.num_workers or 1) > 1:
                raise ValueError(f"placement_strategy='STRICT_SPREAD' puts each of num_workers={config.num_workers} "
                                 "workers on a node of its own; the embedded local Ray is one node")
            _owns_ray = True
        try:
            if _owns_ray:
                start_local_ray(config)
            _check_local_gpus(config)
            _service = reached(launch(config))
        except BaseException:
            shutdown()
            raise


def _check_local_gpus(config: ServiceConfig) -> None:
    """An embedded Ray gets no more GPUs than this machine has: fail now rather than wait for placement."""
    if not (_owns_ray and config.engine.device.startswith("cuda")):
        return
    wanted = config.num_workers or 1
    have = int(ray.cluster_resources().get("GPU", 0))
    if have < wanted:
        raise ValueError(f"engine.device={config.engine.device!r} with num_workers={config.num_workers} needs "
                         f"{wanted} GPUs; this machine has {have}")


def sample(prompts: list[str] | list[list[int]], n: int = 8, *, progress: bool = False,
           **sampling: Any) -> RolloutStream:
    """Stream `n` samples of each prompt (token-id lists or strings) as record batches; the keywords are
    `SamplingParams` fields. The first call without `init` starts the service of configs/local.toml."""
    params = sampling_params(n, sampling)
    check_prompt_list(prompts)
    with _lock:
        if _service is None and _shut_down:
            raise RuntimeError(_SHUT_DOWN)
        if _service is None:
            init()
        service = _service
    return open_stream(service, prompts, params, progress)


def update_weights(source: WeightSource, version: int, mode: str = "continue", *,
                   transport: str | None = None) -> None:
    """Hot-swap the policy weights of every worker; returns once all hold `version`. `source` is a state dict
    (sent through Ray's object store) or a checkpoint directory of safetensors on shared disk;
    `transport="broadcast"` sends a state dict over the group of `init_weight_sync`. `mode`: "continue",
    "abort" or "finish" (what happens to samples already started). See `rollout.weight_sync.push_weights`."""
    push_weights(_running_service(), source, version, mode, transport, _weight_sync)


def init_weight_sync(**options: Any) -> WeightSync:
    """Form a torch.distributed broadcast group between this process (rank 0) and every worker, used by
    later `update_weights(..., transport="broadcast")` calls; returns its `WeightSync` (options: see
    `WeightSync.open`: host, port, backend, bucket_bytes, timeout_s)."""
    global _weight_sync
    _weight_sync = WeightSync.open(_running_service(), replaces=_weight_sync, **options)
    return _weight_sync


def _running_service() -> ActorHandle:
    if _service is None:
        raise RuntimeError(_SHUT_DOWN if _shut_down else "rollout is not initialised; call rollout.init(...) first")
    return _service


def shutdown() -> None:
    """Stop the service's actors, and the local Ray if `init` started it. Calls other threads wait on meanwhile,
    and later reads of open streams, raise `ServiceUnavailable`; later `sample`, `update_weights` and
    `init_weight_sync` raise `RuntimeError` until `init` runs again."""
    global _service, _owns_ray, _weight_sync, _shut_down
    with _lock, calls_refused():
        if _weight_sync is not None:
            _weight_sync.close()
        _weight_sync = None
        if _service is not None:
            stop(_service)
            _service, _shut_down = None, True
        wait_for_calls()
        if _owns_ray:
            stop_local_ray()
            _owns_ray = False


def _shutdown_at_exit() -> None:
    """At exit without `shutdown` (a script that never called it, or raised before it): shut down as `shutdown`
    does, so that threads still calling the service (a trainer's prefetching) are refused before Ray stops; one
    calling Ray after it had stopped made Ray's C++ end the process before the session directory was removed.
    It runs before `local_ray`'s exit hook, registered when that module was imported, which then has nothing
    to do."""
    if _owns_ray:
        no_ray_after_exit()
    if _service is not None or _owns_ray:
        shutdown()


atexit.register(_shutdown_at_exit)
