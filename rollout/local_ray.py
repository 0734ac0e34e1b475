"""The embedded Ray: a private instance on this machine with every listener on 127.0.0.1 and token
authentication with a token of its own."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import ray
from ray._common.network_utils import is_localhost, parse_address
from ray._private import auto_init_hook, ray_constants, services
from ray._private.utils import get_ray_address_file
from ray._raylet import AuthenticationTokenLoader, Config
from ray.actor import ActorHandle
from ray.exceptions import RayTaskError

from rollout.config import ServiceConfig
from rollout.held_signals import default_sigterm_again, exit_on_sigterm, signals_held
from rollout.service_lost import connection


def start_local_ray(config: ServiceConfig) -> None:
    """Start a private Ray instance for the embedded service: no dashboard, a bounded object store, enough
    CPUs for the configured workers, listeners on 127.0.0.1 only (never joins a running cluster), and
    token authentication with a fresh random token (see `_private_token`)."""
    _save_callers_settings()
    _loopback_only()
    _private_token()
    workers = config.num_workers or 1
    options = dict(address="local", include_dashboard=False, namespace=config.namespace,
                   num_cpus=max(os.cpu_count() or 1, math.ceil(workers * config.cpus_per_worker)),
                   object_store_memory=int(config.object_store_memory_gib * 2**30), _temp_dir=_private_temp_dir())

    def start() -> None:
        with _no_failure_signal_handler():
            ray.init(**options)
        _started.append(connection())

    _in_lasting_thread(start)


def _in_lasting_thread(start: Callable[[], object]) -> None:
    """Run `start` in a thread that lasts until `stop_local_ray`, with this thread's signals held meanwhile
    (`signals_held`): Ray's processes die with the thread that started them (PR_SET_PDEATHSIG), and the
    caller's thread may end long before the service does."""
    done, keep, errors = threading.Event(), threading.Event(), []

    def run() -> None:
        try:
            start()
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(err)
        done.set()
        keep.wait()

    _keepers.append(keep)
    quiet = logging.getLogger("ray._private.worker")
    quiet.addFilter(_not_the_sigterm_warning)  # off the main thread Ray sets none; `exit_on_sigterm` sets its like
    exit_on_sigterm()
    try:
        with signals_held():
            threading.Thread(target=run, name="rollout-local-ray", daemon=True).start()
            done.wait()
    finally:
        quiet.removeFilter(_not_the_sigterm_warning)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def _no_failure_signal_handler() -> Iterator[None]:
    """Keep Ray's C++ failure-signal handler out of this process while `ray.init` starts its core worker: it
    took SIGTERM from `signals_held`'s handler (a SIGTERM then printed a stack dump and aborted) and SIGSEGV from
    Python's faulthandler. Ray's own processes keep theirs."""
    saved = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", False)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved


def _not_the_sigterm_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set")


def _private_temp_dir() -> str:
    """A directory for Ray's session (its sockets and logs) that only this user can enter. Ray makes the one it
    is given, and its default /tmp/ray, writable by everyone: there any local user could read the logs and put
    a socket of theirs in place of the object store's. So it is the child of a fresh 0700 directory."""
    parent = tempfile.mkdtemp(prefix="rollout-ray-", dir=os.environ.get("RAY_TMPDIR", "/tmp"))
    _private_dirs.append(parent)
    return os.path.join(parent, "ray")


def stop_local_ray() -> None:
    """Stop the Ray that `start_local_ray` started and restore the caller's authentication and cluster
    settings (a later driver of this process may join a cluster elsewhere). A Ray joined since, after a
    `ray.shutdown()` of the caller's, is left running, with the settings it started under (its token)."""
    with signals_held():
        if ray.is_initialized() and connection() in _started:
            ray.shutdown()
        _started.clear()
        while _keepers:
            _keepers.pop().set()
        while _private_dirs:
            shutil.rmtree(_private_dirs.pop(), ignore_errors=True)
        if not ray.is_initialized():
            _restore_callers_settings()
    default_sigterm_again()


def _restore_callers_settings() -> None:
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()
    if _saved_cluster_flag:
        ray_constants.ENABLE_RAY_CLUSTER = _saved_cluster_flag.pop()
    _reload_auth()


def _stop_at_exit() -> None:
    """At exit without `stop_local_ray` (a script that never called rollout.shutdown(), or raised before it),
    stop the local Ray and remove its session directories, which would otherwise stay in /tmp for good. It
    runs before Ray's own exit hook (registered earlier, when Ray was imported), which then has nothing to do."""
    if _private_dirs:
        no_ray_after_exit()
        stop_local_ray()


def no_ray_after_exit() -> None:
    """At exit, once the embedded Ray stops, a Ray call (a thread still reading a stream) fails rather than
    start a Ray of Ray's own (`ray.init` behind the caller's back: in /tmp/ray, with a dashboard)."""
    auto_init_hook.enable_auto_connect = False


atexit.register(_stop_at_exit)


