"""GRPO on the rollout service's public API, with rollout-trainer agreement measured every iteration.

Task: make the model write numbers. The reward of a sample is the share of its generated tokens whose text
is made of ASCII digits only ("7", " 3", "20": 14 of the demo tokenizer's 512 ids), a verifiable rule in
[0, 1]; the demo's tiny random model starts near 0.03.

Each iteration: `rollout.sample(prompts, n=8, return_token_versions=True)` streams record batches, each
scored as it arrives; advantages are the rewards normalised within each prompt's group of 8; the loss is the
clipped policy gradient with ratio exp(trainer logprob - rollout logprob), the trainer's logprobs coming from
a plain transformers forward in float32 (no KL term); then one AdamW step and
`rollout.update_weights(model.state_dict(), version=i + 1)`. Sampling runs at temperature 1 without
filtering, so the rollout's "processed" logprobs are the model's own log-softmax, the same thing the
trainer computes.

Agreement, before the optimizer step: |trainer logprob - rollout logprob| of every generated token (max and
mean) under the weights that produced it, and whether every sample's versions are the ones it was drawn
under (`policy_version`, `first_policy_version`, `token_policy_versions`).

--async-rollouts: the samples of iteration i + 1 are requested before iteration i's optimizer step, so they
are generated while the trainer computes and while update i + 1 lands (mode "continue"): a sample may start
under version i and end under version i + 1. The trainer keeps the previous version's weights for that
reason. The ratio's denominator is each token's rollout logprob, i.e. the policy that really produced that
token (`token_policy_versions` says which), and agreement is measured against that policy: older-version
tokens with the kept weights; new-version tokens of a sample that spans the update by replaying what the
engine did, the old weights' keys and values up to the switch and the new weights from there on (a
"continue" update keeps the KV cached before it). See `grpo.producing_logprobs`.

    PYTHONPATH=. python scripts/train_grpo.py --report report.json --plot reward.png [--async-rollouts]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import torch
import transformers
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `grpo`, beside this file

from grpo import group_advantages, grpo_loss, mismatch, producing_logprobs, score, target_token_ids, token_logprobs  # noqa: E402

import rollout  # noqa: E402
from rollout.demo import DEMO_PROMPTS, demo_model  # noqa: E402
from rollout.local_ray import join_cluster  # noqa: E402
from rollout.schema import sort_samples  # noqa: E402
from trainer_client import to_torch  # noqa: E402

N = 8  # samples per prompt: one GRPO group
SEED_STRIDE = 1_000_003  # iteration i samples with seed --seed * SEED_STRIDE + i


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None (such flags say in their help what leaving them out does)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line's flags, each with its help."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsShown)
    p.add_argument("--iterations", type=int, default=20, help="training iterations (sample, score, step, push)")
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model directory (default: the demo's tiny random model, built on first use)")
    p.add_argument("--num-workers", type=int, default=2, help="rollout workers (one CPU each)")
    p.add_argument("--transport", choices=["object_store", "broadcast"], default="object_store",
                   help="how new weights reach the workers: Ray's object store, or a torch.distributed "
                        "broadcast group formed once with rollout.init_weight_sync()")
    p.add_argument("--async-rollouts", action="store_true",
                   help="sample iteration i+1 while update i+1 lands (mode 'continue'); the loss weights each "
                        "token by the policy version that produced it")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster ('auto': RAY_ADDRESS or the local head) instead of starting "
                        "an embedded local Ray")
    p.add_argument("--seed", type=int, default=0, help="seeds torch and the sampling noise")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch threads of this (trainer) process; more than the cores the workers leave free "
                        "oversubscribes them (with --async-rollouts on 2 cores, 2 threads made steps 3-10x slower)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="generated tokens per sample at most")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio")
    p.add_argument("--report", type=Path, default=None,
                   help='write {"iterations": [...]} to this JSON file, one object per iteration: iteration, '
                        "policy_version (the workers' version when its samples were requested), reward_mean, "
                        "samples, logprob_mismatch_max, logprob_mismatch_mean, versions_ok, seconds, "
                        "tokens_by_version")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of reward and agreement per iteration")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any work starts (bad values exit with status 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("iterations", "num_workers", "max_new_tokens", "trainer_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (0 < args.lr < math.inf and 0 < args.clip < 1):
        p.error("--lr must be a finite number > 0 and --clip in (0, 1)")
    if not (args.seed >= 0 and args.seed * SEED_STRIDE + args.iterations - 1 < 2**64):
        p.error(f"--seed {args.seed} must be in [0, {(2**64 - args.iterations) // SEED_STRIDE}] (it seeds the "
                "sampling noise, an integer in [0, 2**64))")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a model directory (no config.json)")
    if args.model is not None:
        try:
            target_token_ids(transformers.AutoTokenizer.from_pretrained(args.model))
        except (OSError, ValueError) as err:
            p.error(f"--model {args.model}: {err}")
    for path in (args.report, args.plot):
        if path is not None and not path.resolve().parent.is_dir():
            p.error(f"{path}: its directory does not exist")
        if path is not None and path.is_dir():
            p.error(f"{path} is a directory; give a file name")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        p.error(f"--plot {args.plot} must name a .png file")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib")
    return args


def open_samples(args: argparse.Namespace, iteration: int) -> rollout.RolloutStream:
    """Request the samples of `iteration`: n = 8 per demo prompt, temperature 1, no filtering."""
    return rollout.sample(DEMO_PROMPTS, n=N, temperature=1.0, max_new_tokens=args.max_new_tokens,
                          seed=args.seed * SEED_STRIDE + iteration, return_token_versions=True, progress=True)


def collect(stream: rollout.RolloutStream, targets: torch.Tensor, pad_token_id: int | None) -> pa.Table:
    """Every sample of `stream`, each batch scored as it arrives, ordered by prompt then sample."""
    return sort_samples(pa.Table.from_batches([score(b, targets, pad_token_id) for b in stream]))


def versions_ok(table: pa.Table, first: int, last: int) -> bool:
    """True when every token was made by version `first` or `last`, never going back, and each row's
    `first_policy_version` and `policy_version` are its first and last token's version."""
    rows = table.select(["token_policy_versions", "first_policy_version", "policy_version"]).to_pylist()
    return all(r["token_policy_versions"] and set(r["token_policy_versions"]) <= {first, last}
               and r["token_policy_versions"] == sorted(r["token_policy_versions"])
               and r["first_policy_version"] == r["token_policy_versions"][0]
               and r["policy_version"] == r["token_policy_versions"][-1] for r in rows)


