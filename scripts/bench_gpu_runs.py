"""The pieces of scripts/bench_gpu.py: its models and workloads, one timed run of each system, the
decode-step probe and the copy bandwidth. Each run builds its own engine or model and frees it."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
import transformers
from bench_profile import PROFILE_STEPS, profile_steps
from tqdm.auto import tqdm

from rollout import SamplingParams
from workers.engine import Engine, EngineConfig

BLOCK_SIZE = 16  # the engine's block size here (its default)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (transformers config class, its values): the published configs' shapes, random weights.
MODELS = {
    "qwen3-1.7b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama-3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    # transformers' default Qwen3.5 text config: 32 layers, three Gated DeltaNet layers to one attention layer,
    # hidden 4096 (its roofline counts the attention layers' KV and the linear layers' states, read and written)
    "qwen3.5": ("Qwen3_5TextConfig", dict(vocab_size=248320, max_position_embeddings=40960, tie_word_embeddings=False)),
    "tiny": ("Qwen3Config", dict(  # --smoke only
        vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)),
}
ENGINE_SYSTEMS = ("engine-on", "engine-off")
HF_SYSTEMS = ("hf-default", "hf-graphs-async")


@dataclasses.dataclass(frozen=True)
class Workload:
    """`prompts` random prompts of `prompt_len` tokens, `n` samples each of exactly `new_tokens` tokens
    (eos ignored); `kv_tokens` caps the KV cache (None: each system sizes its own); `offload` turns on
    CPU offload of preempted KV on both sides."""

    name: str
    prompts: int
    prompt_len: int
    n: int
    new_tokens: int
    sampling: bool = True
    kv_tokens: int | None = None
    offload: bool = False

    @property
    def tokens(self) -> int:
        """Tokens the workload generates."""
        return self.prompts * self.n * self.new_tokens

    def describe(self) -> str:
        """One line: the workload's sizes and options."""
        cache = f", KV cache {self.kv_tokens} tokens" if self.kv_tokens else ""
        offload = ", offload on" if self.offload else ""
        return (f"{self.prompts} prompts x {self.prompt_len} tokens, n={self.n}, {self.new_tokens} new tokens, "
                f"{'sampling' if self.sampling else 'greedy'}, eos ignored{cache}{offload}")


WORKLOADS = {w.name: w for w in [
    Workload("multi_return_seq", 50, 256, 8, 256),
    Workload("few_blocks", 20, 256, 1, 256, sampling=False, kv_tokens=16 * 256),  # transformers' 16 pages of 256
    *(Workload(f"rollouts_{n}", 32, 256, 8, n, offload=True) for n in (1024, 2048, 4096, 8192, 16384))]}


