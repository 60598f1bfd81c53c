# Sourced by the other scripts: puts a CUDA toolkit in /usr/local/cuda on PATH
# (so Meson finds nvcc) and names the build folder.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export PATH="$HOME/.local/bin:$PATH"  # a Meson installed by pip --user
BUILD_DIR="${BUILD_DIR:-build}"

# Configures $BUILD_DIR once (extra arguments go to `meson setup`), then compiles it.
zg_build() {
  if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    meson setup "$BUILD_DIR" "$@"
  fi
  meson compile -C "$BUILD_DIR"
}
