#!/usr/bin/env bash
# The GPU checks in one call of a lent device machine (its image has jax with CUDA, torch and
# transformers; nothing is installed): a smoke test; scripts/check_int8_hlo.py (does the
# compiled decode loop read int8 weights as int8 there?); scripts/bench_decode.py against
# transformers on CUDA (bfloat16, int8 in float32 and in bfloat16; SmolLM2-135M's shapes and a
# 1B Llama, random weights saved there); the same decode with JAXKV_OPS=pallas; then the Pallas,
# int8 and decoding exactness tests on the GPU (the defaults fit one 600 s call).
# Files go to $OUT (default results/gpu/<chip>, e.g. results/gpu/h100: scripts/bench_checks.py's
# results_dir); HLO_S, BENCH_S and TESTS_S bound each step's seconds;
# arguments are passed on to bench_decode.py, e.g. to try it on the CPU:
#   OUT=/tmp/gpu bash scripts/bench_gpu.sh --models smollm2-shapes --batches 1 --new-tokens 8
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
out=${OUT:-$(cd scripts && python3 -c \
             'from bench_checks import results_dir; print(results_dir())')} || exit 1
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
      tr -c 'A-Za-z0-9\n' _)
python3 -c "
import jax, jax.numpy as jnp, jaxkv
print('jax', jax.__version__, jax.devices())
c = jaxkv.Config.llama(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      max_seq_len=64)
p = jaxkv.init_params(c, jax.random.key(0))
print('smoke: generate', jaxkv.generate(p, [[1, 2, 3]], 4)[0])" || exit 1
timeout "${HLO_S:-120}" python3 scripts/check_int8_hlo.py --models smollm2-shapes llama-1b \
    --batches 1 16 --blocks 0 32 --out "$out/int8_hlo_${gpu:-cpu}" 2>&1 |
    tee "$out/int8_hlo_${gpu:-cpu}.log"
timeout "${BENCH_S:-240}" python3 scripts/bench_decode.py --models smollm2-shapes llama-1b \
    --dtypes bfloat16 int8 int8_bf16 --batches 1 16 --llamacpp --hf-repeats 2 \
    --workdir /tmp/jaxkv_bench \
    --out "$out/bench_decode_${gpu:-cpu}" "$@" 2>&1 | grep -v "it/s\]" |
    tee "$out/bench_decode_${gpu:-cpu}.log"
# The Pallas backend against XLA's on the same shapes (JAX's decode kernel in decode steps).
JAXKV_OPS=pallas timeout "${PALLAS_S:-120}" python3 scripts/bench_decode.py --models llama-1b \
    --dtypes bfloat16 --batches 1 16 --no-hf --workdir /tmp/jaxkv_bench \
    --out "$out/bench_decode_pallas_${gpu:-cpu}" "$@" 2>&1 | grep -v "it/s\]" |
    tee "$out/bench_decode_pallas_${gpu:-cpu}.log"
timeout "${TESTS_S:-90}" python3 -m pytest tests/test_pallas.py tests/test_quant.py \
    tests/test_decoder.py tests/test_multidecode.py tests/test_generate.py -q -x \
    -p no:cacheprovider 2>&1 | tail -30 | tee "$out/tests_${gpu:-cpu}.log"
