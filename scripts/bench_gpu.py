"""GPU rollout benchmark: this engine against transformers' continuous batching (`generate_batch`), in one run.

Models: random-weight bf16 models built from configs shaped like Qwen3-1.7B and Llama-3.1-8B (no download,
no tokenizer: prompts are random token ids), saved once as safetensors under --cache-dir and reused
(about 4 and 16 GB of disk).

Workloads (those of transformers' own continuous-batching benchmark, with n = 8 and offload for rollouts):
  multi_return_seq  50 prompts x 256 tokens, n = 8, 256 new tokens, sampling (temperature 1)
  few_blocks        20 prompts x 256 tokens, 256 new tokens, greedy, a KV cache of 4096 tokens: transformers'
                    16 blocks of 256-token pages, the engine's 256 blocks of 16 tokens
  rollouts_N        32 prompts x 256 tokens, n = 8, N new tokens (N = 1024, 2048, 4096, 8192, 16384),
                    sampling, CPU offload of --offload-gib GiB on both sides
  decode            decode-step time against the memory roofline (below)
eos is ignored everywhere (transformers' benchmark does the same with eos_token_id=-1), so every system
generates exactly prompts x n x new tokens.

Systems, one at a time on the card, each loading the model afresh for each workload:
  engine-on        this engine, EngineConfig(cuda_graphs=(False, True), async_batching=True)
  engine-off       this engine, cuda_graphs=(False, False), async_batching=False (on a branch without
                   those fields it runs as it is: it has neither)
  hf-default       model.generate_batch, ContinuousBatchingConfig defaults (+ the workload's cache/offload)
  hf-graphs-async  the same with use_cuda_graph=True (varlen and decode paths) and use_async_batching=True
A variant whose option this branch or this transformers lacks is reported unavailable, not run. transformers
runs `generate_batch`'s own steps with the outputs collected by bench_gpu_hf.py: transformers 5.17 (the GPU
image's) returns only the first of each prompt's n samples from `generate_batch`.

Printed per model and workload: tokens/s (generated tokens over the generation's time: the engine's requests
added and stepped to the end, as `generate` does; transformers' first request created to last request
finished), each engine's ratio to each transformers variant (the JSON's `ratio_vs`), start-up seconds
(engine: construction = load, KV sizing, warm-up and graph capture, plus a 2-prompt warm-up call; "capture"
is the runner's `graph_capture_s` where it reports one, in brackets the part spent in each graph's warm-up
launch, where kernels compile on first use; the JSON adds `graphs`, how many were captured, and
`startup_phases_s`, the runner's seconds per phase of construction, printed below the table for decode and
workloads alike; transformers: model load plus the rest of the call: cache allocation and its graph warm-up)
and the engine's preemptions. Target: this engine (engine-on) at least 2x every transformers variant.

decode: a fresh engine per variant gets --decode-seqs prompts of --decode-context random tokens and steps
until every sequence decodes; then --decode-steps calls of engine.step() are timed as one block between
two torch.cuda.synchronize() (none inside, so async batching overlaps as in a real run). The roofline is
the bytes one step must read, every weight once (an untied input embedding excepted: a step reads one row
per sequence) plus every sequence's KV at the block's mean length (and, for a hybrid, every sequence's
linear-layer states, read and written), over the card's copy bandwidth measured
at the start of the run (1 GiB device-to-device copies, bytes read + written per second). Target: >= 60%.
--profile-decode K then profiles 8 more steps and prints the K kernels taking most device time
(scripts/bench_profile.py).

--window-s W time-boxes every workload run (not decode): each system generates for W seconds from its first
request, then stops; tokens/s counts every token made by then, finished samples or not (the engine aborts
the rest, transformers' are read from its scheduler). A run cut so is "ok" with its counts in the note, and
the target line names the window. All systems get the same window, so the slower one is timed over the
early, shorter contexts, where decode is fastest: a whole run's ratio is expected to be at least the
window's. This is how rollouts_N fits a device call (transformers would need 3 to 50 minutes per run).

Time: a device call may run 600 s. On an H100 (2026-11-24) the defaults (qwen3-1.7b; decode,
multi_return_seq) took about 330 s, most of it transformers' runs (75 s and 80 s on multi_return_seq);
few_blocks took about 140 s with transformers' graphs+async run cut at 100 s, and transformers finished no
rollouts_1024 sample within 90 s. --budget-s starts no run after that many seconds (the rest are marked
skipped); --hf-timeout-s stops a transformers run that has not finished; --window-s makes rollouts fit.
docs/benchmarks.md lists the calls that complete the matrix, for example:
  --window-s 20 --workloads rollouts_1024 rollouts_2048 rollouts_4096 rollouts_8192 rollouts_16384
  --window-s 20 --models llama-3.1-8b --workloads decode multi_return_seq few_blocks
  --systems engine-on --workloads rollouts_2048 rollouts_4096 rollouts_8192   (whole runs, no window)
Results go to --json after every run (default $OUT/bench_gpu.json when $OUT is set), so a call cut short
keeps what finished. --smoke runs a tiny model and tiny workloads on the CPU in float32: every path but the
CUDA-only ones (graph capture, transformers' async batching and pinned offload); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_hf as hf  # noqa: E402
import bench_gpu_runs as runs  # noqa: E402
from bench_gpu_runs import ENGINE_SYSTEMS, HF_SYSTEMS, MODELS, WORKLOADS  # noqa: E402
from bench_profile import print_profile  # noqa: E402

SYSTEMS = ENGINE_SYSTEMS + HF_SYSTEMS
ITEMS = ("decode", *WORKLOADS)
DEFAULTS = {"models": ["qwen3-1.7b"], "workloads": ["decode", "multi_return_seq"]}
SMOKE = dict(device="cpu", dtype="float32", models=["tiny"], engine_extra={"kv_cache_memory_gib": 0.05},
             hf_extra={"page_size": 16, "num_blocks": 64, "max_batch_tokens": 256}, offload_gib=0.01,
             decode_seqs=16, decode_context=32, decode_steps=8)
TARGET_RATIO, TARGET_ROOFLINE = 2.0, 0.6
CACHE = "/tmp/bench_gpu_models"
WORKLOAD_ROW = "{:<17}{:>10}{:>15}{:>20}{:>12}{:>17}{:>11}  {}"
DECODE_ROW = "{:<17}{:>9}{:>12}{:>12}{:>15}{:>13}{:>13}  {}"


def make_parser() -> argparse.ArgumentParser:
    """The command line's options, with this docstring as its --help."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=[m for m in MODELS if m != "tiny"],
                        help=f"models to run (default {' '.join(DEFAULTS['models'])})")
    parser.add_argument("--workloads", nargs="+", choices=[*ITEMS, "all"],
                        help=f"workloads to run, 'all' for every one (default {' '.join(DEFAULTS['workloads'])})")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems (default all)")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BENCH_GPU_CACHE", CACHE)),
                        help=f"where the random models are saved and reused ($BENCH_GPU_CACHE, else {CACHE})")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "bench_gpu.json",
                        help="results file, rewritten after every run (default $OUT/bench_gpu.json, else /tmp/...)")
    parser.add_argument("--offload-gib", type=float, default=16.0, help="CPU offload pool of rollouts_N (default 16)")
    parser.add_argument("--decode-seqs", type=int, default=256, help="sequences of the decode probe (default 256)")
    parser.add_argument("--decode-context", type=int, default=1024, help="their prompt length (default 1024)")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (default 32)")
    parser.add_argument("--profile-decode", type=int, default=0, metavar="K",
                        help="after the decode probe's timed steps, profile 8 more and print the K kernels that "
                             "take most device time per step, and how busy the device is (default 0: off)")
    parser.add_argument("--budget-s", type=float, help="start no run after this many seconds (default: no limit)")
    parser.add_argument("--window-s", type=float,
                        help="time-box every workload run: stop after this many seconds of generation and count "
                             "every token made, finished samples or not (default: run each workload to its end)")
    parser.add_argument("--hf-timeout-s", type=float, default=240.0,
                        help="stop a transformers run that has not finished after this many seconds and report "
                             "what it made (default 240)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workloads on the CPU (float32)")
    return parser