def train_step(model: transformers.PreTrainedModel, optimizer: torch.optim.Optimizer, table: pa.Table,
               policies: dict[int, transformers.PreTrainedModel], version: int, args: argparse.Namespace,
               pad_token_id: int | None) -> tuple[float, float]:
    """One GRPO step on `table` by the trainer at `version` (`policies` holds it and the previous one);
    returns the logprob mismatch (max, mean), measured before the optimizer step."""
    tensors = to_torch(table, pad_token_id)
    rewards = torch.tensor(table.column("reward").to_numpy())
    advantages = group_advantages(rewards, tensors["prompt_index"])
    mask = tensors["response_mask"]
    logprobs = token_logprobs(model, tensors)
    token_versions = table.column("token_policy_versions").to_pylist()
    produced = producing_logprobs(policies, logprobs, tensors, token_versions, version)
    agreement = mismatch(produced, tensors["logprobs"], mask)
    loss = grpo_loss(logprobs, tensors["logprobs"], advantages, mask, args.clip)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return agreement


def push(model: transformers.PreTrainedModel, version: int, args: argparse.Namespace) -> None:
    """Make the trainer's weights policy `version` of every worker (samples in flight continue on them)."""
    transport = "broadcast" if args.transport == "broadcast" else None
    rollout.update_weights(model.state_dict(), version=version, mode="continue", transport=transport)