def join_cluster(address: str, namespace: str) -> None:
    """Join the cluster at `address` ("auto": RAY_ADDRESS, or the head node `ray start` left on this
    machine; never some other process's Ray found running, as Ray's own "auto" would) as a driver.
    A cluster on 127.0.0.1 is joined on 127.0.0.1: otherwise Ray rewrites the address to this machine's
    IP, where nothing listens, and retries for ever."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _address_left_by_ray_start()
        if not address:
            raise ConnectionError("no Ray cluster to join: RAY_ADDRESS is unset and no head node was started on "
                                  "this machine with `ray start --head`; pass its address (HOST:PORT)")
    if address.startswith("ray://"):
        raise ValueError(f"address {address!r} is a Ray Client address, whose connections cannot carry the service's "
                         "streams: run this on a node of the cluster and join it as a driver (HOST:PORT or 'auto')")
    try:
        resolved = services.get_ray_address_from_environment(address, None)
        host, port = parse_address(resolved) if resolved not in (None, "auto", "local") else (None, None)
    except Exception:  # no cluster found, or a malformed address: ray.init says which, below
        host = port = None
    if host and is_localhost(host):
        _loopback_only()
    if host and str(port).isdigit():
        _check_listening(address, host, int(port))
    with _no_failure_signal_handler():
        ray.init(address=address, namespace=namespace)


def _check_listening(address: str, host: str, port: int) -> None:
    """ConnectionError naming `address` when nothing accepts a connection at `host:port` within `HEAD_WAIT_S`
    (a head node still starting gets that long), ValueError when what accepts it answers HTTP (`_refuse_http`):
    Ray would retry for many minutes, or for ever, printing only warnings."""
    deadline = time.monotonic() + HEAD_WAIT_S
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1))
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"no Ray cluster at {address!r}: nothing accepts connections at "
                                      f"{host}:{port} ({err.strerror or err}); is the head node running?") from None
            time.sleep(0.5)
            continue
        with conn:
            return _refuse_http(address, conn)


def _refuse_http(address: str, conn: socket.socket) -> None:
    """ValueError when the listener on `conn` answers HTTP/1: the dashboard's address (what `ray job submit`
    takes), where Ray would retry for ever. The GCS speaks gRPC (HTTP/2), which never answers so."""
    try:
        conn.settimeout(2.0)
        conn.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
        reply = conn.recv(8)
    except OSError:
        return
    if reply.startswith(b"HTTP/1."):
        raise ValueError(f"{address!r} answers HTTP: it is the Ray dashboard's address (for `ray job submit`), not "
                         "the cluster's; give the head node's GCS address, HOST:PORT of `ray start --head --port` "
                         "(default 6379)")


def _address_left_by_ray_start() -> str | None:
    """The address `ray start --head` wrote in Ray's temp directory, trusted only from a file of this user that
    nobody else may write: that directory is writable by every local user, and one could point this driver,
    and the cluster token it sends, at a server of theirs."""
    path = get_ray_address_file(None)
    try:
        with open(path) as file:
            stat = os.fstat(file.fileno())
            if stat.st_uid != os.getuid() or stat.st_mode & 0o022:
                raise ConnectionError(f"{path} is not this user's own file (owner uid {stat.st_uid}, mode "
                                      f"{stat.st_mode & 0o777:o}), so the head address in it is not trusted; pass "
                                      "the cluster's address (HOST:PORT) or set RAY_ADDRESS")
            return file.read().strip() or None
    except FileNotFoundError:
        return None


def _loopback_only() -> None:
    """Keep this process's Ray, and every process it starts, on 127.0.0.1."""
    # Ray reads this variable when it is imported (too late to set it here for this process, so the flag
    # it sets is overridden too); the processes it starts read it from the environment.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


HEAD_WAIT_S = 10.0  # how long join_cluster waits for a connection to the head node's GCS port
_private_dirs: list[str] = []  # Ray's session directories of start_local_ray, removed by stop_local_ray
_started: list[tuple[str, str]] = []  # the Ray connection of start_local_ray, which stop_local_ray shuts down
_keepers: list[threading.Event] = []  # set by stop_local_ray: the threads that started Ray may end
# the caller's values of what this module changes, restored by stop_local_ray
_SAVED_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
_saved_env: dict[str, str | None] = {}
_saved_cluster_flag: list[bool] = []


def _save_callers_settings() -> None:
    """Keep the caller's settings before `start_local_ray` changes them (once until `stop_local_ray`; a driver
    that joins a cluster on 127.0.0.1 keeps `_loopback_only` for as long as it runs)."""
    if not _saved_env:
        _saved_env.update({name: os.environ.get(name) for name in _SAVED_ENV})
        _saved_cluster_flag[:] = [ray_constants.ENABLE_RAY_CLUSTER]


def _private_token() -> None:
    """Turn on token authentication with a random token of this instance only, held in this process's
    environment (which Ray's processes inherit), instead of ~/.ray/auth_token, which Ray would create
    readable by everyone and share with every other Ray of this user. RAY_AUTH_TOKEN beats any token file."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _reload_auth()


def _reload_auth() -> None:
    """Make this process's Ray re-read the authentication mode and token from the environment."""
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


NAME_RELEASE_S = 60.0  # how long a killed actor's name may stay taken


def named_actor(name: str, namespace: str) -> ActorHandle | None:
    """The live actor of this name in `namespace`, or None (Ray frees a name some time after a kill)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def get_result(ref: ray.ObjectRef) -> Any:
    """`ray.get`, raising the original error of a failed worker or service call rather than Ray's wrapper."""
    try:
        return ray.get(ref)
    except RayTaskError as err:
        cause: BaseException = err
        while isinstance(cause, RayTaskError) and cause.cause is not None:
            cause = cause.cause
        raise cause from None
