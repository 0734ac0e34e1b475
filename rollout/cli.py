"""The `rollout` command: `sample`, `demo`, `serve` and `stop` (see `rollout COMMAND --help`)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from rollout.cli_options import (
    check_n,
    cluster_options,
    config_overrides,
    sampling_flags,
    sampling_options,
    service_options,
)
from rollout.config import LOCAL_CONFIG, load_service_config
from rollout.out_file import check_out, write_out
from rollout.prompt_file import at_line, read_prompts


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rollout` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt as err:  # Ctrl-C: what was left undone, not a traceback
        parser.exit(130, f"rollout {args.command}: interrupted" + (f"; {err}\n" if str(err) else "\n"))
    except Exception as err:
        from ray.exceptions import RayError  # loaded already whenever Ray could have raised

        if not isinstance(err, (ValueError, RuntimeError, OSError, RayError)):  # OSError: ConnectionError too
            raise
        parser.exit(2, f"rollout {args.command}: error: {err}\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description=(
        "Rollout service for RL post-training: LLM engines on Ray workers stream sampled completions "
        "as Arrow record batches."))
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    service, sampling, cluster = service_options(), sampling_options(), cluster_options()
    sample = _command(sub, _sample, [service, sampling], "sample completions of a JSONL prompt file into Parquet")
    sample.add_argument("--prompts", type=Path, required=True, help=(
        "JSONL file (UTF-8), one prompt per line: a string, a list of token ids, or an object with a \"prompt\" "
        "field holding either (its other fields are not read)"))
    sample.add_argument("--out", type=Path, required=True, help=(
        "Parquet file to write once every sample has arrived (replaced if it exists)"))
    demo = _command(sub, _demo, [sampling], "sample a tiny random-weight model on 2 local CPU workers")
    demo.add_argument("--out", type=Path, default=Path("rollout_demo.parquet"),
                      help="Parquet file to write (default: rollout_demo.parquet; replaced if it exists)")
    serve = _command(sub, _serve, [service, cluster], "start the service on a Ray cluster (a job entrypoint)")
    serve.add_argument("--detach", action="store_true", help=(
        "return once the service is ready, leaving it running (stop it with `rollout stop`); by default "
        "it runs until this process is stopped, e.g. by `ray job stop`"))
    _command(sub, _stop, [service, cluster], "stop a service started with `rollout serve` (--detach or not)")
    return parser


def _command(sub: Any, run: Any, parents: list[argparse.ArgumentParser], help_text: str) -> argparse.ArgumentParser:
    """A subcommand named after `run` (`_sample` -> `sample`), described by its docstring."""
    name = run.__name__.lstrip("_")
    command = sub.add_parser(name, parents=parents, help=help_text, description=run.__doc__)
    command.set_defaults(run=run, command=name)
    return command


def _sample(args: argparse.Namespace) -> int:
    """Sample --n completions of every prompt in --prompts with the service of --config, started for this
    command on an embedded local Ray (by default 2 CPU workers) and stopped after, write them to --out as
    Parquet and print a summary. A service running on a cluster is sampled from Python, with
    trainer_client.RolloutClient.connect."""
    from rollout.stream import sampling_params

    prompts, lines = read_prompts(args.prompts)
    check_out(args.out)
    sampling_params(args.n, sampling_flags(args))  # bad flags fail before Ray starts
    check_n(args.n, load_service_config(args.config, **config_overrides(args)))
    try:
        _run(prompts, args, args.config, **config_overrides(args))
    except ValueError as err:  # the engines' errors name a prompt by its place in the call
        raise at_line(err, args.prompts, lines) from None
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Build (once, cached under ~/.cache/rollout/) a tiny Qwen3-style model with RANDOM weights and its
    tokenizer, start the embedded service with 2 CPU workers, sample --n completions of a few built-in
    prompts, write them to --out and print a summary. The completions are gibberish: the weights are
    random; the demo shows the machinery, not a model."""
    from rollout.demo import DEMO_PROMPTS, demo_model
    from rollout.stream import sampling_params

    check_out(args.out)
    sampling_params(args.n, sampling_flags(args))  # bad flags fail before the model is built or Ray starts
    check_n(args.n, load_service_config(LOCAL_CONFIG), "the demo's engines are fixed; `rollout sample` takes --set "
            "max_num_seqs=N")
    print("rollout demo: a tiny model with RANDOM weights, so the completions are gibberish.")
    table = _run(DEMO_PROMPTS, args, LOCAL_CONFIG, model=demo_model(), num_workers=2)
    for row in table.slice(0, 2).to_pylist():
        print(f"  prompt {DEMO_PROMPTS[row['prompt_index']]!r} -> {row['text'][:60]!r}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Start the service of --config as named actors (`name` in `namespace`) on a running Ray cluster and
    wait until every engine is loaded; trainers then connect with RolloutClient.connect(name, namespace).
    It runs until this process is stopped (`ray job stop`, SIGTERM, Ctrl-C), or with --detach returns once
    the engines have loaded and keeps running."""
    import ray

    from rollout.local_ray import join_cluster
    from rollout.service import launch, stop

    config = load_service_config(args.config, **config_overrides(args))
    join_cluster(args.address, config.namespace)
    with _sigterm_as_interrupt():  # while the engines load: `ray job stop` ends it as Ctrl-C does
        service = launch(config, detached=args.detach)
    print(f"rollout service {config.name!r} ready in namespace {config.namespace!r} with "
          f"{ray.get(service.ready.remote())} workers", flush=True)
    if args.detach:
        return 0
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        by = " by `rollout stop` (or ray.kill)" if wait_for_stop(service, config.name, stopping) else ""
    finally:
        stop(service)
    print(f"rollout service {config.name!r} stopped{by}", flush=True)
    return 0


def wait_for_stop(service: Any, name: str, stopping: threading.Event) -> bool:
    """Return once `stopping` is set (False), or once the service actor was killed on purpose (True:
    `rollout stop`); RuntimeError as soon as it dies otherwise: Ray does not restart a foreground service, so
    `rollout serve` (a job) must fail rather than run on without it."""
    import ray

    probe = service.ready.remote()
    while not stopping.wait(1.0):
        if ray.wait([probe], timeout=0)[0]:
            try:
                ray.get(probe)
            except ray.exceptions.RayActorError as err:
                if "killed by `ray.kill`" in str(err):  # Ray's words for a kill, not a loss
                    return True
                raise RuntimeError(f"the service actor {name!r} died, and with it its workers ({err})") from None
            probe = service.ready.remote()
    return False


def _stop(args: argparse.Namespace) -> int:
    """Stop the service named by --config (its workers, the service actor and its weight keeper) on a running
    Ray cluster; exit status 1 when no such service runs (a keeper it left behind is stopped all the same). A
    `rollout serve` running in the foreground then exits with status 0, as after `ray job stop`."""
    from rollout.local_ray import join_cluster, named_actor
    from rollout.service import stop
    from rollout.weight_keeper import stop_keeper

    config = load_service_config(args.config, **config_overrides(args))
    join_cluster(args.address, config.namespace)
    service = named_actor(config.name, config.namespace)
    if service is not None:
        stop(service)
    stop_keeper(config)  # in case the service was dead and could not
    if service is None:
        print(f"rollout stop: no service {config.name!r} runs in namespace {config.namespace!r}", file=sys.stderr)
        return 1
    print(f"rollout service {config.name!r} stopped", flush=True)
    return 0


def _run(prompts: list, args: argparse.Namespace, config: str | Path, **overrides: Any) -> pa.Table:
    """Start the embedded service of `config`, sample with a progress bar, stop the service, write the Parquet
    file, print the summary. SIGTERM is Ctrl-C meanwhile, from Ray's start to its stop."""
    import rollout

    try:
        with _sigterm_as_interrupt():
            rollout.init(config, **overrides)
            try:
                start = time.perf_counter()
                table = rollout.sample(prompts, n=args.n, progress=True, **sampling_flags(args)).to_table()
                seconds = time.perf_counter() - start
            finally:
                rollout.shutdown()
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{str(args.out)!r} was not written (it is written once every sample has "
                                "arrived)") from None
    write_out(table, args.out)
    print(summary(table, seconds))
    print(f"wrote {args.out}")
    return table


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile, as Ctrl-C does (Ray's own handler aborts with a core dump,
    skipping the shutdown of the embedded Ray)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def summary(table: pa.Table, seconds: float) -> str:
    """Samples, generated tokens, tokens/s, finish reasons and samples preempted of a finished call (not a sum of
    `num_preemptions`: a prompt's preemption before its fork is in each of its samples' counts)."""
    tokens = pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0
    reasons = pc.value_counts(table.column("finish_reason").cast(pa.string())).to_pylist()
    finished = ", ".join(f"{r['values']} {r['counts']}" for r in reasons)
    preempted = pc.sum(pc.greater(table.column("num_preemptions"), 0).cast(pa.int64())).as_py() or 0
    return (f"{table.num_rows} samples, {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} tokens/s); "
            f"finish: {finished or '-'}; {preempted} preempted")


if __name__ == "__main__":
    sys.exit(main())
