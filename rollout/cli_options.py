"""The flags of the `rollout` command, shared by its subcommands, and what they mean to the service and the
sampler."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import tomllib

from rollout.config import LOCAL_CONFIG, ServiceConfig
from rollout.params import SamplingParams

SAMPLING_FLAGS = {  # SamplingParams field -> (type, help); --help shows SamplingParams' defaults
    "temperature": (float, "sampling temperature; 0 = greedy"),
    "top_p": (float, "nucleus sampling threshold in (0, 1]"),
    "top_k": (int, "keep the k most likely tokens; 0 = off"),
    "min_p": (float, "drop tokens less likely than min_p times the most likely one"),
    "max_new_tokens": (int, "most tokens generated per sample"),
    "seed": (int, "makes every sample reproducible (default: a fresh seed per prompt)"),
    "logprobs_mode": (str, "'processed' (after temperature and filters; greedy: the model's) or 'raw' (the model's)"),
}


def service_options() -> argparse.ArgumentParser:
    """--config, --model, --num-workers and --set: which service to start or reach."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("service")
    group.add_argument("--config", type=Path, default=LOCAL_CONFIG,
                       help="service config TOML (default: configs/local.toml, 2 CPU workers)")
    group.add_argument("--model", help="Hugging Face model directory (overrides engine.model)")
    group.add_argument("--num-workers", type=int, help="number of workers (overrides num_workers)")
    group.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=(
        "override a config field, the value in TOML syntax, e.g. --set flush_rows=32 --set dtype=bfloat16 "
        "(engine fields are named directly); repeatable"))
    return options


def sampling_options() -> argparse.ArgumentParser:
    """--n and the SamplingParams flags (left out of the namespace unless given)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("sampling")
    group.add_argument("--n", type=int, default=8, help="samples per prompt (default: 8)")
    defaults = SamplingParams()
    for field, (kind, help_text) in SAMPLING_FLAGS.items():
        default = getattr(defaults, field)
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(f"--{field.replace('_', '-')}", type=kind, default=argparse.SUPPRESS,
                           help=help_text + shown)
    group.add_argument("--stop-token-ids", type=int, nargs="+", action="extend", default=argparse.SUPPRESS,
                       metavar="ID", help="token ids that end a sample, besides the model's EOS (repeatable)")
    group.add_argument("--stop", nargs="+", action="extend", default=argparse.SUPPRESS, metavar="TEXT",
                       help="strings that end a sample; the token completing one stays in it (repeatable; one starting "
                       "with '-' as --stop=-->)")
    group.add_argument("--ignore-eos", action="store_true", default=argparse.SUPPRESS,
                       help="keep generating after the model's EOS token")
    return options


def cluster_options() -> argparse.ArgumentParser:
    """--address: the Ray cluster of `serve` and `stop`."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--address", default="auto", help=(
        "Ray cluster to join, HOST:PORT (default: auto = RAY_ADDRESS, as set in a Ray job, or the head node "
        "`ray start --head` started on this machine; never another process's embedded Ray)"))
    return options


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config field overrides from --model, --num-workers and --set FIELD=VALUE."""
    out: dict[str, Any] = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r} must have the form FIELD=VALUE")
        try:
            out[field.strip()] = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError as err:
            if value.lstrip()[:1] in ("[", "{", '"', "'"):
                raise ValueError(f"--set {item!r}: the value is not TOML ({err})") from None
            out[field.strip()] = value  # a bare string, e.g. --set model=/models/x
    if args.model is not None:
        out["model"] = args.model
    if args.num_workers is not None:
        out["num_workers"] = args.num_workers
    return out


def check_n(n: int, config: ServiceConfig, raise_it: str = "raise it with --set max_num_seqs=N") -> None:
    """Refuse --n above the engines' `max_num_seqs` now: a prompt's samples run together on one engine, which
    would refuse them only once Ray and the engines had started. `raise_it` says how, where the command can."""
    if n > config.engine.max_num_seqs:
        raise ValueError(f"--n {n} exceeds max_num_seqs={config.engine.max_num_seqs}: a prompt's samples run "
                         f"together on one engine ({raise_it})")


def sampling_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling keywords given on the command line (the rest keep SamplingParams' defaults)."""
    return {name: getattr(args, name) for name in [*SAMPLING_FLAGS, "stop_token_ids", "stop", "ignore_eos"]
            if hasattr(args, name)}
