#!/usr/bin/env bash
# The CPU-dependent measurements in one command, for a CPU the results do not cover yet: files
# go to results/cpu/<vendor>_f<family>_m<model> (scripts/bench_checks.py's results_dir; the
# CPU's model name is in every table), or to $OUT, one step after another, so that nothing
# else runs beside a timing.
#   decode      SmolLM2 batch 1, float32 / bfloat16 / int8 against llama.cpp F32 / F16 / Q8_0
#               and the read bandwidth (MBU), 11 interleaved rounds: the best of each and
#               the median of same-round ratios (paired)
#   prefill     SmolLM2 512 / 2,048 / 8,192 tokens against transformers' forward, with memory
#   chunks      decoder.CHUNK 256 against 512, and one row's 64-token passes (300 tokens)
#   speculative lookup (default tree and 4 x 1) against generate, grounded and free-form prompts
#   attention   the decode attention kernel per layer against XLA's, SmolLM2's and Gemma 3's
#               heads, float32 / bfloat16 / int8 caches, 128 .. 8,192 keys
#   moe         (not in the default steps; ~6 min) a random 0.49B Qwen3-MoE (0.10B active),
#               float32 / bfloat16 / int8 / Q8_0's blocks against llama.cpp F32 / F16 / Q8_0,
#               batch 1, its GGUF written as llama.cpp's converter writes one
#   builds      (not in the default steps; ~14 min) the decode step again, one process each
#               with the kernels built for native, x86-64-v4 (AVX-512 without its bfloat16 dot
#               product), x86-64-v3 (AVX2) and x86-64 (JAXKV_CPU_MARCH) and with XLA's
#               products, two interleaved rounds: what older CPUs get, into $out/builds
# EMULATE=avx2 runs the steps as an AVX2-only CPU would, on a CPU with AVX-512 (issue 59), into
# $out/avx2_emulated: jaxkv's kernels built for x86-64-v3 (JAXKV_CPU_MARCH), XLA's generated
# code capped at AVX2 (--xla_cpu_max_isa), torch's oneDNN and MKL capped at AVX2, and llama.cpp
# from an AVX2-only build in build/llama_avx2 (made once by the command below). What it cannot
# cap: the libraries XLA calls (YNNPACK's products choose their instructions at run time), so
# the prefill step runs twice, with YNNPACK's products and with XLA's own (YNNPACK off): the
# first flatters XLA, the second may undersell it. Caches, bandwidth and the core are the
# host's.
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
#     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF" \
#     .venv/bin/pip install --no-cache-dir --no-binary llama-cpp-python --no-deps \
#     --target build/llama_avx2 llama-cpp-python==0.3.36
# llama.cpp is the optional `bench` extra (pip install -e ".[bench]"; on an Intel Xeon with AMX
# see scripts/bench_decode.py for the build flags); without it the decode step says so and
# times jaxkv alone. STEPS picks steps (default: all), e.g. STEPS="decode chunks"; DRY_RUN=1
# prints each step's command instead of running it. PYTHON: the interpreter (default
# .venv/bin/python where the README's set-up made it, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
default_python=python3
[ -x .venv/bin/python ] && default_python=$PWD/.venv/bin/python  # the README's set-up
python="${DRY_RUN:+echo }${PYTHON:-$default_python}"
out=${OUT:-$(cd scripts && "${PYTHON:-$default_python}" -c \
             'from bench_checks import results_dir; print(results_dir("cpu"))')} || exit 1
case ${EMULATE:-} in
  "") ;;
  avx2) out="$out/avx2_emulated"
        export JAXKV_CPU_MARCH=x86-64-v3 XLA_FLAGS="--xla_cpu_max_isa=AVX2 ${XLA_FLAGS:-}" \
               ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
               PYTHONPATH="$PWD/build/llama_avx2${PYTHONPATH:+:$PYTHONPATH}" \
               JAXKV_BENCH_EMULATING="AVX2 (x86-64-v3 kernels, XLA and torch capped at AVX2, llama.cpp built for AVX2)"
        ${PYTHON:-$default_python} -c 'import llama_cpp, sys; sys.exit("build/llama_avx2" not in llama_cpp.__file__)' \
          || { echo "EMULATE=avx2 needs llama.cpp's AVX2 build in build/llama_avx2 (see above)" >&2; exit 1; } ;;
  *) echo "unknown EMULATE $EMULATE (avx2)" >&2; exit 2 ;;
esac
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)${EMULATE:+, emulating $EMULATE} -> $out"
steps=${STEPS:-decode prefill chunks speculative attention}
for step in $steps; do
  case $step in decode|prefill|chunks|speculative|attention|moe|builds) ;;
    *) echo "unknown step $step (decode, prefill, chunks, speculative, attention, moe, builds)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
for step in $steps; do
  case $step in
    decode) $python scripts/bench_decode.py --models smollm2 --batches 1 \
              --dtypes float32 bfloat16 int8 --llamacpp F32 F16 Q8_0 --no-hf --repeats 11 \
              --out "$out/bench_decode" ;;
    prefill) $python scripts/bench_prefill.py --out "$out/bench_prefill"
             if [ -n "${EMULATE:-}" ]; then
               XLA_FLAGS="$XLA_FLAGS --xla_cpu_experimental_ynn_fusion_type=" \
                 $python scripts/bench_prefill.py --out "$out/bench_prefill_no_ynnpack"
             fi ;;
    chunks) $python scripts/bench_prefill.py --engines jaxkv --no-memory --chunks 256 512 \
              --lengths 300 512 2048 8192 --out "$out/bench_prefill_chunks" ;;
    speculative) $python scripts/bench_speculative.py --kinds grounded free \
              --trees defaultx1 4x1 --no-draft --repeats 3 --out "$out/bench_speculative" ;;
    attention) $python scripts/bench_attention.py --shapes smollm2 gemma3 \
              --out "$out/bench_attention" ;;
    moe) $python scripts/bench_decode.py --models qwen3moe-small --batches 1 \
              --dtypes float32 bfloat16 int8 q8_0 --llamacpp F32 F16 Q8_0 --no-hf --repeats 3 \
              --out "$out/bench_decode_llamacpp_qwen3moe" ;;
    builds) mkdir -p "$out/builds"
            for round in 1 2; do
              for build in native x86-64-v4 x86-64-v3 x86-64 xla; do
                JAXKV_CPU_KERNELS=$([ $build = xla ] && echo 0 || echo 1) \
                JAXKV_CPU_MARCH=${build/xla/native} $python scripts/bench_decode.py \
                  --models smollm2 --batches 1 --dtypes float32 bfloat16 int8 --no-hf \
                  --repeats 3 --out "$out/builds/${build}_$round"
              done
            done ;;
  esac 2>&1 | grep -v "it/s\]" | tee "$out/$step.log"
done
