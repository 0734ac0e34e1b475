"""scripts/train_grpo.py end to end on two CPU workers: three iterations write a report of the promised shape,
the trainer's float32 logprobs agree with the rollout's to 1e-4 under the weights that produced each token,
and every sample carries the versions it was drawn under (synchronous, and with --async-rollouts over the
broadcast transport). Bad flags fail before any work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import train_grpo  # noqa: E402
from grpo import group_advantages  # noqa: E402

KEYS = {"iteration", "policy_version", "reward_mean", "samples", "logprob_mismatch_max", "logprob_mismatch_mean",
        "versions_ok", "seconds"}


@pytest.mark.parametrize("flags", [[], ["--async-rollouts", "--transport", "broadcast"]], ids=["sync", "async"])
def test_three_iterations_agree_and_carry_their_versions(model_dir, tmp_path, flags):
    report, png = tmp_path / "report.json", tmp_path / "curve.png"
    train_grpo.main(["--iterations", "3", "--model", model_dir("qwen3"), "--max-new-tokens", "12",
                     "--report", str(report), "--plot", str(png), *flags])
    iterations = json.loads(report.read_text())["iterations"]
    assert [it["iteration"] for it in iterations] == [0, 1, 2]
    for it in iterations:
        assert KEYS <= it.keys()
        assert it["samples"] == len(train_grpo.DEMO_PROMPTS) * train_grpo.N
        assert 0 <= it["reward_mean"] <= 1 and it["seconds"] > 0
        assert it["logprob_mismatch_max"] <= 1e-4 and it["logprob_mismatch_mean"] <= it["logprob_mismatch_max"]
        assert it["versions_ok"]
    if flags:  # drawn while the previous update landed: under the version before this iteration's
        assert [it["policy_version"] for it in iterations] == [0, 0, 1]
        assert all(set(it["tokens_by_version"]) <= {str(max(i - 1, 0)), str(i)} for i, it in enumerate(iterations))
    else:
        assert [it["policy_version"] for it in iterations] == [0, 1, 2]
        assert [list(it["tokens_by_version"]) for it in iterations] == [["0"], ["1"], ["2"]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, message", [
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--transport", "nccl"], "invalid choice"),
    (["--model", "/nonexistent"], "not a model directory"),
    (["--report", "/nonexistent/dir/r.json"], "its directory does not exist"),
    (["--report", "/tmp"], "/tmp is a directory"),
    (["--plot", "/tmp/curve.xyz"], "--plot /tmp/curve.xyz must name a .png file"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--seed", "-1"], "--seed -1 must be in [0, "),
    (["--seed", "-1", "--iterations", "1000004"], "--seed -1 must be in [0, "),
    (["--seed", str(2**64 // 1_000_003 + 1)], "it seeds the sampling noise"),
])
def test_bad_flags_fail_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_grpo.parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_model_without_digit_tokens_fails_before_any_work(zoo_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_grpo.parse_args(["--model", zoo_dir("qwen3")])  # no tokenizer files
    assert exit_info.value.code == 2 and "the tokenizer has no digit tokens" in capsys.readouterr().err


def test_a_group_of_equal_rewards_has_no_advantage():
    """In float32 the mean of six rewards of 5/7 misses 5/7 by a unit in the last place, which over a std of
    the same size gave every sample an advantage of -0.056."""
    rewards = torch.tensor([5 / 7] * 6 + [0.0, 1.0], dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor([0] * 6 + [1, 1]))
    assert advantages[:6].tolist() == [0.0] * 6 and advantages[6:].tolist() == [-1.0, 1.0]
