"""The transformers side of scripts/bench_gpu.py: its continuous batching (`generate_batch`) with the
options of each system, on the same workloads, cache sizes and offload as the engine."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from bench_gpu_runs import Workload
from tqdm.auto import tqdm


def hf_options(system: str, device: str) -> tuple[dict | None, str]:
    """ContinuousBatchingConfig options of `system`, or None and why it cannot run here."""
    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    generate_batch = getattr(transformers.GenerationMixin, "generate_batch", lambda: None)
    if cls is None or "continuous_batching_config" not in inspect.signature(generate_batch).parameters:
        version = transformers.__version__
        return None, f"unavailable: transformers {version} has no generate_batch(continuous_batching_config=)"
    if system == "hf-default":
        return {}, ""
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [f for f in ("use_cuda_graph", "use_async_batching") if f not in fields]
    if missing:
        return None, f"unavailable: ContinuousBatchingConfig has no {' or '.join(missing)}"
    if not device.startswith("cuda"):
        return None, "unavailable: transformers' CUDA graphs and async batching need CUDA (async raises on the CPU)"
    return {"use_cuda_graph": True, "use_async_batching": True}, ""


def hf_cache_options(w: Workload, args: argparse.Namespace) -> tuple[dict, str]:
    """The workload's cache options for transformers (same KV tokens and offload GiB as the engine)."""
    out = dict(args.hf_extra)
    page_field = hf_page_field()
    if "page_size" in out:
        out[page_field] = out.pop("page_size")
    if w.kv_tokens:
        page = out.get(page_field, getattr(transformers.ContinuousBatchingConfig, page_field))
        out["num_blocks"] = w.kv_tokens // page
    if w.offload and args.device.startswith("cuda"):
        out["cpu_offload_space"] = args.offload_gib
    if w.offload and "cpu_offload_space" not in out:
        return out, "offload off: transformers pins its CPU pool, which needs CUDA"
    return out, ""


def hf_page_field() -> str:
    """The name of ContinuousBatchingConfig's KV page size: `page_size` (transformers 5.23), `block_size`
    in older versions such as the GPU image's 5.17."""
    fields = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    return "page_size" if "page_size" in fields else "block_size"


def hf_generation_config(w: Workload) -> transformers.GenerationConfig:
    """transformers' settings matching `sampling_params(w)`; eos_token_id=-1 disables eos."""
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if w.sampling else dict(do_sample=False)
    return transformers.GenerationConfig(max_new_tokens=w.new_tokens, num_return_sequences=w.n, eos_token_id=-1,
                                         pad_token_id=0, **sampling)


def run_hf(path: Path, w: Workload, prompts: list[list[int]], options: dict, args: argparse.Namespace) -> dict:
    """One timed `generate_batch` of workload `w` on a freshly loaded model, to the end or for --window-s
    seconds from adding the requests (at most --hf-timeout-s). The generation's time runs from the first
    request's creation to the last one's end (transformers' own benchmark's measure), or to the stop;
    start-up is the load plus the rest of the call (cache allocation, graph warm-up)."""
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=args.torch_dtype,
                                                              device_map=args.device).eval()
    load = time.perf_counter() - start
    cache, note = hf_cache_options(w, args)
    cb_config = transformers.ContinuousBatchingConfig(**cache, **options)
    start = time.perf_counter()
    limit = min(args.window_s or math.inf, args.hf_timeout_s)
    run = generate_all(model, prompts, hf_generation_config(w), cb_config, args.progress, limit)
    wall = time.perf_counter() - start
    if run.unfinished and limit != args.window_s:
        note = "; ".join(x for x in (note, f"stopped after --hf-timeout-s {args.hf_timeout_s:g}") if x)
    done = [o for o in run.done if o.error is None]
    outputs = done + run.unfinished
    if not outputs:
        return {"status": "failed: generate_batch's steps gave no output without an error", "note": note}
    end = run.stopped if run.unfinished else max(o.lifespan[1] for o in done)
    seconds = end - min(o.created_time for o in outputs)
    return {"tokens": sum(len(o.generated_tokens) for o in outputs), "seconds": seconds,
            "samples_finished": len(done), "startup_s": load + wall - seconds,
            "cut": bool(run.unfinished) and limit == args.window_s, "note": note}


class HFRun(NamedTuple):
    """What `generate_all` collected: the finished outputs, what the unfinished had made when it stopped
    waiting, and that moment (a perf_counter time)."""

    done: list
    unfinished: list
    stopped: float


@torch.no_grad()  # as generate_batch: its worker thread updates tensors made here in place
def generate_all(model: transformers.PreTrainedModel, prompts: list[list[int]],
                 generation_config: transformers.GenerationConfig,
                 cb_config: transformers.ContinuousBatchingConfig | None, progress: bool,
                 limit_s: float = math.inf) -> HFRun:
    """The outputs of transformers' continuous batching that finished within `limit_s` seconds of adding the
    requests, each prompt's forked samples included, and what the unfinished ones had made by then: the steps of
    `generate_batch` (its manager, warm-up and workload hints), collected here because transformers 5.17's
    `generate_batch` returns only the first sample of each prompt."""
    from transformers.generation.continuous_batching.utils import WorkloadHints  # only where hf_options passed

    wanted = len(prompts) * (generation_config.num_return_sequences or 1)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=generation_config.max_new_tokens, num_requests=wanted)
    done = {}
    with (model.continuous_batching_context_manager(generation_config=generation_config, block=True, timeout=5,
                                                    continuous_batching_config=cb_config, workload_hints=hints)
          as manager, tqdm(total=wanted, disable=not progress, desc="generate_batch") as bar):
        manager.add_requests(inputs=prompts, max_new_tokens=generation_config.max_new_tokens)
        deadline = time.perf_counter() + limit_s
        while len(done) < wanted and (left := deadline - time.perf_counter()) > 0:
            result = manager.get_result(timeout=min(1.0, left))
            if result is not None and result.is_finished():
                done[result.request_id] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                break
        stopped = time.perf_counter()
        unfinished = [] if len(done) == wanted else unfinished_outputs(manager, done)
        if unfinished:  # a flushing stop would finish them first: drop them now (the exit's stop then only warns)
            manager.stop(block=True, timeout=60, hard_stop=True)
    return HFRun(list(done.values()), unfinished, stopped)


def unfinished_outputs(manager: Any, done: dict) -> list:
    """What the requests still in transformers' scheduler (running, or waiting after a preemption) have made,
    as outputs, read while its worker thread runs; results queued meanwhile join `done` (a request that
    finishes after that counts what it had made at the read)."""
    processor = manager.batch_processor
    if processor is None:
        return []
    scheduler = processor.scheduler
    states = [*list(scheduler.active_requests.values()), *list(scheduler.waiting_requests.values())]
    snapshot = [s.to_generation_output() for s in states]
    while (result := manager.get_result(timeout=0)) is not None:
        if result.is_finished():
            done[result.request_id] = result
    return [o for o in snapshot if o.request_id not in done]
