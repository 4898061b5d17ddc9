#!/usr/bin/env bash
# Build llama.cpp's llama-server, CPU only, and write a tiny random-weight model for it: make
# bench's real-backend pass of scenario (k) (`make llama-server`). The llama.cpp tree comes
# from the llama-cpp-python source distribution on PyPI (it vendors one) and the model is
# written with the gguf package, so nothing but PyPI is needed. About 7 minutes on 2 cores;
# both land in .bench-cache/llama-server/. Optional: without them make bench skips that pass
# and says so.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.bench-cache/llama-server"
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
mkdir -p "$out/bin"
if [ ! -x "$out/bin/llama-server" ]; then
  for tool in cmake g++ make; do
    command -v "$tool" >/dev/null 2>&1 || { echo "llama-server not built: $tool is missing" >&2; exit 1; }
  done
  work="$root/.bench-cache/llama-build"
  mkdir -p "$work"
  if [ ! -d "$work/llama_cpp_python-$version" ]; then
    "$python" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
      "llama-cpp-python==$version" -d "$work"
    tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  fi
  src="$work/llama_cpp_python-$version/vendor/llama.cpp"
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    >"$work/cmake.log"
  cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log"
  cp "$work/build/bin/llama-server" "$out/bin/llama-server"
  rm -rf "$work"
  echo "built $out/bin/llama-server"
fi
if [ ! -s "$out/tiny.gguf" ]; then
  venv="$root/.bench-cache/gguf-venv"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q \
    gguf==0.19.0 numpy==2.4.6 PyYAML==6.0.3 tqdm==4.70.1 requests==2.34.2
  "$venv/bin/python" "$root/bench/llama_model.py" "$out/tiny.gguf.tmp"
  mv "$out/tiny.gguf.tmp" "$out/tiny.gguf"
  echo "wrote $out/tiny.gguf"
fi
