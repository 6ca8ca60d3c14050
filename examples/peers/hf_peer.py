"""transformers' generate as a sweep peer (always available): same checkpoint, same prompts.

Decode seconds per step = (generate(n) - generate(1)) / (n - 1): the prefill and the first token
cancel, leaving the n - 1 decode steps (all of them, warm-up included: generate has no per-step hook)."""
import time

import torch

from examples.sweep.deepinfer_point import prompts


def _generate_seconds(model, ids: torch.Tensor, n: int) -> float:
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    seconds = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + n, "generate stopped early"
    return seconds


def measure(p, opts: dict) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(opts.get("num_threads", 1))
    dtype = torch.float32 if opts.get("dtype") in ("float32", "fp32") else torch.bfloat16
    kw = {"experts_implementation": opts["experts_implementation"]} if "experts_implementation" in opts else {}
    model = AutoModelForCausalLM.from_pretrained(p.model_dir, dtype=dtype, **kw).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor(prompts(p.batch, p.context, vocab, seed=p.batch))
    n = p.warmup + p.steps + 1
    with torch.inference_mode():
        _generate_seconds(model, ids[:1, :8], 2)  # warm-up
        t1, tn = _generate_seconds(model, ids, 1), _generate_seconds(model, ids, n)
    sps = (n - 1) / (tn - t1)
    return {"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "step_split_ms": None,
            "measured_tokens_per_step": 1.0,  # generate(n) asserted n new tokens per sequence
            "prefill": [{"tokens_per_step": p.batch * p.context, "steps": 1, "step_ms": 1000 * t1,
                         "tokens_per_s": p.batch * p.context / t1}],
            "method": "(generate(n) - generate(1)) / (n - 1), all decode steps; prefill = generate(1)"}
