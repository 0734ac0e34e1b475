"""The broadcast group of weight updates: a torch.distributed process group (gloo on CPU, NCCL on GPU) built
directly on a TCP store, outside torch's default group, so that a trainer already running its own
`init_process_group` (FSDP, DDP) is not disturbed. Rank 0 (the trainer) hosts the store. Every listener binds
the address given, never all interfaces. Ray-free."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.messages import BACKENDS

MAX_TIMEOUT_S = 1e9  # about 31 years; torch takes a store's timeout as a timedelta, which overflows above 8.6e13 s


def check_group_options(host: str | None, port: int, timeout_s: float) -> None:
    """ValueError naming the first bad option of a group rank 0 would host: a port outside [0, 65535], a timeout
    that is not a positive number of seconds, or a host this machine cannot listen on (checked by binding a free
    port there, so that a refused group leaves the one it would replace alone)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an int in [0, 65535] (0 picks a free port)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}")
    if host is None:
        return
    if not isinstance(host, str) or not host:
        raise ValueError(f"host={host!r} must be an address (a non-empty str) or None")
    try:
        socket.create_server((host, 0)).close()
    except OSError as err:
        raise ValueError(f"host={host!r} is not an address this machine can listen on: {err}") from None


def check_port_free(host: str, port: int) -> None:
    """ValueError naming `port` when this machine cannot listen on `host:port` now (another listener holds it)."""
    try:
        socket.create_server((host, port)).close()
    except OSError as err:
        raise ValueError(f"port={port} cannot be listened on at {host}: {err.strerror or err}") from None


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The group's TCP store, served by this process on `host:port` (0 picks a free port; `.port` tells it)."""
    listener = socket.create_server((host, port))
    # TCPStore binds every interface when it opens the port itself; handing it a bound socket keeps it on host.
    # Its libuv backend, the default, takes a socket from torch 2.8 on; before, only the older backend does.
    return dist.TCPStore(host, listener.getsockname()[1], None, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.detach(),
                         use_libuv=torch.__version__ >= "2.8")


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store that rank 0 serves on `host:port`."""
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def open_group(store: dist.Store, rank: int, world_size: int, backend: str, host: str,
               timeout_s: float) -> dist.ProcessGroup:
    """This process's member of the group; returns once all `world_size` ranks have joined. `host` is the
    address this process listens on for its peers (gloo; NCCL picks its own interfaces)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA and a torch build with NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")


def close_group(group: dist.ProcessGroup | None) -> None:
    """Free a group's communicators now rather than whenever it is collected (an NCCL communicator holds GPU
    memory outside torch's allocator); without waiting for an operation still pending. Nothing for None, or
    where torch gives the group no `abort` (gloo before torch 2.7)."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        abort()


def group_device(backend: str) -> torch.device:
    """Where the tensors of a collective must live: the current GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from rank 0 to every rank, and wait until it is done (on a GPU too, so
    that another thread may use the tensor next)."""
    group.broadcast(tensor, 0).wait()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