def run(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    """The training loop on a running service; returns one report entry per iteration."""
    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    targets, pad = target_token_ids(tokenizer), tokenizer.pad_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    previous: transformers.PreTrainedModel | None = None
    stream, report = open_samples(args, 0), []
    for i in range(args.iterations):
        start = time.perf_counter()
        drawn_under = max(i - 1, 0) if args.async_rollouts else i  # the workers' version when it was requested
        table = collect(stream, targets, pad)
        if args.async_rollouts and i + 1 < args.iterations:
            stream = open_samples(args, i + 1)  # generated during this step and while update i + 1 lands
        policies = {i: model} if previous is None else {i: model, i - 1: previous}
        if args.async_rollouts:
            previous = copy.deepcopy(model)
        worst, mean = train_step(model, optimizer, table, policies, i, args, pad)
        push(model, i + 1, args)
        if not args.async_rollouts and i + 1 < args.iterations:
            stream = open_samples(args, i + 1)
        report.append(entry(i, drawn_under, table, (worst, mean), time.perf_counter() - start))
    return report


def entry(i: int, drawn_under: int, table: pa.Table, agreement: tuple[float, float], seconds: float) -> dict:
    """The report's object for iteration `i`, also printed as one line."""
    tokens = Counter(v for row in table.column("token_policy_versions").to_pylist() for v in row)
    item = {"iteration": i, "policy_version": drawn_under,
            "reward_mean": float(table.column("reward").to_numpy().mean()), "samples": table.num_rows,
            "logprob_mismatch_max": agreement[0], "logprob_mismatch_mean": agreement[1],
            "versions_ok": versions_ok(table, drawn_under, i), "seconds": seconds,
            "tokens_by_version": {str(v): n for v, n in sorted(tokens.items())}}
    tqdm.write(f"iter {i:3d}  reward {item['reward_mean']:.3f}  mismatch max {agreement[0]:.1e} "
               f"mean {agreement[1]:.1e}  versions {'ok' if item['versions_ok'] else 'WRONG'} "
               f"{item['tokens_by_version']}  {sum(tokens.values()) / seconds:,.0f} tok/s  {seconds:.2f} s")
    return item


def plot(report: list[dict], path: Path, title: str) -> None:
    """A small PNG: reward per iteration above, logprob mismatch (max and mean, log scale) below."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    its = [r["iteration"] for r in report]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 4.5), sharex=True, dpi=80)
    top.plot(its, [r["reward_mean"] for r in report], marker="o")
    top.set(ylabel="reward (digit share)", title=title)
    bottom.semilogy(its, [max(r["logprob_mismatch_max"], 1e-12) for r in report], marker="o", label="max")
    bottom.semilogy(its, [max(r["logprob_mismatch_mean"], 1e-12) for r in report], marker="o", label="mean")
    bottom.set(xlabel="iteration", ylabel="|trainer - rollout| logprob")
    bottom.legend()
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse flags, start the service, train, write the report and plot, stop the service."""
    args = parse_args(argv)
    model_dir = args.model or demo_model()
    if args.address:
        join_cluster(args.address, "rollout")
    rollout.init(model=str(model_dir), num_workers=args.num_workers, device="cpu", dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.trainer_threads)
    try:
        if args.transport == "broadcast":
            rollout.init_weight_sync()
        start = time.perf_counter()
        report = run(args, model_dir)
        print(f"{args.iterations} iterations in {time.perf_counter() - start:.1f} s; reward "
              f"{report[0]['reward_mean']:.3f} -> {report[-1]['reward_mean']:.3f}")
    finally:
        torch.set_num_threads(threads)  # as it was: main may run inside a larger program (the tests)
        rollout.shutdown()
    if args.report:
        args.report.write_text(json.dumps({"iterations": report}, indent=1) + "\n")
    if args.plot:
        mode = "async rollouts" if args.async_rollouts else "synchronous"
        plot(report, args.plot, f"GRPO, {mode}, {args.num_workers} CPU workers")
    return report


if __name__ == "__main__":
    main()
