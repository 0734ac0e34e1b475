"""The `rollout` command: `demo` end to end in a fresh process, `sample` from a JSONL file, and errors."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from rollout import local_ray
from rollout.cli import main
from rollout.demo import DEMO_PROMPTS

EMBEDDED_DEFAULT = """
import rollout
print(rollout.sample(["Hello", [5, 6, 7]], n=3, max_new_tokens=4).to_table().num_rows)
rollout.shutdown()
"""


def test_demo_builds_its_model_once_and_is_the_embedded_default(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}  # the model cache and Ray's token go under this HOME
    out = tmp_path / "demo.parquet"
    command = [sys.executable, "-m", "rollout.cli", "demo", "--max-new-tokens", "8", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANDOM weights" in done.stdout and "tokens/s" in done.stdout
    assert (tmp_path / ".cache/rollout/tiny-qwen3/config.json").is_file()
    table = pq.read_table(out)
    assert table.num_rows == len(DEMO_PROMPTS) * 8
    assert set(table.column("worker_id").to_pylist()) == {0, 1}
    # configs/local.toml names the demo's model: `rollout.sample` without `init` now just works
    done = subprocess.run([sys.executable, "-c", EMBEDDED_DEFAULT], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.split()[-1] == "6", done.stderr[-3000:]


def test_sample_reads_jsonl_and_prints_a_summary(tmp_path, model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = ['"The quick brown fox"', "[5, 6, 7, 8]", '{"prompt": "Two plus two"}', '{"prompt": [9, 10]}']
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "samples.parquet"
    code = main(["sample", "--model", model_dir("qwen3"), "--prompts", str(prompts), "--n", "3",
                 "--max-new-tokens", "5", "--ignore-eos", "--num-workers", "1", "--set", "flush_rows=2",
                 "--out", str(out)])
    assert code == 0
    table = pq.read_table(out)
    assert table.num_rows == 12
    assert table.column("prompt_token_ids").to_pylist()[3:6] == [[5, 6, 7, 8]] * 3
    assert {len(tokens) for tokens in table.column("token_ids").to_pylist()} == {5}
    summary = capsys.readouterr().out
    assert "12 samples, 60 tokens" in summary and "; 0 preempted" in summary
    prompts.write_text('"ok"\n\n\n[1, 99999]\n')  # the engines' check, named by the file's line
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--model", model_dir("qwen3"), "--prompts", str(prompts), "--num-workers", "1",
              "--out", str(out)])
    assert exit_info.value.code == 2
    assert f"{prompts}:4: the prompt has token id 99999 outside the vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["sample", "--prompts", "{missing}", "--out", "x.parquet"], "does not exist"),
    (["sample", "--prompts", "{folder}", "--out", "x.parquet"], "is not a file"),
    (["sample", "--prompts", "{binary}", "--out", "x.parquet"], "is not UTF-8 text"),
    (["sample", "--prompts", "{keyless}", "--out", "x.parquet"], ":1: an object needs a \"prompt\" field"),
    (["sample", "--prompts", "{bad}", "--out", "x.parquet"], ":2: not JSON"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--set", "flush_rows"], "FIELD=VALUE"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--set", "flush_rows=0"], "flush_rows=0"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--set", "cuda_graphs=[false, tru]"], "is not TOML"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--top-p", "2"], "top_p=2.0"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--stop", "</answer>", ""], "stop=['</answer>', '']"),
    (["sample", "--prompts", "{empty}", "--out", "x.parquet"], "holds no prompts"),
    (["sample", "--prompts", "{good}", "--out", "{missing}/x.parquet"], "none.jsonl' does not exist"),
    (["sample", "--prompts", "{good}", "--out", "x.CSV"], "'x.CSV': the samples are written as Parquet, not CSV"),
    (["demo", "--out", "x.jsonl"], "'x.jsonl': the samples are written as Parquet, not jsonl"),
    (["sample", "--prompts", "{good}", "--out", "x.parquet", "--model", "{good}/.."], "no config.json"),
])
def test_errors_exit_with_a_message(tmp_path, capsys, argv, message):
    (tmp_path / "bad.jsonl").write_text('"ok"\n{not json\n')
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "binary.jsonl").write_bytes(b'"ok"\n\xff\n')
    (tmp_path / "keyless.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "folder.jsonl").mkdir()
    files = {name: tmp_path / f"{'none' if name == 'missing' else name}.jsonl"
             for name in ("missing", "bad", "good", "empty", "binary", "keyless", "folder")}
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**files) for arg in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "stop"])
@pytest.mark.parametrize("address", [["--address", "auto"], []])
def test_auto_without_a_cluster_exits_with_a_message(command, address, monkeypatch, capsys):
    """`--address auto` (the default) means RAY_ADDRESS or the head node `ray start` left here, never another
    process's embedded Ray that happens to run (Ray's own "auto" joins any it finds), nor a new local one; no
    such cluster is an error."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local_ray, "get_ray_address_file", lambda temp_dir: "/nonexistent/ray_current_cluster")
    monkeypatch.setattr(local_ray.ray, "init", lambda **kwargs: pytest.fail(f"ray.init({kwargs})"))
    with pytest.raises(SystemExit) as exit_info:
        main([command, *address])
    assert exit_info.value.code == 2 and not ray.is_initialized()
    assert f"rollout {command}: error: no Ray cluster to join: RAY_ADDRESS is unset" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "stop"])
