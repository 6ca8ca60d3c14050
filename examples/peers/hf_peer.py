"""transformers' generate as a sweep peer (always available): same checkpoint, same prompts.

Default timing ("streamer"): one generate(n) call with a streamer that timestamps every step
(generate hands it the prompt, then each new token), so the decode steps are timed one by one and
the same warm-up / timed window as deepinfer's applies. "difference" (option timing) is the classic
(generate(n) - generate(1)) / (n - 1); on a shared machine it is fragile at large batches, where
one prefill (e.g. 110 s at batch 16) dwarfs the decode and any drift between the two calls lands
in the difference."""
import time

import torch

from examples.sweep.deepinfer_point import prompts
from examples.sweep.errors import PointError
from examples.sweep.metrics import steps_per_second


class StepClock:
    """A generate streamer (put / end) that only records when each put happens."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def draw_kwargs(sampling: dict) -> dict:
    """generate's arguments for the sweep's sampling ({}: greedy). top_k 0 where none is given: generate's
    default of 50 would filter what the other engines do not."""
    if not sampling:
        return dict(do_sample=False)
    return {"do_sample": True, "top_k": 0, **sampling}


def _generate(model, ids: torch.Tensor, n: int, streamer=None, sampling: dict | None = None) -> float:
    kw = dict(eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids), **draw_kwargs(sampling or {}))
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=streamer, **kw)
    seconds = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + n:
        raise PointError(f"transformers generate stopped after {out.shape[1] - ids.shape[1]} of {n} tokens")
    return seconds


def _streamer_timing(model, ids, p, n: int) -> dict:
    clock = StepClock()
    _generate(model, ids, n, clock, p.sampling)
    t = clock.times  # [prompt, token 1 (after prefill), token 2, ...]
    steps = [b - a for a, b in zip(t[1:], t[2:])][p.warmup:p.warmup + p.steps]
    sps = steps_per_second(steps)
    return {"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "prefill_s": t[1] - t[0],
            "method": "transformers generate(n), each step timestamped by a streamer; same warm-up/timed window"}


def _difference_timing(model, ids, n: int, sampling: dict) -> dict:
    t1, tn = _generate(model, ids, 1, sampling=sampling), _generate(model, ids, n, sampling=sampling)
    sps = (n - 1) / (tn - t1)
    return {"decode_avg_sps": sps, "decode_step_ms": 1000 / sps, "prefill_s": t1,
            "method": "(generate(n) - generate(1)) / (n - 1), all decode steps; prefill = generate(1)"}


def measure(p, opts: dict) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(opts.get("num_threads", 1))
    dtype = torch.float32 if opts.get("dtype") in ("float32", "fp32") else torch.bfloat16
    kw = {"experts_implementation": opts["experts_implementation"]} if "experts_implementation" in opts else {}
    model = AutoModelForCausalLM.from_pretrained(p.model_dir, dtype=dtype, **kw).eval()
    ids = torch.tensor(prompts(p.batch, p.context, model.config.vocab_size, seed=p.batch))
    n = p.warmup + p.steps + 1
    with torch.inference_mode():
        _generate(model, ids[:1, :8], 2)  # warm-up
        if opts.get("timing") == "difference":
            r = _difference_timing(model, ids, n, p.sampling)
        else:
            r = _streamer_timing(model, ids, p, n)
    pre = r.pop("prefill_s")
    return {**r, "step_split_ms": None, "measured_tokens_per_step": 1.0,  # generate checked: n tokens each
            "prefill": [{"tokens_per_step": p.batch * p.context, "steps": 1, "step_ms": 1000 * pre,
                         "tokens_per_s": p.batch * p.context / pre}]}
