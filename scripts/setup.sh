#!/usr/bin/env bash
# Bring a fresh Debian machine (root, Python 3.11) to a working deepreduce checkout:
#   OS packages -> .venv -> torch (CPU) -> pinned requirements -> patched Horovod 0.28.1
#   -> horovodrun --check-build -> editable install of deepreduce -> the harness's commands -> TF custom ops.
# Every step is skipped when it is already done: a stamp under .venv/.deepreduce-stamps/
# records a hash of that step's inputs, and the step re-runs only when the hash changes.
#
# Environment knobs:
#   PYTHON                    interpreter for the venv (default: python3; must be 3.11)
#   DEEPREDUCE_CACHE          cache root that outlives the checkout
#                             (default: $HOME/.cache/deepreduce; holds Horovod sdist and wheel)
#   DEEPREDUCE_SKIP_APT=1     never touch apt (the OS packages must be there already)
#   DEEPREDUCE_FORCE=1        ignore all stamps (re-run every step; the Horovod wheel
#                             cache is still used: delete it to force a rebuild)
#   DEEPREDUCE_ALLOW_CUDA_TORCH=1  allow a torch install that pulls CUDA packages
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMPS="$VENV/.deepreduce-stamps"
CACHE="${DEEPREDUCE_CACHE:-${HOME:-/root}/.cache/deepreduce}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"
HOROVOD_PATCH="$ROOT/scripts/horovod/horovod-$HOROVOD_VERSION.patch"
REQUIREMENTS="$ROOT/requirements.txt"
CONSTRAINTS="$ROOT/constraints.txt"
# Bootstrap tools inside the venv, pinned so that the Horovod build sees the same setuptools.
BOOTSTRAP_PINS=(pip==26.0.1 setuptools==80.9.0 wheel==0.45.1)
APT_PACKAGES=(build-essential cmake ninja-build openmpi-bin libopenmpi-dev git iproute2 patch openssh-client)

# Open MPI refuses to run as root unless told it may.
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

T0=$(date +%s)
log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

