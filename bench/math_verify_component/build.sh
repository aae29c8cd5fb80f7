#!/usr/bin/env bash
# Builds math_verify.wasm: math-verify and its dependencies, pinned, pip-installed into
# ./site, then bundled with app.py/reward.py by componentize-py (WIT 0.1.0, reward-plugin,
# as plugins/code_tests is). All dependencies are pure Python (no C extension to bundle).
# Needs: pip install componentize-py==0.25.1, CPython 3.11 (only to run pip).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
if [ ! -f site/.installed ]; then
  rm -rf site
  # --no-deps with every package pinned: the versions measured in REPORT.md.
  python3 -m pip install --quiet --no-deps --target site \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
    sympy==1.14.0 mpmath==1.3.0
  # lighteval glue, imported by nothing the reward uses (it needs numpy and lighteval).
  rm -f site/math_verify/tasks.py
  # componentize-py's CPython has no _ctypes (a C extension): sympy imports ctypes only to
  # size a C long for gmpy2's limits, unused without gmpy2. wasm32's long is 32 bits.
  gmpy=site/sympy/external/gmpy.py
  grep -q '^from ctypes import c_long, sizeof$' "$gmpy"
  sed -i 's/^from ctypes import c_long, sizeof$/c_long, sizeof = None, lambda _: 4  # rlhost bench: no _ctypes in wasm/' "$gmpy"
fi
build() {
  componentize-py -q -d ../../wit/v0.1.0 -w reward-plugin componentize app -p . -p site -o "$1"
}
if [ ! -f site/.installed ]; then
  # The first build compiles every module from source while pre-initialising and leaves
  # .pyc files (cpython-314) in site/; its snapshot is ~10 MB bigger (80.8 MB vs 70.3 MB)
  # than a build that loads those .pyc files. Build once to write them, then for real.
  build math_verify.wasm.tmp
  touch site/.installed
fi
build math_verify.wasm.tmp
mv -f math_verify.wasm.tmp math_verify.wasm
ls -l math_verify.wasm