def test_an_address_where_nothing_listens_exits_with_a_message(command, monkeypatch, capsys):
    """Ray itself would retry for many minutes, printing only warnings."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    monkeypatch.setattr(local_ray, "HEAD_WAIT_S", 1.0)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--address", f"127.0.0.1:{port}"])
    assert exit_info.value.code == 2 and not ray.is_initialized()
    assert f"error: no Ray cluster at '127.0.0.1:{port}': nothing accepts connections" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "stop"])
def test_the_dashboards_address_exits_with_a_message(command, monkeypatch, capsys):
    """The dashboard's HOST:PORT (the one `ray job submit` takes) accepts connections: Ray retried for ever."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(local_ray.ray, "init", lambda **kwargs: pytest.fail(f"ray.init({kwargs})"))
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--address", f"127.0.0.1:{server.server_port}"])
    finally:
        server.shutdown()
    assert exit_info.value.code == 2
    assert (f"error: '127.0.0.1:{server.server_port}' answers HTTP: it is the Ray dashboard's address"
            in capsys.readouterr().err)


@pytest.mark.parametrize("command", ["serve", "stop"])
@pytest.mark.parametrize("given", ["flag", "RAY_ADDRESS"])
def test_a_ray_client_address_exits_with_a_message(command, given, monkeypatch, capsys):
    """Ray Client connections cannot carry the service's streams; Ray tried to connect for 30 s first."""
    monkeypatch.setattr(local_ray.ray, "init", lambda **kwargs: pytest.fail(f"ray.init({kwargs})"))
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:10001")
    with pytest.raises(SystemExit) as exit_info:
        main([command, *(["--address", "ray://127.0.0.1:10001"] if given == "flag" else [])])
    assert exit_info.value.code == 2
    assert "error: address 'ray://127.0.0.1:10001' is a Ray Client address" in capsys.readouterr().err


def test_an_unwritable_out_is_refused_before_ray_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    monkeypatch.setattr("rollout.init", lambda *a, **k: pytest.fail("sampled before checking --out"))
    with pytest.raises(SystemExit) as exit_info:  # /proc is a directory where nobody may create a file
        main(["sample", "--prompts", str(tmp_path / "good.jsonl"), "--out", "/proc/x.parquet"])
    assert exit_info.value.code == 2 and not ray.is_initialized()
    assert "--out '/proc/x.parquet': cannot create a file in '/proc'" in capsys.readouterr().err


class InterruptedStream:
    def to_table(self):
        raise KeyboardInterrupt


