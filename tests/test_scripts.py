"""The benchmark scripts run end to end on tiny settings and write their JSON and plot (their
figures come from full runs, recorded in results/ and docs/performance.md)."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import save_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = {
    "bench_decode": ["--models", "smollm2", "--dtypes", "float32", "--batches", "1",
                     "--new-tokens", "4", "--repeats", "1", "--llamacpp", "Q8_0"],
    "bench_scaling": ["--capacities", "48", "300", "--positions", "0", "16", "--steps", "2",
                      "--repeats", "1"],
    "bench_complexity": ["--lengths", "4", "8", "--repeats", "1"],
    "bench_branches": ["--branches", "1", "2", "--new-tokens", "4", "--prompt-len", "16"],
    "profile_step": ["--steps", "2", "--capacity", "32", "--pos", "3"],
    "bench_prefill": ["--lengths", "16", "--engines", "jaxkv", "hf", "--rounds", "1",
                      "--no-memory"],  # memory: test_prefill_memory_of_one_engine_runs
    "bench_quality": ["--tokens", "64", "--window", "32", "--formats", "fp32", "int8-kv",
                      "llama.cpp-Q8_0"],
    "bench_hooks": ["--new-tokens", "4", "--repeats", "1"],
    "bench_constraints": ["--batch", "2", "--steps", "2", "--repeats", "1"],
    "bench_moe": ["--d-model", "64", "--layers", "1", "--experts", "4", "--top-k", "2",
                  "--expert-ff", "32", "--steps", "2", "--repeats", "1", "--dtypes", "float32",
                  "int8", "--batches", "1", "2", "--prompt", "8"],
    "bench_speculative": ["--prompts", "1", "--kinds", "grounded", "--batches", "1",
                          "--new-tokens", "4", "--trees", "defaultx1", "--no-draft", "--repeats",
                          "1"],
    "bench_kernels": ["--dtypes", "int8", "--rows", "1", "2", "--repeats", "1", "--layers", "1"],
    "bench_attention": ["--contexts", "40", "--repeats", "1", "--layers", "1"],
    "bench_checks": ["--models", "tiny", "--batches", "1", "--new-tokens", "4", "--rounds", "1"],
    "bench_commits": ["--old", "HEAD", "--new", "HEAD", "--model", "tiny", "--dtypes", "int8",
                      "--rounds", "1", "--repeats", "1"],
    "bench_eval": ["--contexts", "2", "--context-len", "16", "--prompts", "2", "--prefix-len",
                   "32", "--question-len", "4", "--cache-tokens", "512", "--longest", "128",
                   "--rows", "4"],
    "check_int8_hlo": ["--dtypes", "int8", "--batches", "1", "--blocks", "32", "--new-tokens",
                       "2", "--prompt-len", "4"],
}


def run_script(script: str, *args: str) -> str:
    """scripts/<script>.py run with args from the repository root: its stdout (it must succeed)."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script + ".py"), *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("script", RUNS)
def test_script_runs(script, tmp_path):
    out, extra = str(tmp_path / script), []
    if script == "bench_eval":  # a tiny random model: the script's whole path, little compiling
        save_tiny_llama(tmp_path / "model", max_positions=256)
        extra = ["--model", str(tmp_path / "model")]
    run_script(script, *RUNS[script], *extra, "--out", out)
    with open(out + ".json") as f:
        result = json.load(f)
    if script == "profile_step":  # tables, not a plot
        assert result["by_kind"] and result["by_weight"]
        return
    if script == "bench_commits":  # a table of two commits, not a plot
        summary = result["summary"]["int8"]  # (figures of a tiny model on a busy machine: no
        assert math.isfinite(summary["old_best_ms"]) and math.isfinite(  # bound on them: a
            summary["new_over_old_paired"])  # step timed as a difference may even be < 0)
        return
    if script == "bench_eval":  # tables, not a plot; tiny sizes: no bound on the ratios
        assert result["loglikelihood"]["greedy_equal"] and result["prefix"]["answers_equal"]
        assert result["memory"]["answers_equal"] and result["memory"]["fraction"] < 1
        return
    if script == "bench_hooks":  # one ratio, not a plot
        assert math.isfinite(result["hooks_over_plain"]) and result["captured_mib"] > 0
        return
    if script == "bench_moe":  # ratios, not a plot (tiny sizes: no bound on them)
        assert len(result["rows"]) == 4
        assert all(math.isfinite(row["moe_over_dense_active"]) and row["step_ms"]["moe"] > 0
                   for row in result["rows"])
        assert [math.isfinite(row.get("prefill_moe_over_xla_form", math.nan))
                for row in result["rows"]] == [True, False, True, False]  # batch 1 only
        return
    if script == "bench_constraints":  # one ratio and the schema's sizes, not a plot
        assert math.isfinite(result["constrained_over_plain"]) and result["table_mib"] > 0
        return
    if script == "check_int8_hlo":  # a check, not a benchmark: no plot
        assert result["rows"] and not result["rows"][0]["loop_copies"]
        return
    assert result["rows"]
    assert os.path.getsize(out + ".png") > 0
    if script == "bench_decode":  # same-round ratios: float32 against itself is 1 every round
        assert result["rows"][0]["speedup_vs_float32_paired"] == 1.0


