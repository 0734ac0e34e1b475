"""The `rollout` command's options and prompt file reach the service as given (with stand-ins of `rollout.init`,
`sample` and `shutdown`): every prompt once and in order, every flag, the defaults --help shows, flags checked
before anything starts, and every row of the call in the Parquet file."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout import SamplingParams
from rollout.cli import main
from rollout.config import LOCAL_CONFIG

RECORDED = pa.table({"prompt_index": [1, 0, 1], "token_ids": [[4, 5], [6], [7, 8]], "num_preemptions": [0, 2, 1],
                     "finish_reason": pa.array(["length", "stop", "length"]).dictionary_encode()})


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """`rollout.init`, `sample` and `shutdown` stand-ins that record their arguments; `sample` gives RECORDED."""
    calls: dict = {}
    monkeypatch.setattr("rollout.init", lambda *args, **kwargs: calls.update(init=(args, kwargs)))
    monkeypatch.setattr("rollout.shutdown", lambda: calls.update(shutdown=True))
    monkeypatch.setattr("rollout.sample", lambda prompts, **kwargs: (
        calls.update(sample=(prompts, kwargs)), SimpleNamespace(to_table=lambda: RECORDED))[1])
    return calls


@pytest.mark.parametrize("argv, init, sampling", [
    ([], {}, {"n": 8}),
    (["--n", "3", "--temperature", "0", "--top-p", "0.9", "--top-k", "0", "--min-p", "0.1", "--max-new-tokens", "5",
      "--seed", "0", "--logprobs-mode", "raw", "--stop-token-ids", "3", "4", "--stop", "</a>", "END",
      "--ignore-eos", "--model", "/m", "--num-workers", "1", "--set", "flush_rows=2", "--set", "dtype=bfloat16"],
     {"flush_rows": 2, "dtype": "bfloat16", "model": "/m", "num_workers": 1},
     {"n": 3, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "min_p": 0.1, "max_new_tokens": 5, "seed": 0,
      "logprobs_mode": "raw", "stop_token_ids": [3, 4], "stop": ["</a>", "END"], "ignore_eos": True}),
    (["--stop", "</a>", "--stop-token-ids", "3", "--stop", "END", "--stop-token-ids", "4", "5"], {},  # repeated
     {"n": 8, "stop_token_ids": [3, 4, 5], "stop": ["</a>", "END"]}),
])
def test_sample_passes_every_prompt_and_flag_and_writes_every_row(tmp_path, recorded, capsys, argv, init, sampling):
    """Each prompt of the file once, in order (a byte-order mark and blank lines skipped; lines end at "\\n" only,
    as U+2028 or U+0085 may stand unescaped in a JSON string), each flag given (zeros too) and no other reach the
    service; the file holds the call's table as it came, and the summary counts it."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.parquet"
    lines = ['"Grüße 😀"', "", "  \t", "[0, 5]\r", '{"prompt": "x", "id": 3}', '{"prompt": [9]}', '"a\u2028b\x85c"',
             '"x"']
    prompts.write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")  # with a byte-order mark
    assert main(["sample", "--prompts", str(prompts), "--out", str(out), *argv]) == 0
    assert recorded["init"] == ((LOCAL_CONFIG,), init) and recorded["shutdown"]
    expected = ["Grüße 😀", [0, 5], "x", [9], "a\u2028b\x85c", "x"]
    assert recorded["sample"] == (expected, {**sampling, "progress": True})
    assert pq.read_table(out).equals(RECORDED)
    printed = capsys.readouterr().out
    assert "3 samples, 5 tokens in " in printed and "finish: length 2, stop 1; 2 preempted" in printed
    assert f"wrote {out}" in printed


@pytest.mark.parametrize("command", ["sample", "demo", "serve", "stop"])
def test_help(command, capsys):
    """Every command has --help; the sampling flags show SamplingParams' defaults."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0 and "usage: rollout " + command in shown
    if command in ("sample", "demo"):
        defaults = SamplingParams()
        assert "samples per prompt (default: 8)" in shown
        assert f"sampling temperature; 0 = greedy (default: {defaults.temperature})" in shown
        assert f"most tokens generated per sample (default: {defaults.max_new_tokens})" in shown


@pytest.mark.parametrize("command, flags, named", [
    *[(command, ["--n", "0"], "n=0") for command in ("demo", "sample")],
    *[(command, ["--n", "257"], "--n 257 exceeds max_num_seqs=256") for command in ("demo", "sample")],
    ("sample", ["--n", "5", "--set", "max_num_seqs=4"], "max_num_seqs=4"),
    ("sample", ["--n", "257"], "(raise it with --set max_num_seqs=N)"),
    ("demo", ["--n", "257"], "(the demo's engines are fixed; `rollout sample` takes --set max_num_seqs=N)"),
])
def test_flags_are_checked_before_building_or_starting_anything(command, flags, named, tmp_path, recorded,
                                                                monkeypatch, capsys):
    """A bad sampling flag, or more samples of a prompt than an engine runs at once, is refused before the demo
    builds its model and before the service starts."""
    monkeypatch.setattr("rollout.demo.demo_model", lambda: pytest.fail("the demo built its model before its flags"))
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    files = ["--prompts", str(tmp_path / "good.jsonl"), "--out", str(tmp_path / "x.parquet")]
    with pytest.raises(SystemExit) as exit_info:
        main([command, *flags, *(files if command == "sample" else [])])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err and "init" not in recorded
