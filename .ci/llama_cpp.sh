#!/usr/bin/env bash
# Build llama.cpp (the optional engine of the `engines` tests) into build/engines/llama.cpp, from the
# llama-cpp-python 0.3.36 source distribution, which vendors llama.cpp, its convert_hf_to_gguf.py, gguf-py and the
# Python ctypes bindings. Only the shared library is built here (what the tests need); docs/conversion.md builds the
# command-line tools too. Re-running is a no-op once libllama.so exists.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=build/engines
[ -e "$dest/llama.cpp/build/bin/libllama.so" ] && exit 0
mkdir -p "$dest"
cd "$dest"
[ -f llama_cpp_python-0.3.36.tar.gz ] || python -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d .
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
ln -sfn llama_cpp_python-0.3.36/vendor/llama.cpp llama.cpp
log=$(pwd)/build.log
if ! { cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
         -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF &&
       cmake --build llama.cpp/build -j"$(nproc)" --target llama; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    exit 1
fi