def test_bench_gpu_runs_at_tiny_sizes(tmp_path):
    """scripts/bench_gpu.py, unchanged but for --tiny: every engine times, transformers' tokens
    equal jaxkv's on the same weights, and the tables are written."""
    out = str(tmp_path / "bench_gpu")
    run_script("bench_gpu", "--tiny", "--batches", "2", "--repeats", "1", "--out", out)
    with open(out + ".json") as f:
        result = json.load(f)
    rows = {r["engine"]: r for r in result["decode"]}
    assert set(rows) == {"jaxkv", "jaxkv_pallas", "jaxkv_int8", "hf_static"}  # eager: batch 1
    assert all(isinstance(r["ms_per_token"], float) for r in rows.values()), rows  # (tiny: noise)
    assert rows["hf_static"]["agree"] == 1.0 and rows["jaxkv_pallas"]["agree"] == 1.0
    assert result["prefill"][0]["jaxkv_ms"] > 0 and result["prefill"][0]["hf_sdpa_ms"] > 0
    with open(out + ".md") as f:
        assert "| tiny | 2 | hf_static |" in f.read()


def test_prefill_memory_of_one_engine_runs():
    """bench_prefill's memory measurement (its own process per engine and length)."""
    result = json.loads(run_script("bench_prefill", "--memory-of", "jaxkv", "16")
                        .strip().splitlines()[-1])
    assert result["extra_bytes"] >= 0 and result["xla_argument_bytes"] > 0


def test_speculative_pass_costs_run(tmp_path):
    out = str(tmp_path / "costs")
    run_script("bench_speculative", "--costs", "--batches", "2", "--nodes", "1", "3", "--out", out)
    with open(out + ".json") as f:
        rows = json.load(f)["pass_costs"]
    assert [(r["batch"], r["nodes"], r["rows"]) for r in rows] == [(2, 1, 2), (2, 3, 6)]
    assert rows[0]["vs_step"] == 1.0 and rows[1]["row_cost_model"] > 1


def test_lookup_replay_runs(tmp_path):
    out = str(tmp_path / "replay.json")
    run_script("replay_lookup", "--prompts", "1", "--new-tokens", "6", "--out", out)
    with open(out) as f:
        kinds = json.load(f)["kinds"]
    assert set(kinds) == {"grounded", "free"} and all(kinds.values())


def test_bench_cpu_steps_parse(tmp_path):
    """scripts/bench_cpu.sh: each step's command is one its script accepts (run up to --help,
    so every flag and choice before it is checked), and an unknown step is refused up front."""
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, OUT=str(tmp_path))
    script = os.path.join(ROOT, "scripts", "bench_cpu.sh")
    run = subprocess.run(["bash", script], capture_output=True, text=True, env=env, cwd=ROOT)
    commands = [line.split() for line in run.stdout.splitlines()
                if line.startswith(sys.executable)]
    assert run.returncode == 0 and len(commands) == 5, run.stderr
    builds = subprocess.run(["bash", script], capture_output=True, text=True, cwd=ROOT,
                            env=dict(env, STEPS="builds"))
    commands += [line.split() for line in builds.stdout.splitlines()][-1:]
    assert builds.returncode == 0 and builds.stdout.count(sys.executable) == 10, builds.stderr
    moe = subprocess.run(["bash", script], capture_output=True, text=True, cwd=ROOT,
                         env=dict(env, STEPS="moe"))
    commands += [line.split() for line in moe.stdout.splitlines()
                 if line.startswith(sys.executable)]
    assert moe.returncode == 0 and "qwen3moe-small" in commands[-1], moe.stderr
    for command in commands:
        parsed = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=ROOT)
        assert parsed.returncode == 0, (command, parsed.stderr[-2000:])
    refused = subprocess.run(["bash", script], capture_output=True, text=True, cwd=ROOT,
                             env=dict(env, STEPS="decode bogus"))
    assert refused.returncode == 2 and "unknown step bogus" in refused.stderr
