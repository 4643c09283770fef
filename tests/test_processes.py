"""Past one process: 2 processes joined by JAX's distributed runtime on this machine (CPU
collectives through gloo) give the answers one process gives alone; each loads only its share
of a checkpoint; the JSONL command line across processes survives a killed process (the other
stops within the timeout) and its rerun completes the file, each answer once; a process whose
others never come stops at the timeout with a message saying so."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import pytest

import jaxkv
from jaxkv.core.sharding import start_processes
from jaxkv.front import cli
from tests.conftest import CONFIGS, char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tests", "processes_check.py")
TIMEOUT_S = 5  # --process-timeout of the command-line jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(commands, env=None):
    """One process per command, its stderr in a file (a pipe could fill and stall it)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **(env or {}))
    started = []
    for command in commands:
        log = tempfile.TemporaryFile("w+")
        started.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                          stderr=log, text=True), log))
    return started


def finish(processes, timeout=600):
    """Every process's (return code, stderr's tail)."""
    ends = []
    for p, log in processes:
        code = p.wait(timeout=timeout)
        log.seek(0)
        noise = ("[Gloo]", "    @ ", "[SPMD]", "Warning")
        ends.append((code, "".join(line for line in log if not any(n in line for n in noise))
                     [-3000:]))
    return ends


def check_processes(mode: str, out, *args, count: int = 2):
    coordinator = f"127.0.0.1:{free_port()}"
    runs = finish(launch([[sys.executable, CHECK, mode, coordinator, str(count), str(i),
                           str(out), *map(str, args)] for i in range(count)]))
    for code, err in runs:
        assert code == 0, err
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(count)]


def hf_llama(path):
    """A tiny Llama written by transformers (safetensors): fused Q/K/V and gate/up sources."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both processes' results of the jobs and of loading a Hugging Face directory and a
    jaxkv.save of it (one launch: each costs seconds of joining and compiling)."""
    folder = tmp_path_factory.mktemp("jobs")
    hf = hf_llama(folder / "hf")
    jaxkv.save(jaxkv.load(hf), folder / "saved")
    return check_processes("jobs", folder, hf, folder / "saved"), (hf, folder / "saved")


@pytest.mark.parametrize("mesh", ["data across processes", "model across processes"])
def test_every_job_across_processes_equals_one_process(jobs, mesh):
    (first, other), _ = jobs
    for process in (first, other):
        assert process["devices"] == 8 and process["local_devices"] == 4
    r = first[mesh]  # process 0 compared its results with its run alone
    assert r["sampled"], r
    assert mesh != "data across processes" or r["many"] and r["speculative"], r
    assert r["loglikelihood_greedy"] and r["logprob_error"] <= 1e-5, r
    assert other[mesh] == r["answers"]  # every process got them all


def test_each_process_loads_its_share(jobs):
    processes, checkpoints = jobs
    for process in processes:
        for path in checkpoints:
            r = process["loaded"][str(path)]
            assert r["same"], r  # each share equals the whole checkpoint's part
            assert r["embed_spec"] == "P('model', None)", r


def cli_command(model, tmp_path, port: int, process_id: int):
    return [sys.executable, "-m", "jaxkv", "generate", "--model", str(model),
            "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--max-new-tokens", "16", "--batch-size", "4", "--coordinator",
            f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
            "--mesh", "4x2", "--process-timeout", str(TIMEOUT_S)]


def lines_of(path):
    return path.read_text().splitlines() if path.exists() else []


