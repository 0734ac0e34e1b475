"""KV cache sizing, dtype "auto", the CPU pool's exact size and the persistent block tables."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import transformers

from rollout import SamplingParams
from rollout.config import EngineConfig
from tests.conftest import ON_GPU, make_engine, run
from workers.engine import memory, offload
from workers.engine.kv_cache import KvCache
from workers.engine.offload import CpuPool

GIB = 2**30


def test_explicit_num_blocks_wins(model_dir):
    engine = make_engine(model_dir(), num_blocks=37, kv_cache_memory_gib=1.0)
    assert engine.pool.num_blocks == 37 and engine.runner.kv_cache.num_blocks == 37


def test_a_set_num_blocks_beyond_free_memory_is_refused_naming_it(model_dir, monkeypatch):
    """The allocator's error named no setting (num_blocks=2**40: 'tried to allocate 9007199254740992 bytes')."""
    engine = make_engine(model_dir(), num_blocks=37)
    needed = 37 * engine.runner.bytes_per_block
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: needed - 1)
    with pytest.raises(ValueError, match=r"EngineConfig.num_blocks=37 needs a KV cache of .* GiB; the cpu has"):
        make_engine(model_dir(), num_blocks=37)
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: needed)
    assert make_engine(model_dir(), num_blocks=37).pool.num_blocks == 37


def test_a_set_num_blocks_is_checked_as_allocated_without_the_layers_in_rings(zoo_dir, monkeypatch):
    """Gemma 2's windowed layers kept in rings take no blocks: its set cache was checked as if they did."""
    engine = make_engine(zoo_dir("gemma2"), num_blocks=64, windowed_kv="window")
    assert engine.runner.ring_blocks and engine.runner.kv_cache.nbytes == 64 * engine.runner.bytes_per_block
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: engine.runner.kv_cache.nbytes)
    assert make_engine(zoo_dir("gemma2"), num_blocks=64, windowed_kv="window").pool.num_blocks == 64


def test_automatic_size_stays_within_the_budget(model_dir):
    budget = 0.001
    engine = make_engine(model_dir(), num_blocks=None, kv_cache_memory_gib=budget)
    runner = engine.runner
    assert engine.pool.num_blocks == int(budget * GIB) // runner.bytes_per_block
    assert runner.kv_cache.nbytes == engine.pool.num_blocks * runner.bytes_per_block <= budget * GIB
    rows = run(engine, [[5, 6, 7, 8, 9]], SamplingParams(n=4, max_new_tokens=20, ignore_eos=True))
    assert len(rows) == 4


@pytest.mark.parametrize("name", ["qwen3_next", "jamba"])
def test_a_set_budget_holds_the_recurrent_states_too(zoo_dir, name):
    """The per-sequence states were allocated beside a KV cache given the whole budget: 1.25x and 1.6x of it."""
    budget = 0.002
    engine = make_engine(zoo_dir(name), num_blocks=None, kv_cache_memory_gib=budget, max_num_seqs=256)
    runner = engine.runner
    assert runner.states.nbytes > 0
    assert runner.kv_cache.nbytes + runner.states.nbytes <= budget * GIB
    assert runner.kv_cache.nbytes + runner.states.nbytes + runner.bytes_per_block > budget * GIB, "all of it used"


def test_default_cpu_size_is_a_capped_share_and_never_more_than_max_num_seqs_need(model_dir):
    engine = make_engine(model_dir(), num_blocks=None, max_num_seqs=8)
    per_seq = -(-engine.max_model_len // 16)
    assert engine.pool.num_blocks == per_seq * 8  # the tiny model needs far less than the share
    budget = memory.kv_budget_bytes(EngineConfig(model="m"), lambda: 0)
    assert budget <= memory.CPU_KV_CAP_GIB * GIB


def test_a_budget_too_small_for_one_sequence_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"fewer than the 64 one sequence of max_model_len=1024 tokens needs"):
        make_engine(model_dir(), num_blocks=None, kv_cache_memory_gib=1e-5)


