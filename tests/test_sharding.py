"""Sharded generate equals unsharded on 2x4 and 8x1 meshes of 8 host devices (a subprocess:
the device count is fixed when JAX starts); a mixture of experts with its experts split over
the model axis too, float and int8."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def results():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_check.py")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["llama_gqa 2x4", "llama_gqa 8x1", "gpt2 2x4", "moe 2x4",
                                  "moe_int8 2x4"])
def test_sharded_equals_unsharded(results, case):
    r = results[case]
    assert r["greedy"] and r["sampled"], r
    assert r["logit_error"] <= 1e-4, r
    assert r["devices"] == 8


def test_params_and_cache_are_really_split(results):
    assert "model" in results["llama_gqa 2x4"]["w_in_spec"]
    assert "model" in results["llama_gqa 2x4"]["wo_spec"]
    assert "data" in results["llama_gqa 2x4"]["cache_spec"]
    assert "data" in results["llama_gqa 8x1"]["cache_spec"]
    assert "model" in results["moe 2x4"]["experts_spec"]
    for spec in ("experts_spec", "w_in_spec", "wo_spec"):  # int8: numbers split as floats
        assert "model" in results["moe_int8 2x4"][spec]