def test_ctrl_c_says_the_out_file_was_not_written_and_keeps_the_old_one(tmp_path, monkeypatch, capsys):
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    out = tmp_path / "x.parquet"
    out.write_text("earlier run")
    monkeypatch.setattr("rollout.init", lambda *a, **k: None)
    monkeypatch.setattr("rollout.shutdown", lambda: None)
    monkeypatch.setattr("rollout.sample", lambda *a, **k: InterruptedStream())
    with pytest.raises(SystemExit) as exit_info:  # not KeyboardInterrupt: no traceback
        main(["sample", "--prompts", str(tmp_path / "good.jsonl"), "--out", str(out)])
    assert exit_info.value.code == 130
    assert f"rollout sample: interrupted; {str(out)!r} was not written" in capsys.readouterr().err
    assert out.read_text() == "earlier run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "x.parquet"]


class TerminatedStream:
    def to_table(self):  # `kill PID` (a scheduler's time limit, say) while the samples arrive
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler, "SIGTERM would abort the process"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


def test_sigterm_is_handled_as_ctrl_c_and_its_handler_restored(tmp_path, monkeypatch, capsys):
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("rollout.init", lambda *a, **k: None)
    monkeypatch.setattr("rollout.shutdown", lambda: None)
    monkeypatch.setattr("rollout.sample", lambda *a, **k: TerminatedStream())
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--prompts", str(tmp_path / "good.jsonl"), "--out", str(tmp_path / "x.parquet")])
    assert exit_info.value.code == 130 and "was not written" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_DFL if before is None else before)


@pytest.mark.parametrize("command", ["sample", "demo"])
def test_sigterm_while_the_service_starts_is_handled_as_ctrl_c(tmp_path, monkeypatch, capsys, command):
    """`kill PID` while Ray starts or the engines load ended the process with status 15 and no word."""
    (tmp_path / "good.jsonl").write_text('"ok"\n')
    monkeypatch.setattr("rollout.init", lambda *a, **k: TerminatedStream().to_table())
    monkeypatch.setattr("rollout.demo.demo_model", lambda: str(tmp_path))
    prompts = ["--prompts", str(tmp_path / "good.jsonl")] if command == "sample" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, *prompts, "--out", str(tmp_path / "x.parquet")])
    assert exit_info.value.code == 130 and "was not written" in capsys.readouterr().err


def test_sigterm_while_serve_loads_its_engines_is_handled_as_ctrl_c(model_dir, monkeypatch, capsys):
    """`ray job stop` while the engines load (or the placement waits): Ray's own handler dumped a stack."""
    def terminated_launch(config, detached):
        TerminatedStream().to_table()

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(local_ray, "join_cluster", lambda address, namespace: None)
    monkeypatch.setattr("rollout.service.launch", terminated_launch)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", model_dir("qwen3")])
    assert exit_info.value.code == 130 and "rollout serve: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_DFL if before is None else before)


@pytest.mark.parametrize("error, match", [(OSError(28, "No space left on device"), "2 samples are lost: .*No space"),
                                          (KeyboardInterrupt(), None)])
def test_a_failed_write_leaves_no_half_file_and_says_the_samples_are_lost(tmp_path, monkeypatch, error, match):
    """A full disk, or Ctrl-C while writing: no partial file is left, and an earlier file stays as it was."""
    from rollout import out_file

    out = tmp_path / "x.parquet"
    out.write_text("earlier run")

    def half_write(table, where):
        where.write_text("half")
        raise error

    monkeypatch.setattr(out_file.pq, "write_table", half_write)
    with pytest.raises(type(error), match=match):
        out_file.write_out(pa.table({"a": [1, 2]}), out)
    assert out.read_text() == "earlier run" and [p.name for p in tmp_path.iterdir()] == ["x.parquet"]


