#!/usr/bin/env bash
# Build the TensorFlow custom ops of deepreduce into deepreduce/tensorflow/_deepreduce_ops.so.
#
# Compiles every csrc/*/tf_*.cpp (REGISTER_OP + OpKernel glue; csrc/tf/tf_pipeline_ops.cpp) together
# with every pure C++ source of csrc/ (each .cpp except the pybind11 modules py_module.cpp: the
# C++ pipeline of csrc/pipeline and the kernels and wire rules it calls, the code the extensions
# wrap; csrc/common holds headers only), against the installed TensorFlow with
# its tf.sysconfig compile and link flags, at -O3. Skips the build when the
# library is newer than every source and header and was built for the same TensorFlow version.
#
#   PYTHON=...                 interpreter with TensorFlow (default: .venv/bin/python, else python3)
#   DEEPREDUCE_FORCE=1         rebuild even when up to date
#   CXX=...                    compiler (default: g++)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
CXX="${CXX:-g++}"
OUT="deepreduce/tensorflow/_deepreduce_ops.so"
STAMP="build/tf_ops.tfversion"   # build/ is git-ignored
log() { printf '[build_tf_ops] %s\n' "$*"; }

shopt -s nullglob
OP_SOURCES=(csrc/*/tf_*.cpp)
if [ ${#OP_SOURCES[@]} -eq 0 ]; then
    log "no csrc/*/tf_*.cpp: nothing to build"
    exit 0
fi
SOURCES=() INCLUDES=(-Icsrc) DEPS=()
for folder in csrc/*/; do
    folder="${folder%/}"
    INCLUDES+=("-I$folder")
    for src in "$folder"/*.cpp; do
        [ "$(basename "$src")" = "py_module.cpp" ] && continue
        SOURCES+=("$src")
    done
    DEPS+=("$folder"/*.cpp "$folder"/*.h)
done

TF_INFO="$("$PYTHON" - <<'PY'
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
print(tf.__version__)
print(" ".join(tf.sysconfig.get_compile_flags()))
print(" ".join(tf.sysconfig.get_link_flags()))
PY
)" || { log "ERROR: cannot import TensorFlow with $PYTHON"; exit 1; }
TF_VERSION="$(sed -n 1p <<<"$TF_INFO")"
read -r -a CFLAGS <<<"$(sed -n 2p <<<"$TF_INFO")"
read -r -a LFLAGS <<<"$(sed -n 3p <<<"$TF_INFO")"

if [ "${DEEPREDUCE_FORCE:-0}" != "1" ] && [ -f "$OUT" ] && [ -f "$STAMP" ] \
        && [ "$(cat "$STAMP")" = "$TF_VERSION" ] && [ -z "$(find "${DEPS[@]}" "$0" -newer "$OUT" 2>/dev/null)" ]; then
    log "$OUT is up to date (TensorFlow $TF_VERSION)"
    exit 0
fi

log "compiling ${SOURCES[*]} against TensorFlow $TF_VERSION"
TMP="$OUT.tmp.$$"
trap 'rm -f "$TMP"' EXIT
"$CXX" -shared -fPIC -O3 -Wno-deprecated-declarations -Wno-interference-size "${CFLAGS[@]}" "${INCLUDES[@]}" "${SOURCES[@]}" -o "$TMP" "${LFLAGS[@]}"
mv "$TMP" "$OUT"
mkdir -p "$(dirname "$STAMP")"
printf '%s\n' "$TF_VERSION" > "$STAMP"
log "built $OUT"
