"""`RolloutClient`: a trainer's handle on a service running elsewhere in the Ray cluster."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from rollout.local_ray import get_result, join_cluster, named_actor
from rollout.service_lost import reached, service_calls
from rollout.stream import RolloutStream, open_stream, sampling_params
from rollout.weight_sync import WeightSource, WeightSync, push_weights

FOREVER_S = 1e9  # a wait this long (about 31 years) or longer has no limit: Ray's wait overflows from about 9.2e15 s


class RolloutClient:
    """Samples from a running service (e.g. started by `rollout serve`) and updates its weights exactly like
    `rollout.sample` and `rollout.update_weights`."""

    def __init__(self, service: ActorHandle) -> None:
        self.service = reached(service)
        self.weight_sync: WeightSync | None = None

    @classmethod
    def connect(cls, name: str = "rollout", namespace: str = "rollout", address: str = "auto",
                timeout_s: float = 60.0) -> "RolloutClient":
        """Join the cluster at `address` as a driver (unless Ray is initialised already) and wait up to
        `timeout_s` for the service `namespace/name` to exist and finish loading its engines, also through a
        restart of the service (TimeoutError naming it after that; `math.inf` waits for good; a service that
        failed to load raises its error). An explicit address on a token-auth cluster needs RAY_AUTH_MODE=token in
        the environment."""
        _check_connect(name, namespace, timeout_s)
        if not ray.is_initialized():
            join_cluster(address, namespace)
        deadline = time.monotonic() + timeout_s
        while True:
            service = named_actor(name, namespace)
            if service is None:
                problem = f"no rollout service {name!r} in namespace {namespace!r}"
            elif not all(hasattr(service, method) for method in ("ready", "sample")):
                raise ValueError(f"the actor {name!r} in namespace {namespace!r} is not a rollout service (a service's "
                                 "workers are named '<name>-worker-<i>', its weight keeper '<name>-weights')")
            elif (state := _wait_ready(service, deadline)) is None:
                return cls(service)
            else:
                problem = f"rollout service {name!r} in namespace {namespace!r} {state}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"{problem} after {timeout_s} s")
            time.sleep(0.5)

    def sample(self, prompts: list[str] | list[list[int]], n: int = 8, *, progress: bool = False,
               **sampling: Any) -> RolloutStream:
        """Stream `n` samples of each prompt as record batches; the keywords are `SamplingParams` fields."""
        return open_stream(self.service, prompts, sampling_params(n, sampling), progress)

    def stats(self) -> dict[int, dict]:
        """Engine counters, weights version and outstanding load of every live worker of the service."""
        with service_calls(self.service):
            return get_result(self.service.stats.remote())

    def update_weights(self, source: WeightSource, version: int, mode: str = "continue", *,
                       transport: str | None = None) -> None:
        """Hot-swap the policy weights of every worker; returns once all hold `version` (see
        `rollout.update_weights`; `transport="broadcast"` needs `init_weight_sync` first)."""
        push_weights(self.service, source, version, mode, transport, self.weight_sync)

    def init_weight_sync(self, **options: Any) -> WeightSync:
        """Form the broadcast group between this process (rank 0) and every worker (see
        `rollout.init_weight_sync`); later `update_weights(..., transport="broadcast")` calls use it."""
        self.weight_sync = WeightSync.open(self.service, replaces=self.weight_sync, **options)
        return self.weight_sync


def _check_connect(name: object, namespace: object, timeout_s: object) -> None:
    """ValueError naming the first of `connect`'s arguments that could name no service or bound no wait."""
    for label, value in (("name", name), ("namespace", namespace)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label}={value!r} must be a non-empty str")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0 (math.inf: no limit)")


def _wait_ready(service: ActorHandle, deadline: float) -> str | None:
    """Wait until `deadline` (1 s at least) for `service` to finish loading its engines: None once it has, else
    what kept it. The error of a service that failed to load is raised as it was raised there."""
    ref = service.ready.remote()
    try:
        left = max(deadline - time.monotonic(), 1.0)
        done, _ = ray.wait([ref], timeout=left if left < FOREVER_S else None)
        if not done:
            return "is not ready (its engines are still loading, or it is restarting)"
        get_result(ref)
        return None
    except RayActorError as err:
        if err.actor_id not in (None, service._actor_id.hex()):
            raise  # a worker that died while loading: the service's own error
        return "died or is restarting, and was not back"  # Ray may bring it back under its name