sha() { sha256sum | cut -c1-16; }          # stdin -> short hash
hash_files() {                             # hash names + contents of existing files
    local f
    for f in "$@"; do
        [ -f "$f" ] || continue
        printf '%s\n' "$f"; sha256sum < "$f"
    done | sha
}
# pip, minus the harmless "Location ... is ignored" lines that some machines' pip config
# (extra index directories that lack a package) prints for every package.
pipv() {
    local rc=0
    "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) || rc=$?
    wait || true
    return $rc
}
stamp_ok() { [ "${DEEPREDUCE_FORCE:-0}" != "1" ] && [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }
stamp_set() { mkdir -p "$STAMPS"; printf '%s\n' "$2" > "$STAMPS/$1"; }

# ---------------------------------------------------------------- 1. OS packages
step_apt() {
    local missing=() p
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "apt: all OS packages present, skipping"
        return
    fi
    [ "${DEEPREDUCE_SKIP_APT:-0}" = "1" ] && die "missing OS packages (${missing[*]}) and DEEPREDUCE_SKIP_APT=1"
    command -v apt-get >/dev/null || die "missing OS packages (${missing[*]}) and no apt-get: install them by hand"
    local SUDO=""
    if [ "$(id -u)" != "0" ]; then
        command -v sudo >/dev/null || die "missing OS packages (${missing[*]}); run as root or install them"
        SUDO="sudo"
    fi
    log "apt: installing ${missing[*]}"
    local aptlog
    aptlog="$(mktemp)"
    if ! { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q \
           && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${APT_PACKAGES[@]}"; } \
           > "$aptlog" 2>&1; then
        tail -30 "$aptlog" >&2
        die "apt-get failed (log: $aptlog)"
    fi
    rm -f "$aptlog"
}

# ---------------------------------------------------------------- 2. virtualenv
step_venv() {
    if [ ! -x "$VPY" ]; then
        local pyver
        pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
            || die "cannot run $PYTHON"
        [ "$pyver" = "3.11" ] || die "$PYTHON is Python $pyver; deepreduce pins torch==$TORCH_VERSION for CPython 3.11 (set PYTHON=...)"
        log "venv: creating .venv with $PYTHON ($pyver)"
        "$PYTHON" -m venv "$VENV"
    fi
    mkdir -p "$STAMPS"
    local key
    key="$(printf '%s\n' "${BOOTSTRAP_PINS[@]}" | sha)"
    if stamp_ok bootstrap "$key"; then
        log "venv: pip/setuptools/wheel up to date, skipping"
    else
        log "venv: installing ${BOOTSTRAP_PINS[*]}"
        pipv install -q "${BOOTSTRAP_PINS[@]}"
        stamp_set bootstrap "$key"
    fi
}

installed_version() {  # version of a distribution in the venv, or empty
    "$VPY" - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

check_torch() {
    local v
    v="$(installed_version torch)"
    case "$v" in
        "$TORCH_VERSION"|"$TORCH_VERSION"+*) ;;
        *) die "torch in .venv is '${v:-missing}', expected $TORCH_VERSION (something upgraded it)";;
    esac
}

# ---------------------------------------------------------------- 3. Python packages
step_torch() {
    local v
    v="$(installed_version torch)"
    case "$v" in
        "$TORCH_VERSION"|"$TORCH_VERSION"+*)
            log "torch: $v present, skipping"; return;;
    esac
    if [ "${DEEPREDUCE_ALLOW_CUDA_TORCH:-0}" != "1" ]; then
        # An unpinned or unavailable CPU build would pull gigabytes of CUDA wheels: refuse.
        local plan
        plan="$(pipv install --dry-run "torch==$TORCH_VERSION" 2>&1)" \
            || { printf '%s\n' "$plan" | tail -5 >&2; die "cannot resolve torch==$TORCH_VERSION"; }
        if printf '%s\n' "$plan" | grep -qiE '^Would install.* nvidia-'; then
            die "torch==$TORCH_VERSION would pull CUDA packages here (no CPU wheel found via pip's find-links); set DEEPREDUCE_ALLOW_CUDA_TORCH=1 to accept"
        fi
    fi
    log "torch: installing torch==$TORCH_VERSION (CPU)"
    pipv install -q "torch==$TORCH_VERSION"
    check_torch
}

step_requirements() {
    local key cargs=()
    [ -f "$CONSTRAINTS" ] && cargs=(-c "$CONSTRAINTS")
    key="$(hash_files "$REQUIREMENTS" "$CONSTRAINTS")-$(installed_version torch)"
    if stamp_ok requirements "$key"; then
        log "requirements: unchanged, skipping"
    else
        log "requirements: installing requirements.txt (TensorFlow is large; this takes a few minutes the first time)"
        pipv install -q -r "$REQUIREMENTS" "${cargs[@]}"
        stamp_set requirements "$key"
    fi
    check_torch
}

# ---------------------------------------------------------------- 4. Horovod
horovod_key() {
    local tfv pyv
    tfv="$(installed_version tensorflow-cpu)"; [ -n "$tfv" ] || tfv="$(installed_version tensorflow)"
    pyv="$("$VPY" -c 'import sys; print(sys.version.split()[0])')"
    {
        echo "horovod=$HOROVOD_VERSION"
        echo "torch=$(installed_version torch)"
        echo "tensorflow=$tfv"
        echo "python=$pyv"
        echo "machine=$(uname -m)"
        echo "flags=pytorch,tensorflow,gloo,mpi,no-mxnet"
        sha256sum < "$HOROVOD_PATCH"
    } | sha
}

