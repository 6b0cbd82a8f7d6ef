#!/usr/bin/env bash
# Build llama.cpp for the llama.cpp peer backend (plugins/peers/llamacpp.py): `make peers`.
#
# The pinned llama-cpp-python sdist vendors llama.cpp (with convert_hf_to_gguf.py) and its ctypes
# bindings; PyPI has no wheel of it, and pip-installing it would compile all of llama.cpp's tools.
# Only libllama and the libggml* it links are built here; the bindings are used from the unpacked
# sdist. Built in a temp dir beside the destination and renamed into place: DEST is either absent
# or complete, and a second run is instant.
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
CACHE=$ROOT/.cache/peers
DEST=${PLUGINS_LLAMACPP_DIR:-$CACHE/llama.cpp}

if [ -f "$DEST/BUILT" ]; then exit 0; fi
for tool in cmake ninja g++; do
  command -v $tool >/dev/null || { echo "build_llamacpp: $tool not found (needed: cmake >= 3.21, ninja, g++;" \
    "e.g. apt-get install cmake ninja-build g++)" >&2; exit 1; }
done
"$PY" -m pip install -q -r "$ROOT/requirements-peers.txt"
mkdir -p "$CACHE" "$(dirname "$DEST")"
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
[ -f "$SDIST" ] || "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"

TMP=$(mktemp -d "$DEST.tmp-XXXXXX")
chmod 755 "$TMP"
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$SDIST" -C "$TMP"
mv "$TMP/llama_cpp_python-$VERSION" "$TMP/src"
# $ORIGIN: libllama finds its libggml* beside it after the rename.
cmake -S "$TMP/src/vendor/llama.cpp" -B "$TMP/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >"$TMP/cmake.log"
cmake --build "$TMP/build" --target llama -j "${JOBS:-2}"
mkdir "$TMP/lib"
cp -a "$TMP/build/bin"/lib*.so* "$TMP/lib/"
rm -rf "$TMP/build"
echo "llama-cpp-python $VERSION" >"$TMP/BUILT"
rm -rf "$DEST"  # an incomplete one (no BUILT), e.g. from an older layout
mv -T "$TMP" "$DEST"
trap - EXIT
echo "llama.cpp built in $DEST"
