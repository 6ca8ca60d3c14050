"""Where examples/peers/setup_peers.sh puts the optional peers (outside the repository: GBs)."""
import os

PEERS_DIR = os.environ.get("DEEPINFER_PEERS_DIR", os.path.expanduser("~/.cache/deepinfer/peers"))
VLLM_PYTHON = os.path.join(PEERS_DIR, "vllm-venv", "bin", "python")
LLAMA_SRC = os.path.join(PEERS_DIR, "llama.cpp", "src")        # the sdist's vendored llama.cpp
LLAMA_BENCH = os.path.join(PEERS_DIR, "llama.cpp", "build", "bin", "llama-batched-bench")
GGUF_DIR = os.path.join(PEERS_DIR, "gguf")
