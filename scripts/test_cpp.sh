#!/usr/bin/env bash
# Build the C++ library (cpp/) and run its tests with ctest (the README's test command runs this after pytest).
#
#   bash scripts/test_cpp.sh                      # build into build/cpp, run every test but the real-model one
#   DSPARK_REAL_ENGINE_DIR=engines/smollm2 bash scripts/test_cpp.sh -L real_model   # the example on SmolLM2
#
# Needs cmake, a C++17 compiler, nlohmann-json and GoogleTest (Debian: cmake g++ nlohmann-json3-dev
# libgtest-dev; installed here with apt-get when missing and running as root), pybind11 and the project
# itself in the Python on PATH (`pip install -e '.[test]'`). Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${DSPARK_CPP_BUILD:-build/cpp}"
PYTHON_ON_PATH="$(command -v python || command -v python3)"
# the real interpreter, not a pyenv-style shim: its path is compiled in as the default embedded Python
PYTHON="$("$PYTHON_ON_PATH" -c 'import sys; print(sys.executable)')"

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || missing+=(g++)
[ -f /usr/include/nlohmann/json.hpp ] || missing+=(nlohmann-json3-dev)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test_cpp: installing ${missing[*]} (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
  else
    echo "test_cpp: missing ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
    exit 2
  fi
fi
"$PYTHON" -c "import pybind11, dspark_export" 2>/dev/null \
  || { echo "test_cpp: $PYTHON lacks pybind11 or dspark_export; run: pip install -e '.[test]'" >&2; exit 2; }

cmake -S cpp -B "$BUILD" -DPython_EXECUTABLE="$PYTHON" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
if [ $# -eq 0 ]; then set -- -LE real_model; fi
ctest --test-dir "$BUILD" --output-on-failure "$@"