def test_two_processes_writing_one_out_each_leave_a_whole_file(tmp_path, monkeypatch):
    """Two runs given the same --out, the second writing while the first is: each writes its own hidden file, so
    neither's rename takes the other's half-written one; the file left is one run's whole table."""
    from rollout import out_file

    out, write_table, pids = tmp_path / "x.parquet", out_file.pq.write_table, iter([100, 200])
    monkeypatch.setattr(out_file.os, "getpid", lambda: next(pids))

    def write_while_the_other_writes(table, where):
        write_table(table, where)
        if table.num_rows == 1:
            out_file.write_out(pa.table({"a": [1, 2]}), out)

    monkeypatch.setattr(out_file.pq, "write_table", write_while_the_other_writes)
    out_file.write_out(pa.table({"a": [7]}), out)
    assert pq.read_table(out).column("a").to_pylist() == [7]
    assert [p.name for p in tmp_path.iterdir()] == ["x.parquet"]


@pytest.fixture(scope="module")
def embedded_ray(model_dir):
    """A private local Ray for the tests of `rollout serve`'s parts; yields the config it was started with."""
    from rollout.config import load_service_config
    from rollout.local_ray import start_local_ray, stop_local_ray

    config = load_service_config(model=model_dir("qwen3"), num_workers=1, object_store_memory_gib=0.2)
    start_local_ray(config)
    try:
        yield config
    finally:
        stop_local_ray()


def test_a_foreground_serve_fails_when_its_service_actor_dies(embedded_ray):
    """Ray does not restart a foreground service: `rollout serve` must end with an error, not run on as a
    healthy-looking job with no service behind it. Killed on purpose (`rollout stop`) it ends as stopped: the
    job failed, and the error called the stop a death."""
    from rollout.cli import wait_for_stop

    @ray.remote(num_cpus=0, max_restarts=0)
    class Service:
        async def ready(self) -> int:
            return 1

        def die(self) -> None:
            os._exit(1)

    stopping, service = threading.Event(), Service.remote()
    threading.Timer(2.0, stopping.set).start()
    assert wait_for_stop(service, "svc", stopping) is False  # a live service: returns once stopped
    threading.Timer(2.0, service.die.remote).start()  # dies after its first probes were answered
    stopping = threading.Event()
    missed = threading.Timer(20.0, stopping.set)
    missed.start()  # a wait that missed the death would return here
    with pytest.raises(RuntimeError, match="the service actor 'svc' died"):
        wait_for_stop(service, "svc", stopping)
    missed.cancel()
    with pytest.raises(RuntimeError, match="the service actor 'svc' died"):  # dead before the wait
        wait_for_stop(service, "svc", threading.Event())
    stopped, stopping = Service.remote(), threading.Event()
    threading.Timer(2.0, ray.kill, [stopped]).start()
    missed = threading.Timer(20.0, stopping.set)
    missed.start()
    assert wait_for_stop(stopped, "svc", stopping) is True and not stopping.is_set()
    missed.cancel()


def test_cuda_workers_on_a_cluster_without_gpus_are_refused_before_the_service_starts(embedded_ray):
    """The message alone, not the death of the service actor with its remote traceback."""
    import msgspec

    from rollout.service import actor_exists, launch

    config = msgspec.structs.replace(embedded_ray, num_workers=None, name="no-gpus",
                                     engine=msgspec.structs.replace(embedded_ray.engine, device="cuda"))
    with pytest.raises(ValueError) as refused:
        launch(config, detached=True)
    assert str(refused.value) == "engine.device is 'cuda' but the Ray cluster has no GPUs"
    assert not actor_exists("no-gpus", config.namespace) and not actor_exists("no-gpus-weights", config.namespace)


def test_submit_job_refuses_a_config_the_job_would_not_find(tmp_path):
    """The script runs from the repository root, whose copy the job gets: a config path that is not there would
    only fail inside the submitted job."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "submit_job.sh")
    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:9"}  # nothing listens: nothing may be submitted
    done = subprocess.run(["bash", script, "no/such.toml"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "config file 'no/such.toml' not found" in done.stderr
    outside = tmp_path / "cluster.toml"  # exists here, but not in the job's copy of the repository
    outside.write_text(open(os.path.join(os.path.dirname(script), "..", "configs", "cluster.toml")).read())
    done = subprocess.run(["bash", script, str(outside)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"config file '{outside}' is outside the repository" in done.stderr
