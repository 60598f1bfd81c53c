#!/usr/bin/env bash
# Installs what zerograd needs to build and test on Debian/Ubuntu, skipping what
# is already there: a C++20 compiler, Meson >= 1.0 (>= 1.4 with CUDA) and Ninja, pkg-config,
# Eigen 3.4, nlohmann-json (safetensors headers), OpenMPI (the mpi process group),
# doctest, and rsvg-convert (a test renders the course's figures as a viewer would).
# The CUDA toolkit is optional and never installed here:
# when /usr/local/cuda (or nvcc on PATH) exists, the build uses it, and this script
# adds the cuDNN frontend headers (the CUDA backend's fused attention) next to it.
# With --clang (CI) it adds Clang, its sanitizer and libFuzzer runtimes and
# llvm-symbolizer: the Clang build, the fuzzers and the ThreadSanitizer run.
set -euo pipefail
with_clang=false
[ "${1:-}" = "--clang" ] && with_clang=true

need=()
command -v g++ >/dev/null || need+=(g++)
command -v ninja >/dev/null || need+=(ninja-build)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v python3 >/dev/null || need+=(python3)
[ -f /usr/include/eigen3/Eigen/Core ] || need+=(libeigen3-dev)
[ -f /usr/include/doctest/doctest.h ] || need+=(doctest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v rsvg-convert >/dev/null || need+=(librsvg2-bin)  # the docs' figures are rendered by a test
[ -n "$(find /usr/include /usr/lib -name mpi.h -print -quit 2>/dev/null)" ] || need+=(libopenmpi-dev)
has_cuda() { command -v nvcc >/dev/null || [ -d /usr/local/cuda ]; }
# Meson >= 1.0; with CUDA >= 1.4, the first that asks nvcc for dependency files: with an
# older one a changed header does not rebuild the .cu objects that include it (a stale
# vtable in one of them then crashes at run time).
meson_min=1.0
has_cuda && meson_min=1.4
meson_ok() { command -v meson >/dev/null && printf '%s\n' "$meson_min" "$(meson --version)" | sort -V -C; }
command -v meson >/dev/null || need+=(meson)
if $with_clang; then
  command -v clang++ >/dev/null || need+=(clang)
  [ -n "$(find /usr/lib/llvm-* -name 'libclang_rt.fuzzer-*.a' -print -quit 2>/dev/null)" ] || need+=(libclang-rt-dev)
  command -v llvm-symbolizer >/dev/null || need+=(llvm)  # sanitizer reports with file:line
fi
has_cuda && ! python3 -m pip --version >/dev/null 2>&1 && need+=(python3-pip)

if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install-deps: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# Where the distribution's Meson is older than that (Debian 12 ships 1.0.1): take it from PyPI.
export PATH="$HOME/.local/bin:$PATH"  # where pip --user puts it (scripts/env.sh does the same)
if ! meson_ok; then
  echo "install-deps: Meson $(meson --version 2>/dev/null || echo '(none)') is older than $meson_min; installing Meson from PyPI"
  python3 -m pip install --user --quiet "meson>=$meson_min" ||
    python3 -m pip install --user --quiet --break-system-packages "meson>=$meson_min"
  meson_ok || { echo "install-deps: Meson >= $meson_min is still not on PATH" >&2; exit 1; }
fi

# The cuDNN frontend: NVIDIA's header-only C++ API over cuDNN's graph backend, which
# the CUDA backend uses for fused attention (cuda/attention.cu). PyPI ships it as a
# wheel whose include/ folder holds the headers; we keep only that folder, unpacked
# where meson.build looks by default (option cudnn-frontend). It must keep its name:
# one header includes a sibling as "../include/...". The wheel's Python tag does not
# matter for headers, so one tag is asked for whatever this machine's Python.
CUDNN_FRONTEND_VERSION=1.32.0
CUDNN_FRONTEND_DIR=/usr/local/cudnn-frontend/include
frontend_version() {
  awk '/define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION/ {v = v (v == "" ? "" : ".") $3} END {print v}' \
    "$CUDNN_FRONTEND_DIR/cudnn_frontend_version.h" 2>/dev/null
}
if has_cuda && [ "$(frontend_version)" != "$CUDNN_FRONTEND_VERSION" ]; then
  echo "install-deps: installing the cuDNN frontend $CUDNN_FRONTEND_VERSION headers in $CUDNN_FRONTEND_DIR"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  wheel_dir=$(mktemp -d)
  trap 'rm -rf "$wheel_dir"' EXIT
  # Without PyPI the build still goes on: fused attention is then off (meson's summary says so).
  if python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform "manylinux_2_28_$(uname -m)" --dest "$wheel_dir" "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION"; then
    python3 - "$wheel_dir" <<'PY'
import pathlib, sys, zipfile
folder = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next(folder.glob("*.whl"))) as wheel:
    wheel.extractall(folder, [m for m in wheel.namelist() if m.startswith("include/")])
PY
    $sudo rm -rf "$CUDNN_FRONTEND_DIR"
    $sudo mkdir -p "$(dirname "$CUDNN_FRONTEND_DIR")"
    $sudo cp -r "$wheel_dir/include" "$CUDNN_FRONTEND_DIR"
    $sudo chmod -R a+rX "$CUDNN_FRONTEND_DIR"
  else
    echo "install-deps: could not download the cuDNN frontend; the CUDA backend builds without fused attention" >&2
  fi
fi