build_horovod_wheel() {  # $1 = destination dir (must not exist yet)
    local dest="$1" sdist_dir="$CACHE/sdist" sdist tmp
    mkdir -p "$sdist_dir"
    sdist="$sdist_dir/horovod-$HOROVOD_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        log "horovod: downloading sdist $HOROVOD_VERSION"
        tmp="$(mktemp -d)"
        pipv download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$tmp"
        mv "$tmp/horovod-$HOROVOD_VERSION.tar.gz" "$sdist"
        rm -rf "$tmp"
    fi
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/deepreduce-horovod.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" RETURN
    tar -xzf "$sdist" -C "$tmp"
    local src="$tmp/horovod-$HOROVOD_VERSION"
    log "horovod: applying $(basename "$HOROVOD_PATCH")"
    (cd "$src" && patch -p1 --dry-run --quiet < "$HOROVOD_PATCH" >/dev/null) \
        || die "horovod: patch does not apply cleanly to the $HOROVOD_VERSION sdist"
    (cd "$src" && patch -p1 --quiet < "$HOROVOD_PATCH")
    log "horovod: building wheel (about 4 minutes on 2 cores; log: $tmp/build.log)"
    local t=$(date +%s)
    if ! (
        cd "$src"
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
               HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
               MAKEFLAGS="-j$(nproc 2>/dev/null || echo 2)"
        PATH="$VENV/bin:$PATH" pipv wheel -v --no-build-isolation --no-deps \
            -w "$tmp/wheel" . > "$tmp/build.log" 2>&1
    ); then
        grep -nE 'error|Error|ERROR' "$tmp/build.log" | grep -v -- '-Werror' | head -30 >&2 || true
        tail -40 "$tmp/build.log" >&2
        cp "$tmp/build.log" "$CACHE/horovod-build-failed.log" 2>/dev/null || true
        die "horovod: wheel build failed (full log kept at $CACHE/horovod-build-failed.log)"
    fi
    log "horovod: wheel built in $(( $(date +%s) - t )) s"
    mkdir -p "$(dirname "$dest")"
    mkdir "$tmp/out" && cp "$tmp"/wheel/horovod-*.whl "$tmp/out/" && cp "$tmp/build.log" "$tmp/out/"
    # Publish atomically, so an interrupted build never leaves a half cache entry.
    mv "$tmp/out" "$dest"
}

step_horovod() {
    local key dir whl whl_hash
    key="$(horovod_key)"
    dir="$CACHE/horovod/$key"
    whl="$(ls "$dir"/horovod-*.whl 2>/dev/null | head -1 || true)"
    if [ -n "$whl" ]; then
        log "horovod: cached wheel found ($key), skipping build"
    else
        build_horovod_wheel "$dir"
        whl="$(ls "$dir"/horovod-*.whl | head -1)"
    fi
    whl_hash="$(sha256sum < "$whl" | cut -c1-16)"

    if stamp_ok horovod-install "$whl_hash" && [ -n "$(installed_version horovod)" ]; then
        log "horovod: installed wheel is current, skipping install"
    else
        log "horovod: installing $(basename "$whl")"
        local cargs=(-c "$REQUIREMENTS")
        [ -f "$CONSTRAINTS" ] && cargs+=(-c "$CONSTRAINTS")
        pipv install -q --force-reinstall --no-deps "$whl"
        # its own runtime needs (cloudpickle, psutil, pyyaml, packaging, cffi) come from requirements.txt
        pipv install -q "$whl" "${cargs[@]}"
        stamp_set horovod-install "$whl_hash"
        rm -f "$STAMPS/horovod-check-build"
    fi
    check_torch

    if stamp_ok horovod-check-build "$whl_hash"; then
        log "horovod: check-build already passed for this wheel, skipping"
    elif [ "${DEEPREDUCE_FORCE:-0}" != "1" ] && [ -f "$dir/check-build.ok" ] \
            && [ "$(cat "$dir/check-build.ok")" = "$whl_hash" ]; then
        # The check is about what the cached wheel was built with; it passed when the wheel
        # was first installed on this machine, so a fresh clone need not pay 20-50 s again.
        log "horovod: check-build passed for this cached wheel before, skipping"
        stamp_set horovod-check-build "$whl_hash"
    else
        log "horovod: running horovodrun --check-build (20-50 s)"
        local out
        out="$(PATH="$VENV/bin:$PATH" "$VENV/bin/horovodrun" --check-build 2>&1)" \
            || { printf '%s\n' "$out" >&2; die "horovodrun --check-build failed"; }
        printf '%s\n' "$out" > "$STAMPS/horovod-check-build.txt"
        printf '%s\n' "$out" | sed 's/^/[setup]   /'
        local what ok=1
        # Frameworks section must list TensorFlow and PyTorch; controllers MPI and Gloo.
        for what in TensorFlow PyTorch MPI Gloo; do
            printf '%s\n' "$out" | grep -qE "\[X\] $what\b" || { echo "[setup] ERROR: check-build lacks [X] $what" >&2; ok=0; }
        done
        [ "$ok" = 1 ] || die "Horovod was built without a required component; delete $dir and re-run"
        stamp_set horovod-check-build "$whl_hash"
        printf '%s\n' "$whl_hash" > "$dir/check-build.ok"
        printf '%s\n' "$out" > "$dir/check-build.txt"
    fi
}

