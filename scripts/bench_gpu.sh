#!/usr/bin/env bash
# The GPU checks in one call of a lent device machine (its image has jax with CUDA, torch and
# transformers; nothing is installed): a smoke test; scripts/bench_gpu.py (jaxkv against
# transformers' static compiled and eager paths on the same random weights, Llama-3.2-1B and
# Llama-3.1-8B shapes, batch 1 / 64 / 16, bfloat16 / int8 / the Pallas backend, prefill of 2,048
# tokens, the read probe; its cells stop at BENCH_S seconds, naming the ones skipped); then the
# Pallas and int8 tests on the GPU, stopped at TESTS_S. The defaults fit one 480 s call:
#   run(command="bash scripts/bench_gpu.sh", timeout_s=590)
# Files go to $OUT (default results/gpu/<chip>, e.g. results/gpu/h100: scripts/bench_checks.py's
# results_dir). Arguments are passed on to bench_gpu.py, e.g. on a CPU:
#   OUT=/tmp/gpu bash scripts/bench_gpu.sh --tiny
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
out=${OUT:-$(cd scripts && python3 -c \
             'from bench_checks import results_dir; print(results_dir())')} || exit 1
mkdir -p "$out"
python3 -c "
import jax, jax.numpy as jnp, jaxkv
print('jax', jax.__version__, jax.devices())
c = jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      max_seq_len=64)
p = jaxkv.init_params(c, jax.random.key(0))
print('smoke: generate', jaxkv.generate(p, [[1, 2, 3]], 4)[0])" || exit 1
timeout "$((${BENCH_S:-330} + 60))" python3 scripts/bench_gpu.py --budget-s "${BENCH_S:-330}" \
    --out "$out/bench_gpu" "$@" 2>&1 | grep -v "it/s\]" | tee "$out/bench_gpu.log"
timeout -s INT "${TESTS_S:-60}" python3 -m pytest tests/test_pallas.py tests/test_quant.py -q \
    -p no:cacheprovider 2>&1 | tail -30 | tee "$out/tests_pallas.log"