def test_cuda_budget_is_the_utilisation_minus_the_profiled_peak_and_foreign_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 20 * GIB)
    config = EngineConfig(model="m", device="cuda", gpu_memory_utilization=0.5)
    assert memory.kv_budget_bytes(config, lambda: 16 * GIB) == 40 * GIB - 16 * GIB - 10 * GIB
    with_budget = EngineConfig(model="m", device="cuda", kv_cache_memory_gib=3.0)
    assert memory.kv_budget_bytes(with_budget, lambda: pytest.fail("no profile when the budget is set")) == 3 * GIB


@pytest.mark.parametrize("device, saved, expected", [
    ("cpu", torch.bfloat16, torch.float32), ("cuda", torch.bfloat16, torch.bfloat16),
    ("cuda", torch.float16, torch.float16), ("cuda", torch.float32, torch.bfloat16), ("cuda", None, torch.bfloat16)])
def test_dtype_auto(device, saved, expected):
    hf = transformers.Qwen3Config(dtype=saved)
    assert memory.resolve_dtype(EngineConfig(model="m", device=device), hf) == expected
    assert memory.resolve_dtype(EngineConfig(model="m", device=device, dtype="float16"), hf) == torch.float16


def test_config_refuses_bad_memory_fields():
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        EngineConfig(model="m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory_gib=0"):
        EngineConfig(model="m", kv_cache_memory_gib=0)


def test_cpu_pool_takes_exactly_its_blocks_bytes():
    cache = torch.zeros(2, 2, 4, 16, 2, 8)
    per_block = 2 * 2 * 16 * 2 * 8 * 4
    pool = CpuPool(KvCache.of(cache), gib=(10 * per_block + 100) / GIB)
    assert pool.num_blocks == 10 and pool.nbytes == 10 * per_block


def test_a_cpu_pool_too_small_for_one_block_warns_that_preemption_recomputes():
    cache = torch.zeros(2, 2, 4, 16, 2, 8)
    with pytest.warns(UserWarning, match=r"cpu_offload_gib=1e-09 holds no KV block \(4096 bytes each\)"):
        assert CpuPool(KvCache.of(cache), gib=1e-9).num_blocks == 0


def test_cpu_pool_copies_round_trip_runs_and_scattered_slots():
    cache = torch.randn(2, 2, 6, 4, 1, 2)
    pool = CpuPool(KvCache.of(cache), gib=8 * cache[:, :, 0].numel() * 4 / GIB)
    original = cache.clone()
    pool.copy_to_cpu([(5, 0), (1, 1), (3, 2), (2, 6)])
    cache.zero_()
    pool.copy_to_device([(6, 0), (2, 4), (0, 3), (1, 1)])
    for cpu_slot, dst in ((6, 0), (2, 4), (0, 3), (1, 1)):
        src = {0: 5, 1: 1, 2: 3, 6: 2}[cpu_slot]
        assert torch.equal(cache[:, :, dst], original[:, :, src])


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_fault_in_writes_every_page(threads):
    """Chunks not aligned to pages (37 pages in 16 chunks a thread, shorter than a page with 3 threads or more)
    leave no page unwritten, and only a byte of a page or of a chunk is written."""
    pages = torch.full((37 * memory.PAGE,), 7, dtype=torch.uint8)
    memory.fault_in(pages, threads)
    assert pages.view(-1, memory.PAGE).eq(0).any(1).all()
    assert pages.eq(0).sum() <= 37 + 16 * threads


class StubCudart:
    """cudaHostRegister/cudaHostUnregister as calls recorded into `log`, for `pinned_empty` on the CPU;
    registrations return `register_error`."""

    def __init__(self, log: list, register_error: int = 0) -> None:
        self.log = log
        self.register_error = register_error

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.log.append(("register", nbytes))
        return self.register_error

    def cudaHostUnregister(self, address: int) -> int:
        self.log.append(("unregister", address))
        return 0


@pytest.mark.parametrize("nbytes, threaded", [(memory.THREADED_FAULT_BYTES, True),
                                              (memory.THREADED_FAULT_BYTES - memory.PAGE, False)])
