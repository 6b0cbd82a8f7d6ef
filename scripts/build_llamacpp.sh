#!/usr/bin/env bash
# Build llama.cpp for the llama.cpp peer backend (plugins/peers/llamacpp.py): `make peers`.
#
# The pinned llama-cpp-python sdist vendors llama.cpp (with convert_hf_to_gguf.py) and its ctypes
# bindings; PyPI has no wheel of it, and pip-installing it would compile all of llama.cpp's tools.
# Only libllama and the libggml* it links are built here; the bindings are used from the unpacked
# sdist. Built in a temp dir beside the destination, smoke-tested there (a tiny GGUF forward,
# plugins/peers/llamacpp_smoke.py), and renamed into place: DEST is either absent or a build that
# ran here, and a second run is instant.
#
# GGML_NATIVE (-march=native) with AMX switched off (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16; GCC
# keeps explicit -mno-* over what -march implies): in 0.3.36 the AMX q8_0 kernel
# (ggml-cpu/amx/mmq.cpp, tinygemm_kernel_amx) died with SIGILL at `tilezero` on a 2-core AMX Xeon
# where oneDNN's AMX GEMMs run, which took down the process that loaded it. Without __AMX_INT8__
# ggml uses its AVX512 / AVX2 paths, as on every other CPU.
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
CACHE=$ROOT/.cache/peers
DEST=${PLUGINS_LLAMACPP_DIR:-$CACHE/llama.cpp}

STAMP="llama-cpp-python $VERSION, native without AMX"  # a build made otherwise is rebuilt
if [ "$(cat "$DEST/BUILT" 2>/dev/null)" = "$STAMP" ]; then exit 0; fi
for tool in cmake ninja g++; do
  command -v $tool >/dev/null || { echo "build_llamacpp: $tool not found (needed: cmake >= 3.21, ninja, g++;" \
    "e.g. apt-get install cmake ninja-build g++)" >&2; exit 1; }
done
"$PY" -m pip install -q -r "$ROOT/requirements-peers.txt"
mkdir -p "$CACHE" "$(dirname "$DEST")"
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
[ -f "$SDIST" ] || "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"

NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
TMP=$(mktemp -d "$DEST.tmp-XXXXXX")
chmod 755 "$TMP"
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$SDIST" -C "$TMP"
mv "$TMP/llama_cpp_python-$VERSION" "$TMP/src"
# $ORIGIN: libllama finds its libggml* beside it after the rename.
cmake -S "$TMP/src/vendor/llama.cpp" -B "$TMP/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
  "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >"$TMP/cmake.log"
cmake --build "$TMP/build" --target llama -j "${JOBS:-2}"
mkdir "$TMP/lib"
cp -a "$TMP/build/bin"/lib*.so* "$TMP/lib/"
rm -rf "$TMP/build"
echo "$STAMP" >"$TMP/BUILT"
(cd "$ROOT" && "$PY" -m plugins.peers.llamacpp_smoke "$TMP") || {
  echo "build_llamacpp: the build does not run on this machine (above); nothing installed" >&2; exit 1; }
rm -rf "$DEST"  # an incomplete or older one
mv -T "$TMP" "$DEST"
trap - EXIT
echo "llama.cpp built in $DEST"