def smoke_workload(w: Workload) -> Workload:
    """The same workload shrunk for a CPU smoke run: a few short prompts and a few new tokens."""
    return dataclasses.replace(w, prompts=min(w.prompts, 4), prompt_len=16, n=min(w.n, 2),
                               new_tokens=min(32, max(4, w.new_tokens // 64)), kv_tokens=w.kv_tokens and 4 * 16)


def free_memory(device: str) -> float:
    """Drop what the last run left, so that the next system gets the whole card and starts as the first did: the
    device's cached memory, and torch's cache of pinned host memory, which every graph capture empties (a second
    engine's capture once took 6.3 s against the first's 1.1 s); returns the seconds the host cache took."""
    gc.collect()
    if not device.startswith("cuda"):
        return 0.0
    torch.cuda.empty_cache()
    start = time.perf_counter()
    # present in CUDA builds from torch 2.6 on (checked there); the card's 2.11 is unchecked, and a missing one must
    # not cost a lent GPU its benchmark
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return time.perf_counter() - start


def sync(device: str) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prepare_model(cache_dir: Path, name: str, dtype: torch.dtype, device: str) -> Path:
    """The directory of random-weight model `name` (config.json + safetensors), built on `device` once
    and reused while its config and dtype are unchanged."""
    config_cls, values = MODELS[name]
    key = hashlib.sha1(json.dumps([config_cls, values, str(dtype)], sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir / f"{name}-{key}"
    if (path / "complete").is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**values), dtype=dtype)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(cache_dir).free
    if size * 1.05 > free:
        raise RuntimeError(f"model {name} needs {size / 1e9:.1f} GB; --cache-dir {cache_dir} has "
                           f"{free / 1e9:.1f} GB free")
    model.save_pretrained(path)
    (path / "complete").touch()
    del model
    free_memory(device)
    return path


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` random token ids (ids 0 and 1 avoided)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=gen).tolist()


def copy_bandwidth(device: str) -> float:
    """GB/s of a large copy on `device`, bytes read + written per second: 1 GiB on CUDA (64 MiB on the
    CPU), 5 blocks of 10 copies timed between syncs, median block."""
    src = torch.ones(2**30 if device.startswith("cuda") else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        sync(device)
        times.append((time.perf_counter() - start) / 10)
    return 2 * src.numel() / statistics.median(times) / 1e9


# ---- this engine ------------------------------------------------------------------------------------
def engine_options(system: str) -> tuple[dict | None, str]:
    """The EngineConfig fields of `system` that this branch has, and a note; None when it cannot be built.
    Without the fields the engine has neither feature, so engine-off runs as it is."""
    on = system == "engine-on"
    wanted = {"cuda_graphs": (False, True) if on else (False, False), "async_batching": on}
    missing = [k for k in wanted if k not in EngineConfig.__struct_fields__]
    if on and len(missing) == len(wanted):
        return None, "unavailable: EngineConfig has no cuda_graphs or async_batching on this branch"
    note = f"no EngineConfig.{' or .'.join(missing)} on this branch: off" if missing else ""
    return {k: v for k, v in wanted.items() if k not in missing}, note


def sampling_params(w: Workload) -> SamplingParams:
    """The engine's parameters for `w`: temperature 1 (no top-k/top-p) or greedy, eos ignored."""
    return SamplingParams(n=w.n, temperature=1.0 if w.sampling else 0.0, max_new_tokens=w.new_tokens,
                          ignore_eos=True, seed=0)


def start_engine(config: EngineConfig) -> tuple[Engine, float, float]:
    """A warm engine, its start-up seconds (construction: load, KV sizing, warm-up, graph capture; plus one
    2-prompt call, so the timed call compiles nothing) and the 2-prompt call's seconds alone."""
    start = time.perf_counter()
    engine = Engine(config)
    built = time.perf_counter()
    warm = SamplingParams(n=2, max_new_tokens=4, ignore_eos=True)
    engine.generate(make_prompts(2, 8, engine.vocab_size, seed=1), warm)
    engine.reset_prefix_cache()
    done = time.perf_counter()
    return engine, done - start, done - built


def run_engine(path: Path, w: Workload, prompts: list[list[int]], options: dict, args: argparse.Namespace) -> dict:
    """One timed run of workload `w` on a fresh engine: to the end, or for --window-s seconds."""
    sizes = {"max_model_len": w.prompt_len + w.new_tokens, "block_size": BLOCK_SIZE}
    if w.kv_tokens:
        sizes["num_blocks"] = w.kv_tokens // BLOCK_SIZE
    if w.offload:
        sizes["cpu_offload_gib"] = args.offload_gib
    config = EngineConfig(model=str(path), device=args.device, dtype=args.dtype, **args.engine_extra, **sizes,
                          **options)
    engine, startup, first_call = start_engine(config)
    before = engine.stats()
    start = time.perf_counter()
    rows = generate_until(engine, prompts, sampling_params(w), start + (args.window_s or math.inf), args.progress)
    seconds = time.perf_counter() - start
    after = engine.stats()
    graphs = getattr(engine.runner, "graphs", None)  # a branch before decode graphs has none
    return {"tokens": sum(len(r["token_ids"]) for r in rows), "seconds": seconds, "startup_s": startup,
            "first_call_s": first_call,
            "samples_finished": sum(r["finish_reason"] != "abort" for r in rows),
            "cut": any(r["finish_reason"] == "abort" for r in rows),
            "graph_capture_s": getattr(engine.runner, "graph_capture_s", None),
            "graph_warmup_s": getattr(graphs, "warmup_s", None), "graphs": getattr(graphs, "num_captured", None),
            "startup_phases_s": getattr(engine.runner, "startup_s", None),
            "preemptions": {k: after[k] - before[k] for k in ("offloads", "restores", "recomputes")}}


def generate_until(engine: Engine, prompts: list[list[int]], params: SamplingParams, deadline: float,
                   progress: bool) -> list[dict]:
    """A row per sample, as `Engine.generate` steps them, until all finish or `deadline` (a perf_counter
    time) passes; then the unfinished are aborted and their rows hold what they made."""
    ids = [engine.add_request(p, params, prompt_index=i) for i, p in enumerate(prompts)]
    rows = []
    with tqdm(total=len(prompts) * params.n, disable=not progress, desc="samples") as bar:
        while engine.has_unfinished() and time.perf_counter() < deadline:
            done = engine.step()
            rows += done
            bar.update(len(done))
    for request_id in ids:
        rows += engine.abort(request_id)
    while engine.has_unfinished():
        rows += engine.step()
    return rows


def decode_probe(path: Path, options: dict, args: argparse.Namespace) -> dict:
    """ms per decode step at `args.decode_seqs` sequences of about `args.decode_context` tokens, and the
    bytes such a step must read (see bench_gpu.py's docstring)."""
    seqs, steps = args.decode_seqs, args.decode_steps
    batch = max(EngineConfig(model=str(path)).max_batch_tokens, 4 * seqs)
    # the first prompts decode while the last are prefilled (at >= batch - seqs prompt tokens a step)
    grow = -(-seqs * args.decode_context // (batch - seqs)) + steps + PROFILE_STEPS + 16
    config = EngineConfig(model=str(path), device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                          max_num_seqs=seqs, max_batch_tokens=batch, max_model_len=args.decode_context + grow,
                          **args.engine_extra, **options)
    engine, startup, first_call = start_engine(config)
    need = seqs * -(-(args.decode_context + grow - 1) // BLOCK_SIZE)  # a sequence's last token is never stored
    if need > engine.pool.num_blocks:
        return {"status": f"skipped: the probe needs {need} KV blocks, the cache holds {engine.pool.num_blocks}"}
    params = SamplingParams(max_new_tokens=grow, ignore_eos=True, seed=0)
    for i, prompt in enumerate(make_prompts(seqs, args.decode_context, engine.vocab_size, seed=2)):
        engine.add_request(prompt, params, prompt_index=i)
    sched = engine.scheduler
    while sched.waiting or len(sched.running) < seqs or any(s.num_generated < 2 for s in sched.running):
        engine.step()
    for _ in range(2):
        engine.step()
    preempted = sum(engine.stats()[k] for k in ("offloads", "recomputes"))
    context = statistics.mean(len(s.token_ids) for s in sched.running) + steps / 2
    sync(args.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(args.device)
    ms = (time.perf_counter() - start) / steps * 1e3
    if len(sched.running) != seqs or sum(engine.stats()[k] for k in ("offloads", "recomputes")) != preempted:
        return {"status": "failed: the batch changed during the timed steps"}
    runner = engine.runner
    profile = profile_steps(engine.step, args.device, args.profile_decode) if args.profile_decode else None
    return {"status": "ok", "seqs": seqs, "context": context, "ms_per_step": ms, "startup_s": startup,
            "first_call_s": first_call,
            "startup_phases_s": dict(runner.startup_s), "profile": profile, "weight_bytes": weight_bytes(runner.model),
            "kv_bytes": seqs * context * runner.bytes_per_block / BLOCK_SIZE,
            "state_bytes": 2 * seqs * runner.mixers.nbytes(1)}  # linear layers' states, read and written


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once (tied ones once), except an untied
    input embedding, of which a step reads only one row per sequence."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # yields a tied parameter once
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total - (embedding.numel() * embedding.element_size() if embedding is not head else 0)
