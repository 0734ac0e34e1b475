"""Where a decode step's device time goes: torch's profiler over a few engine steps, by kernel.

bench_gpu.py's decode probe calls `profile_steps` after its timed steps (--profile-decode K), so the timing
itself runs unprofiled. On a GPU the rows are CUDA kernels (those a CUDA graph replays included, as CUPTI
reports them); on the CPU (--smoke) they are aten operators, whose figures mean nothing.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity

PROFILE_STEPS = 8
NAME_WIDTH = 90


def profile_steps(step: Callable[[], object], device: str, top: int, steps: int = PROFILE_STEPS) -> dict:
    """Run `step` `steps` times under the profiler; the device time per step in all and of the `top` kernels
    (or CPU operators) that take most: {"steps", "busy_ms_per_step", "kernels": [[name, ms, calls], ...]}
    with ms and calls per step, or {"error": why} when the profiler fails (the timing before it stands)."""
    try:
        return _profile(step, device, top, steps)
    except Exception as err:  # a profiler the machine lacks (CUPTI) must not lose the probe's timing
        return {"error": f"{type(err).__name__}: {err}"}


def _profile(step: Callable[[], object], device: str, top: int, steps: int) -> dict:
    cuda = device.startswith("cuda")
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append([event.key, us / steps / 1e3, event.count / steps])
    rows.sort(key=lambda row: -row[1])
    return {"steps": steps, "busy_ms_per_step": sum(row[1] for row in rows), "kernels": rows[:top]}


def print_profile(rows: list[dict]) -> None:
    """Per engine row with a profile: its busy time against its step time, then its top kernels."""
    for r in rows:
        profile = r.get("profile")
        if not profile:
            continue
        if "error" in profile or not profile["kernels"]:
            print(f"\n{r['system']}: no kernel profile ({profile.get('error', 'no kernel recorded')})")
            continue
        busy, step = profile["busy_ms_per_step"], r["ms_per_step"]
        print(f"\n{r['system']}: the device is busy {busy:.2f} ms of each {step:.2f} ms step "
              f"({busy / step:.0%}; profiled over {profile['steps']} steps), the top kernels:")
        print(f"{'ms/step':>9}{'of busy':>9}{'calls':>7}  kernel")
        for name, ms, calls in profile["kernels"]:
            short = name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."
            print(f"{ms:>9.3f}{ms / busy:>9.1%}{calls:>7.0f}  {short}")
