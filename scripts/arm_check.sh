#!/usr/bin/env bash
# The CPU kernels' ARM (NEON) paths checked for exactness on an x86-64 machine: an aarch64
# Python runs tests/test_kernels.py's narrow-build subset (every product form and tail,
# attention's decode and prefill paths, int8 and paged caches) under QEMU user mode, the
# kernels built by the ARM cross-compiler. Exactness only: emulated time says nothing of an ARM
# CPU's speed.
#
# Needs (Debian/Ubuntu, as root): apt-get install qemu-user g++-aarch64-linux-gnu, and
# `dpkg --add-architecture arm64 && apt-get update` for the arm64 Python it downloads. The
# aarch64 Python (Debian's packages, unpacked, not installed) and the project's dependencies
# as aarch64 wheels go to $JAXKV_ARM_DIR (default ~/.cache/jaxkv/arm), once.
#
#   scripts/arm_check.sh [pytest arguments...]      over an hour on a 2-core Zen 1 (73 tests)
set -euo pipefail
cd "$(dirname "$0")/.."
arm=${JAXKV_ARM_DIR:-$HOME/.cache/jaxkv/arm}
python=${PYTHON:-.venv/bin/python}
for tool in qemu-aarch64 aarch64-linux-gnu-g++ apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "arm_check: $tool not found (see the script's head)" >&2; exit 1; }
done

if [ ! -x "$arm/root/usr/bin/python3.11" ]; then
  packages="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libexpat1 zlib1g
    libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libreadline8 libncursesw6 libtinfo6
    libuuid1 libcrypt1 libnsl2 libtirpc3 libdb5.3 libgdbm6 libstdc++6 libgcc-s1 libc6
    libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1"
  mkdir -p "$arm/debs" "$arm/root"
  (cd "$arm/debs" && apt-get download $(for p in $packages; do echo "$p:arm64"; done))
  for deb in "$arm"/debs/*.deb; do dpkg -x "$deb" "$arm/root"; done
fi
if [ ! -d "$arm/site/jax" ]; then
  # The project's dependencies (pyproject.toml) and pytest, as aarch64 wheels for Python 3.11.
  deps=$("$python" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
  "$python" -m pip install -q --target "$arm/site" --python-version 3.11 --implementation cp \
    --only-binary=:all: --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_27_aarch64 --platform manylinux_2_28_aarch64 $deps pytest
fi

# The subset a narrower build runs (test_kernels.NARROW), and the outer form's block size.
narrow=$("$python" -c "import ast; tree = ast.parse(open('tests/test_kernels.py').read()); print(next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == 'NARROW'))")
echo "arm_check: aarch64 Python under $(qemu-aarch64 --version | head -1)"
PYTHONPATH="$arm/site:$PWD" CXX=aarch64-linux-gnu-g++ JAXKV_CPU_MARCH=armv8.2-a \
  JAXKV_CACHE="$arm/cache" qemu-aarch64 -L "$arm/root" "$arm/root/usr/bin/python3.11" \
  -m pytest -q -p no:cacheprovider -k "($narrow) or outer_block_rows" tests/test_kernels.py "$@"