# ---------------------------------------------------------------- 5. the project itself
csrc_hash() {
    if [ -d "$ROOT/csrc" ]; then
        (cd "$ROOT" && find csrc -type f ! -name '*.o' ! -name '*.so' ! -name '*.pyc' \
            ! -path '*/__pycache__/*' ! -path '*/build/*' -print0 | LC_ALL=C sort -z \
            | xargs -0 -r sha256sum) | sha
    else
        echo none
    fi
}

# ---------------------------------------------------------------- 5b. the experiment harness
# The harness (experiments/: main job, models, data, benchmarks) is not part of the wheel. A .pth
# file puts this checkout on the venv's path so that `python -m experiments.train` works from
# anywhere, and the metadata-only distribution deepreduce-experiments (scripts/harness/) declares
# the harness's commands in the entry point group deepreduce.commands, where `deepreduce` finds
# the bench-* / reproduce commands (the library never imports the harness by name).
step_harness() {
    local site key
    site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$ROOT" > "$site/deepreduce-experiments.pth"
    key="$(hash_files scripts/harness/pyproject.toml)"
    if stamp_ok harness "$key" && "$VPY" -c 'import importlib.metadata as m; m.distribution("deepreduce-experiments")' \
            >/dev/null 2>&1; then
        log "harness: checkout on the path, commands registered, skipping"
        return
    fi
    log "harness: registering the experiment commands (pip install scripts/harness)"
    pipv install -q --no-deps --no-build-isolation "$ROOT/scripts/harness"
    stamp_set harness "$key"
}

step_project() {
    if [ ! -f "$ROOT/setup.py" ] && [ ! -f "$ROOT/pyproject.toml" ]; then
        log "project: no setup.py yet, skipping editable install"
        return
    fi
    local key
    key="$(hash_files setup.py pyproject.toml setup.cfg)-$(csrc_hash)-torch$(installed_version torch)"
    if stamp_ok project "$key" && "$VPY" -c 'import deepreduce' >/dev/null 2>&1; then
        log "project: deepreduce installed and csrc/ unchanged, skipping"
        return
    fi
    log "project: pip install -e . (builds the csrc/ extensions)"
    local cargs=(-c "$REQUIREMENTS")
    [ -f "$CONSTRAINTS" ] && cargs+=(-c "$CONSTRAINTS")
    PATH="$VENV/bin:$PATH" MAKEFLAGS="-j$(nproc 2>/dev/null || echo 2)" \
        pipv install -q -e . --no-build-isolation "${cargs[@]}"
    stamp_set project "$key"
    check_torch
}

# ---------------------------------------------------------------- 6. TF custom ops hook
step_tf_ops() {
    local script="$ROOT/scripts/build_tf_ops.sh"
    if [ ! -f "$script" ]; then
        log "tf-ops: scripts/build_tf_ops.sh not present, skipping"
        return
    fi
    local key
    key="$(csrc_hash)-$(hash_files "$script")-tf$(installed_version tensorflow-cpu)"
    if stamp_ok tf-ops "$key"; then
        log "tf-ops: up to date, skipping"
        return
    fi
    log "tf-ops: running scripts/build_tf_ops.sh"
    PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" bash "$script"
    stamp_set tf-ops "$key"
}

step_apt
step_venv
step_torch
step_requirements
step_horovod
step_project
step_harness
step_tf_ops
log "done in $(( $(date +%s) - T0 )) s (activate with: source .venv/bin/activate)"
