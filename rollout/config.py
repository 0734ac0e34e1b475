"""Config structs (msgspec), decoded from TOML files or keyword overrides with path-named errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tomllib

from rollout.checks import check_types

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
WINDOWED_KV = ("auto", "window", "full")
MAX_BLOCKS = 2**31 - 1
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies

T = TypeVar("T")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One engine: the model directory, where it runs (`device`: "cpu", "cuda" or "cuda:N"), and the sizes of its
    KV cache and batches.

    `dtype="auto"` is the checkpoint's 16-bit dtype (or bfloat16) on CUDA and float32 on the CPU.
    The KV cache has `num_blocks` blocks of `block_size` tokens (every layer); None sizes it: on CUDA
    to `gpu_memory_utilization` of the card minus the profiled peak of a forward and a sampler pass,
    on the CPU to `kv_cache_memory_gib` (None: a capped share of free memory), which also overrides
    the CUDA rule when set; recurrent layers' per-sequence states come out of the budget too. A step
    computes at most `max_batch_tokens` tokens for at most `max_num_seqs` sequences. `cpu_offload_gib` sizes
    the CPU pool preempted requests are offloaded to (0 = recompute instead; never more blocks than
    `max_num_seqs` sequences of `max_model_len` hold).
    `max_model_len` defaults to the model's `max_position_embeddings` (32768 for a model without one, such
    as Mamba); a longer one is refused at construction. `trust_remote_code` lets transformers run Python
    code shipped with the model (config.json `auto_map`); off by default, as that code runs with the
    worker's rights.
    `attention_backend`: "torch" (the reference), "triton" (paged kernels; CUDA), "flash_attn" (when installed), or
    "auto": flash-attn on CUDA where it imports and serves the cache, else Triton; torch on the CPU.
    `enable_prefix_caching` lets a prompt reuse the complete KV blocks of an earlier one with the same prefix
    (`stats()["cached_prefix_tokens"]`); it is off for models with per-sequence state (recurrent layers, rings).
    `check_integrity` asserts the block accounting after every step (slow: for tests and soak runs); a
    broken invariant fails the step.

    `cuda_graphs` is `(varlen, decode)`, as in transformers #45323: which steps replay CUDA graphs. None
    means decode graphs on CUDA (unless the attention is the torch reference, or the model has MoE experts
    in a dtype other than bfloat16: neither can be captured) and none on the CPU. Decode graphs are
    captured at start for each padded batch size and KV-length bucket; on the CPU, `(False, True)` runs
    the same padded static-buffer step eagerly, with no capture (how the tests cover it). Varlen graphs
    (prefill and mixed steps) are not supported: a True first flag is refused.

    `async_batching` schedules and prepares step t+1 while the device runs step t, whose sampled tokens
    reach step t+1's inputs on the device; None turns it on for CUDA and off for the CPU, where it runs
    the same pipeline synchronously. Samples are the same either way, except that a stop token is seen one
    step late (the token computed meanwhile is dropped, counted in `wasted_tokens`).

    `windowed_kv` is what a sliding-window layer keeps of each sequence: `"window"`, only its last window
    (and a step's new tokens), in a ring of blocks per sequence slot: a fixed `max_num_seqs + 1` rings of
    window - 1 + min(`max_batch_tokens`, max(window, 256)) tokens of those layers, whatever the sequences'
    lengths, out of the KV budget, with prefix caching off (a cached prefix would come without its window);
    `"full"`, every token, as other layers do; `"auto"`, `"window"` where the rings fit in the tokens a cache
    of every token would hold in the budget (so they cost no capacity), else `"full"`.
    """

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gib: float | None = None
    max_batch_tokens: int = 1024
    max_num_seqs: int = 256
    cpu_offload_gib: float = 0.0
    attention_backend: str = "auto"
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    check_integrity: bool = False
    cuda_graphs: tuple[bool, bool] | None = None
    async_batching: bool | None = None
    windowed_kv: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        check_types(self)
        _choice("device", self.device.split(":")[0], DEVICES)
        _check_device_index(self.device)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("windowed_kv", self.windowed_kv, WINDOWED_KV)
        _bound(self, ">=", 1, "block_size", "num_blocks", "max_batch_tokens", "max_num_seqs")
        if self.num_blocks is not None and self.num_blocks > MAX_BLOCKS:
            raise ValueError(f"EngineConfig.num_blocks={self.num_blocks!r} must be <= {MAX_BLOCKS}: block tables hold "
                             "int32 block ids")
        _bound(self, ">=", 2, "max_model_len")  # a prompt token and a generated one
        _bound(self, ">=", 0, "cpu_offload_gib")
        _bound(self, ">", 0, "gpu_memory_utilization", "kv_cache_memory_gib")
        if self.gpu_memory_utilization > 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization={self.gpu_memory_utilization!r} must be <= 1")
        _check_cuda_graphs(self)


LOCAL_CONFIG = Path(__file__).resolve().parent / "local.toml"  # configs/local.toml links to it; in the wheel too


class ServiceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The service: the engine every worker runs, how many workers and where, how samples are sent back.

    Workers follow `engine.device`: `cuda` gives each worker one GPU of a placement group (`num_workers`
    None = one per GPU of the cluster); `cpu` gives each `cpus_per_worker` CPUs (None = one worker).
    A worker sends a call's finished samples once `flush_rows` are pending or the oldest has waited
    `flush_delay_s`. `name` and `namespace` name the service actor that clients connect to.
    `placement_strategy` is the Ray placement-group strategy of the workers' bundles: PACK fills as few
    nodes as possible, SPREAD puts them on as many nodes as it can.
    `object_store_memory_gib` bounds the object store of an embedded local Ray only.

    `worker_stall_timeout_s`: a worker that has work but whose engine loop finishes no step (nor any other
    engine call) for this long is killed and replaced, and its samples resent: a step stuck in a collective,
    a process stopped by a signal. 300 s by default: far above any healthy step, but a single engine call
    may legitimately take minutes (the first step's CUDA graph capture or Triton compile, a long prefill,
    a checkpoint update read from slow shared disk), and killing a healthy worker costs its reload.
    """

    engine: EngineConfig
    num_workers: int | None = None
    cpus_per_worker: float = 1.0
    name: str = "rollout"
    namespace: str = "rollout"
    flush_rows: int = 64
    flush_delay_s: float = 0.05
    placement_timeout_s: float = 300.0
    placement_strategy: str = "PACK"
    object_store_memory_gib: float = 2.0
    worker_stall_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_types(self)
        _bound(self, ">=", 1, "num_workers", "flush_rows")
        _bound(self, ">", 0, "cpus_per_worker", "placement_timeout_s", "object_store_memory_gib",
               "worker_stall_timeout_s")
        _bound(self, ">=", 0, "flush_delay_s")
        _choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES, "ServiceConfig")
        if not self.name or not self.namespace:
            raise ValueError("ServiceConfig.name and ServiceConfig.namespace must not be empty")
        if self.engine.device not in DEVICES:
            raise ValueError(f"engine.device={self.engine.device!r} must be one of {DEVICES}: "
                             "Ray gives each worker its own GPU")


def load_service_config(source: str | Path | ServiceConfig = LOCAL_CONFIG, **overrides: Any) -> ServiceConfig:
    """A ServiceConfig from a TOML path or a struct plus field overrides; EngineConfig fields may be
    given at top level (`model=...`) or as an `engine` dict. The model path may be a `Path`; a leading `~` in it
    is expanded."""
    if not isinstance(source, (ServiceConfig, str, os.PathLike)):
        raise ValueError(f"config={source!r:.60} must be a path to a TOML file or a ServiceConfig, "
                         f"not {type(source).__name__}")
    data = msgspec.to_builtins(source) if isinstance(source, ServiceConfig) else load_toml(source)
    engine = {**data.get("engine", {}), **msgspec.to_builtins(overrides.pop("engine", {}), enc_hook=os.fspath)}
    engine.update({k: overrides.pop(k) for k in list(overrides) if k in EngineConfig.__struct_fields__})
    if isinstance(engine.get("model"), (str, os.PathLike)):  # anything else is refused by `convert`, named
        engine["model"] = os.path.expanduser(os.fspath(engine["model"]))
    return convert({**data, **overrides, "engine": engine}, ServiceConfig)


def _bound(struct: msgspec.Struct, op: str, bound: float, *names: str) -> None:
    """ValueError naming the first of `names` (None is allowed) that is not `op bound`."""
    for name in names:
        value = getattr(struct, name)
        if value is not None and not (value >= bound if op == ">=" else value > bound):
            raise ValueError(f"{type(struct).__name__}.{name}={value!r} must be {op} {bound}")


def _check_cuda_graphs(config: EngineConfig) -> None:
    """ValueError unless `cuda_graphs` is None or a (varlen, decode) pair of bools with varlen off, and
    decode graphs on CUDA go with an attention that can be captured (not the torch reference)."""
    value = config.cuda_graphs
    if value is None:
        return
    if not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, bool) for v in value)):
        raise ValueError(f"EngineConfig.cuda_graphs={value!r} must be None or a tuple (varlen, decode) of two bools")
    if value[0]:
        raise ValueError(f"EngineConfig.cuda_graphs={value!r}: varlen graphs (the first flag) are not supported; "
                         "use (False, True) for decode graphs, or None")
    if value[1] and config.device.startswith("cuda") and config.attention_backend == "torch":
        raise ValueError(f"EngineConfig.cuda_graphs={value!r} with attention_backend='torch' on CUDA: the torch "
                         "reference attention syncs with the host and cannot be captured; use attention_backend="
                         "'auto' or 'triton', or cuda_graphs=(False, False)")


def _check_device_index(device: str) -> None:
    """ValueError unless a device index (`cuda:1`) is an integer torch reads: torch refuses `cuda:`, `cuda:-1`,
    `cuda:01` or `cuda:0:1` only once the engine starts; the CPU takes none (torch runs `cpu:1` on the CPU)."""
    kind, colon, index = device.partition(":")
    if colon and kind == "cpu":
        raise ValueError(f"EngineConfig.device={device!r}: the CPU takes no index; use 'cpu'")
    if colon and not (index.isascii() and index.isdigit() and str(int(index)) == index):
        raise ValueError(f"EngineConfig.device={device!r}: the index after ':' must be an integer >= 0 "
                         "without leading zeros, as in 'cuda:1'")


def _choice(name: str, value: str, allowed: tuple[str, ...], struct: str = "EngineConfig") -> None:
    if value not in allowed:
        raise ValueError(f"{struct}.{name}={value!r} must be one of {allowed}")


def convert(data: dict[str, Any], cls: type[T]) -> T:
    """Decode a plain dict into `cls`; unknown or ill-typed fields raise ValueError naming their path."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as err:
        raise ValueError(f"invalid {cls.__name__}: {err}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file; ValueError naming the file when it is missing or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    return data
