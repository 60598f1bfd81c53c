#!/usr/bin/env bash
# Installs what zerograd needs to build and test on Debian/Ubuntu, skipping what
# is already there: a C++20 compiler, Meson >= 1.0 and Ninja, pkg-config,
# Eigen 3.4, nlohmann-json (safetensors headers), OpenMPI (the mpi process group)
# and doctest. The CUDA toolkit is optional and never installed here:
# when /usr/local/cuda (or nvcc on PATH) exists, the build uses it.
set -euo pipefail

need=()
command -v g++ >/dev/null || need+=(g++)
command -v ninja >/dev/null || need+=(ninja-build)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v python3 >/dev/null || need+=(python3)
[ -f /usr/include/eigen3/Eigen/Core ] || need+=(libeigen3-dev)
[ -f /usr/include/doctest/doctest.h ] || need+=(doctest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
command -v mpirun >/dev/null || need+=(openmpi-bin)
[ -n "$(find /usr/include /usr/lib -name mpi.h -print -quit 2>/dev/null)" ] || need+=(libopenmpi-dev)
meson_ok() { command -v meson >/dev/null && meson --version | awk -F. '{exit !($1 >= 1)}'; }
meson_ok || need+=(meson)

if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install-deps: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# Distributions older than Debian 12 / Ubuntu 23.04 ship Meson < 1.0: take it from PyPI then.
if ! meson_ok; then
  echo "install-deps: the distribution's Meson is older than 1.0; installing Meson from PyPI"
  python3 -m pip install --user --quiet 'meson>=1.0' || python3 -m pip install --user --quiet --break-system-packages 'meson>=1.0'
fi