def parse_args() -> argparse.Namespace:
    """Options, checked before any work; --smoke replaces the device, model and sizes."""
    parser = make_parser()
    args = parser.parse_args()
    if args.smoke and args.models:
        parser.error("--smoke runs the tiny model only; drop --models")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs on the CPU")
    for name in ("offload_gib", "decode_seqs", "decode_context", "decode_steps", "hf_timeout_s", "window_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    if args.profile_decode < 0:
        parser.error(f"--profile-decode={args.profile_decode} must be >= 0")
    items = args.workloads or DEFAULTS["workloads"]
    args.workloads = list(ITEMS) if "all" in items else list(dict.fromkeys(items))
    args.models = args.models or DEFAULTS["models"]
    vars(args).update(device="cuda", dtype="bfloat16", engine_extra={}, hf_extra={})
    if args.smoke:
        vars(args).update(SMOKE)
    args.torch_dtype = getattr(torch, args.dtype)
    args.workload_defs = {k: runs.smoke_workload(w) if args.smoke else w for k, w in WORKLOADS.items()}
    return args


def run_one(model: str, path: Path | None, item: str, system: str, args: argparse.Namespace) -> dict:
    """One system on one workload (or the decode probe): a result row, never an exception."""
    row = {"model": model, "workload": item, "system": system}
    is_engine = system in ENGINE_SYSTEMS
    options, note = runs.engine_options(system) if is_engine else hf.hf_options(system, args.device)
    if options is None:
        return {**row, "status": note}
    if past_budget(args):
        return {**row, "status": f"skipped: past --budget-s {args.budget_s:g}"}
    try:
        if item == "decode":
            result = runs.decode_probe(path, options, args)
        else:
            w = args.workload_defs[item]
            prompts = runs.make_prompts(w.prompts, w.prompt_len, MODELS[model][1]["vocab_size"])
            result = (runs.run_engine if is_engine else hf.run_hf)(path, w, prompts, options, args)
            if "status" not in result:
                judge(result, w, args.window_s)
    except Exception as err:  # one failed run must not lose the others' results on a lent GPU
        traceback.print_exc()
        result = {"status": f"failed: {type(err).__name__}: {err}"}
    host_cache_s = runs.free_memory(args.device)
    if args.device.startswith("cuda"):
        result["leftover_gib"] = torch.cuda.memory_allocated() / 2**30
        result["host_cache_free_s"] = host_cache_s
    notes = "; ".join(x for x in (note, result.pop("note", "")) if x)
    return {**row, **result, "note": notes}


def judge(result: dict, w: runs.Workload, window_s: float | None) -> None:
    """Set a workload run's tokens/s and status: ok when it made every token of `w`, or when it was cut
    at the window having made some (noted with its counts); failed otherwise."""
    made, finished = result["tokens"], result["samples_finished"]
    result["tokens_per_s"] = made / result["seconds"]
    if result["cut"] and made:
        result["status"] = "ok"
        cut = f"cut at the {window_s:g} s window: {made} of {w.tokens} tokens, {finished} of {w.prompts * w.n} samples"
        result["note"] = "; ".join(x for x in (result.get("note"), cut) if x)
    else:
        result["status"] = "ok" if made == w.tokens else f"failed: made {made} of {w.tokens} tokens"


def past_budget(args: argparse.Namespace) -> bool:
    """True once --budget-s seconds have passed since the start: no further run (or model build) starts."""
    return args.budget_s is not None and time.perf_counter() - args.t0 > args.budget_s


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted, or '-' when there is none."""
    return "-" if value is None else format(value, spec)


def print_workload(model: str, item: str, rows: list[dict], args: argparse.Namespace) -> str:
    """The table of one model and workload; returns its target line."""
    print(f"\n{model} / {item}: {args.workload_defs[item].describe()}")
    print(WORKLOAD_ROW.format("system", "tokens/s", "vs hf-default", "vs hf-graphs-async", "start-up s",
                              "capture s (warm)", "preempted", "status"))
    peers = {r["system"]: r["tokens_per_s"] for r in rows if r["system"] in HF_SYSTEMS and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["system"] in ENGINE_SYSTEMS:  # kept in the JSON too
            r["ratio_vs"] = {s: r["tokens_per_s"] / peer for s, peer in peers.items()}
        ratios = [f"{r['ratio_vs'][s]:.2f}x" if s in r.get("ratio_vs", {}) else "-" for s in HF_SYSTEMS]
        pre = r.get("preemptions")
        print(WORKLOAD_ROW.format(r["system"], fmt(r.get("tokens_per_s"), ".0f"), *ratios,
                                  fmt(r.get("startup_s"), ".1f"), capture(r),
                                  pre["offloads"] + pre["recomputes"] if pre else "-", status(r)))
    print_startup(rows)
    best = best_engine(rows)
    if best is None or not peers:
        return f"{model} / {item}: >= {TARGET_RATIO:g}x transformers: not measured"
    ratio = min(best["ratio_vs"].values())
    verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
    cut = any(r.get("cut") for r in rows if r["status"] == "ok")
    return (f"{model} / {item}: {best['system']} >= {TARGET_RATIO:g}x every transformers variant run "
            f"({', '.join(peers)}): {verdict} (lowest {ratio:.2f}x"
            f"{f', over a {args.window_s:g} s window' if cut else ''})")


def print_decode(model: str, rows: list[dict], copy_gbs: float) -> str:
    """The decode-step table of one model; returns its target line."""
    first = next((r for r in rows if r["status"] == "ok"), None)
    shape = f"{first['seqs']} sequences, {first['context']:.0f} tokens of context on average" if first else ""
    print(f"\n{model} / decode: {shape}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(DECODE_ROW.format("system", "ms/step", "weights GB", "KV GB/step", "state GB/step", "roofline ms",
                            "of roofline", "status"))
    for r in rows:
        if r["status"] == "ok":
            moved = r["weight_bytes"] + r["kv_bytes"] + r.get("state_bytes", 0)
            r["roofline_ms"] = moved / (copy_gbs * 1e9) * 1e3
            r["roofline_share"] = r["roofline_ms"] / r["ms_per_step"]
        gb = [fmt(r[k] / 1e9, ".2f") if k in r else "-" for k in ("weight_bytes", "kv_bytes", "state_bytes")]
        share = fmt(100 * r["roofline_share"], ".0f") + "%" if "roofline_share" in r else "-"
        print(DECODE_ROW.format(r["system"], fmt(r.get("ms_per_step"), ".2f"), *gb, fmt(r.get("roofline_ms"), ".2f"),
                                share, status(r)))
    print_startup(rows)
    best = best_engine(rows)
    if best is None:
        return f"{model} / decode: >= {TARGET_ROOFLINE:.0%} of the roofline: not measured"
    verdict = "met" if best["roofline_share"] >= TARGET_ROOFLINE else "MISSED"
    return (f"{model} / decode: {best['system']} step >= {TARGET_ROOFLINE:.0%} of the roofline: {verdict} "
            f"({best['roofline_share']:.0%})")


def print_startup(rows: list[dict]) -> None:
    """Each engine's start-up by phase: construction's (the runner's `startup_s`, and the rest of it), then
    the 2-prompt call."""
    for r in rows:
        if phases := r.get("startup_phases_s"):
            parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items())
            rest = r["startup_s"] - r["first_call_s"] - sum(phases.values())
            print(f"{r['system']} start-up {r['startup_s']:.1f} s: {parts}, the rest of construction {rest:.1f}; "
                  f"the 2-prompt call {r['first_call_s']:.1f}")


def capture(row: dict) -> str:
    """Seconds the engine's decode graphs took at start, with those of their warm-up launches (where kernels
    compile) in brackets."""
    seconds, warm = row.get("graph_capture_s"), row.get("graph_warmup_s")
    return fmt(seconds, ".1f") + (f" ({warm:.1f})" if seconds and warm is not None else "")


def best_engine(rows: list[dict]) -> dict | None:
    """The row the targets judge: engine-on where it ran, else engine-off."""
    return next((r for s in ENGINE_SYSTEMS for r in rows if r["system"] == s and r["status"] == "ok"), None)


def status(row: dict) -> str:
    """A row's status and its notes."""
    return row["status"] + (f" ({row['note']})" if row.get("note") else "")


def device_name(device: str) -> str:
    """The card's name, or the CPU's."""
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    """Measure the copy bandwidth, run every model x workload x system, print the tables and targets."""
    args = parse_args()
    args.t0 = time.perf_counter()
    if args.smoke:
        torch.set_num_threads(1)  # a shared 2-core CI box: two OpenMP threads wait on each other (100x slower)
    state = {"device": device_name(args.device), "torch": torch.__version__, "transformers": transformers.__version__,
             "smoke": args.smoke, "copy_gbs": runs.copy_bandwidth(args.device), "runs": [], "targets": []}
    print(f"{state['device']}: torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}; "
          f"copy bandwidth {state['copy_gbs']:.0f} GB/s")
    plan = [(m, i, s) for m in args.models for i in args.workloads for s in args.systems
            if i != "decode" or s in ENGINE_SYSTEMS]
    bar = tqdm(total=len(plan), desc="runs", disable=not args.progress)
    for model in args.models:
        path = None if past_budget(args) else runs.prepare_model(args.cache_dir, model, args.torch_dtype, args.device)
        for item in args.workloads:
            rows = []
            for m, i, system in plan:
                if (m, i) == (model, item):
                    bar.set_postfix_str(f"{model} {item} {system}")
                    rows.append(run_one(model, path, item, system, args))
                    bar.update()
            line = (print_decode(model, rows, state["copy_gbs"]) if item == "decode"
                    else print_workload(model, item, rows, args))
            print_profile(rows)
            state["runs"] += rows
            state["targets"].append(line)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(state, indent=1))
    bar.close()
    print("\ntargets:\n" + "\n".join(state["targets"]) + f"\nresults: {args.json}")
    sys.exit(1 if any(r["status"].startswith("failed") for r in state["runs"]) else 0)


if __name__ == "__main__":
    main()