def test_command_line_across_processes_survives_a_kill(tmp_path):
    llama = jaxkv.init_params(CONFIGS["llama_gqa"], jax.random.key(0))
    model = tmp_path / "model"
    jaxkv.save(llama, model, tokenizer=char_tokenizer(llama.config.vocab_size))
    prompts = [f"request {i}: " + "abcdefgh"[: i % 8] for i in range(16)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    port = free_port()
    first = launch([cli_command(model, tmp_path, port, i) for i in range(2)], env)
    while len(lines_of(out)) < 1 and first[0][0].poll() is None:
        time.sleep(0.05)
    first[1][0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    (code, err), _ = finish(first)
    assert code != 0 and time.monotonic() - killed_at < TIMEOUT_S + 30, err
    assert "unhealthy" in err or "heartbeat" in err, err
    done = len(lines_of(out))
    assert 1 <= done < len(prompts)
    port = free_port()
    rerun = finish(launch([cli_command(model, tmp_path, port, i) for i in range(2)], env))
    assert all(code == 0 for code, _ in rerun), rerun
    answers = [json.loads(line) for line in lines_of(out)]
    assert sorted(a["id"] for a in answers) == list(range(1, len(prompts) + 1))  # each once
    alone = tmp_path / "alone.jsonl"  # the same job in this one process
    cli.main(["generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
              "--output", str(alone), "--max-new-tokens", "16", "--batch-size", "4",
              "--compile-cache", "off"])
    by_id = {a["id"]: a for a in map(json.loads, lines_of(alone))}
    assert all(a == by_id[a["id"]] for a in answers)


FILES = ["--input", "in.jsonl", "--output", "out.jsonl"]
JOIN = ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"]


@pytest.mark.parametrize("flags, words", [
    (FILES + ["--mesh", "4by2"], "--mesh must be DATAxMODEL"),
    (FILES + ["--mesh", "2x2"], "--mesh 2x2 needs 4 devices"),
    (FILES + JOIN[:2], "--coordinator HOST:PORT needs --num-processes and --process-id"),
    (["Hello", *JOIN], "a PROMPT is answered by one process"),
    (FILES + JOIN + ["--process-timeout", "0"], "--process-timeout must be at least 1 second"),
    (FILES + ["--num-processes", "0", "--process-id", "5"], "--num-processes must be at least 1"),
    (FILES + ["--num-processes", "2", "--process-id", "0"],
     "join a job only with --coordinator HOST:PORT"),
    (FILES + JOIN[:4] + ["--process-id", "2"], "--process-id must be in [0, --num-processes)"),
    (FILES + ["--coordinator", "h", *JOIN[2:]], "--coordinator must be HOST:PORT"),
])
def test_bad_process_flags_are_one_line(tmp_path, monkeypatch, flags, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *flags])
    assert words in str(e.value), e.value


def test_a_process_whose_others_never_come_stops_at_the_timeout(tmp_path):
    """Process 0 alone, a worker whose process 0 never comes, and a process 0 whose port is
    taken: each ends within the timeout (plus its start) with jaxkv's message."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    taken = socket.create_server(("127.0.0.1", 0))

    def alone(port, process_id):
        return [sys.executable, "-m", "jaxkv", "generate", "--input", str(tmp_path / "in.jsonl"),
                "--output", str(tmp_path / f"out-{port}.jsonl"), "--coordinator",
                f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
                "--process-timeout", "3"]

    began = time.monotonic()
    with taken:
        ends = finish(launch([alone(free_port(), 0), alone(free_port(), 1),
                              alone(taken.getsockname()[1], 0)]), timeout=120)
    assert time.monotonic() - began < 3 + 30  # JAX's own wait took over 60 s, then aborted
    words = ["process 0 waited 3 s at 127.0.0.1:", "process 1 waited 3 s for process 0 at",
             "process 0 cannot listen on port"]
    for (code, err), said in zip(ends, words):
        assert code == 1 and said in err and "Traceback" not in err, err


def test_processes_that_disagree_on_the_job_are_refused():
    coordinator, errors = f"127.0.0.1:{free_port()}", []

    def process_0():
        with pytest.raises(ValueError) as e:
            start_processes(coordinator, 2, 0, timeout_s=20)
        errors.append(str(e.value))

    first = threading.Thread(target=process_0)
    first.start()
    with pytest.raises(OSError, match="process 0 at .* ended the job before it started"):
        start_processes(coordinator, 3, 1, timeout_s=20)  # neither reaches JAX's join
    first.join()
    assert errors and "joined by a process 1 of 3 processes" in errors[0], errors