def test_a_big_pool_is_faulted_in_on_threads_before_it_is_registered(monkeypatch, nbytes, threaded):
    """Pools of THREADED_FAULT_BYTES or more (the CPU KV pool) are written on FAULT_THREADS threads first;
    small ones (staging buffers) are left to cudaHostRegister."""
    log = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: StubCudart(log))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(memory, "fault_in", lambda pages, threads: log.append(("fault_in", pages.numel(), threads)))
    tensor = memory.pinned_empty((nbytes // 4,), torch.float32, torch.device("cuda"))
    faulted = [("fault_in", nbytes, memory.FAULT_THREADS)] if threaded else []
    assert log == [*faulted, ("register", nbytes)]
    del tensor
    assert log[-1][0] == "unregister"


def test_pages_are_unpinned_even_when_the_sync_before_fails(monkeypatch):
    """A sync that fails (one made while a CUDA graph is being captured) still unregisters the pages: left
    registered once their mapping goes, they would fail a later pool's cudaHostRegister at that address
    (CUDA error 712, seen on an H200 in the tenth GPU session)."""
    log = []

    def failing_sync(device: torch.device) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: StubCudart(log))
    monkeypatch.setattr(torch.cuda, "synchronize", failing_sync)
    with pytest.raises(RuntimeError, match="capturing"):
        memory.unpin_pages(4096, torch.device("cuda"))
    assert log == [("unregister", 4096)]


def test_a_failed_registration_is_raised_with_cudas_last_error_cleared(monkeypatch):
    """A failed cudaHostRegister raises, naming the size and CUDA's error, after clearing CUDA's last error."""
    log = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: StubCudart(log, register_error=712))
    monkeypatch.setattr(memory, "clear_last_error", lambda device: log.append(("clear", device.type)))
    with pytest.raises(RuntimeError, match=f"cudaHostRegister of {memory.PAGE} bytes failed with CUDA error 712"):
        memory.pinned_empty((memory.PAGE // 4,), torch.float32, torch.device("cuda"))
    assert log == [("register", memory.PAGE), ("clear", "cuda")]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_a_failed_registration_leaves_no_error_for_the_next_cuda_call():
    """Pages registered twice fail with CUDA error 712 (already registered). Left as CUDA's last error, it would
    fail the next kernel launch anywhere (the next test's, in the tenth GPU session)."""
    device = torch.device("cuda")
    pinned = memory.pinned_empty((memory.PAGE,), torch.uint8, device)
    with pytest.raises(RuntimeError, match="CUDA error 712"):
        memory.pin_pages(pinned, device)
    assert torch.ones(2, device=device).sum().item() == 2


@pytest.mark.parametrize("cuda_graphs, offload_gib, phases", [
    ((False, False), 0, ["load", "model probe", "KV cache", "warm-up"]),
    ((False, True), 0, ["load", "model probe", "KV cache", "warm-up", "decode graphs"]),
    ((False, True), 0.01, ["load", "model probe", "KV cache", "warm-up", "decode graphs", "CPU pool"])])
def test_start_up_is_logged_by_phase(model_dir, caplog, cuda_graphs, offload_gib, phases):
    """The engine logs its start-up once, in total and by phase (decode graphs and the CPU pool only when
    built)."""
    with caplog.at_level(logging.INFO, logger="workers.engine.model_runner"):
        engine = make_engine(model_dir(), cuda_graphs=cuda_graphs, cpu_offload_gib=offload_gib)
    startup = engine.runner.startup_s
    assert list(startup) == phases and all(seconds >= 0 for seconds in startup.values())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine start-up")]
    assert line.startswith(f"engine start-up: {sum(startup.values()):.2f} s (load ")
    assert all(f"{name} {seconds:.2f} s" in line for name, seconds in startup.items())


@pytest.mark.parametrize("gib", [64.0, 1e300])
def test_a_cpu_pool_beyond_the_safe_share_of_ram_is_capped_with_a_warning(gib, monkeypatch):
    """Named in a warning, however large (1e300 GiB overflowed `int` before the cap)."""
    monkeypatch.setattr(offload, "available_ram_bytes", lambda: 16 * GIB)
    with pytest.warns(UserWarning, match=re.escape(f"cpu_offload_gib={gib} exceeds")):
        assert offload.cpu_pool_bytes(gib) == int(16 * GIB * offload.SAFE_RAM_FRACTION)
    assert offload.cpu_pool_bytes(1.5) == int(1.5 * GIB)
