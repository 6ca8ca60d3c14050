"""SamplingParams.prompt_logprobs: each prompt token from the second on scored by the logits at the token before it,
against transformers' own implementation (fp32), and unchanged by chunked prefill, n > 1, a prefix store, batch
neighbours and preemption."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer import LLM, SamplingParams
from tests.conftest import assert_logprobs_alike

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [12, 13], [40, 41, 42, 43, 44],
           [100]]
TOP = 3


def hf_prompt_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: transformers' log_softmax at each position but the last, scoring the next token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def check(entries: list, ids: list[int], ref: torch.Tensor, top: int) -> None:
    """entries: RequestOutput.prompt_logprobs against the reference rows."""
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row, token = entries[p], ref[p - 1], ids[p]
        want_top = row.topk(top).indices.tolist()
        assert set(entry) == {token, *want_top}
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        for r, tok in enumerate(want_top):
            assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert tok == token or entry[tok].rank == r + 1


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe"])
def test_prompt_logprobs_match_transformers(fixture, request):
    """Four prompts in one batch, one of them without prompt_logprobs; its output carries None."""
    path = request.getfixturevalue(fixture)
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP if i != 2 else None) for i in range(4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[2].prompt_logprobs is None
    for i in (0, 1, 3):
        check(outs[i].prompt_logprobs, PROMPTS[i], hf_prompt_logprobs(path, PROMPTS[i]), TOP)
    assert outs[3].prompt_logprobs == [None]
    token = PROMPTS[0][1]
    assert outs[0].prompt_logprobs[1][token].decoded_token == llm.engine.tokenizer.decode([token])


def same(got: list, want: list) -> bool:
    """Each request's prompt_logprobs alike (assert_logprobs_alike, to 1e-5)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_logprobs_alike(a, b, 1e-5)
    return True


def test_chunks_n_prefix_store_and_preemption_leave_them_unchanged(tiny_qwen3_moe, tmp_path):
    """Chunked prefill (4-token chunks across the 19-token prompt), two children, a prefix store that already holds
    the prompt (a scored prompt is prefilled whole), and a pool small enough that sequences are preempted and
    recomputed: the same entries as one plain prefill."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP)
    plain = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    want = [o.prompt_logprobs for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    chunked = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=32 << 20, block_size=4, max_num_batched_tokens=4,
                  max_model_len=64)
    assert same([o.prompt_logprobs for o in chunked.generate(PROMPTS, params, use_tqdm=False)], want)
    store = LLM(tiny_qwen3_moe, dtype="float32", kv_cache_memory=32 << 20, block_size=4,
                prefix_cache={"path": str(tmp_path / "store")})
    store.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fills the store
    assert store.engine.prefix_cache.lookup(PROMPTS[0])[0]  # its blocks would be skipped
    two = store.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4, prompt_logprobs=TOP),
                         use_tqdm=False)
    assert same([o.prompt_logprobs for o in two], want) and all(len(o.outputs) == 2 for o in two)
    block_bytes = plain.engine.cache.spec.bytes_per_block
    small = LLM(tiny_qwen3_moe, dtype="float32", block_size=4, max_num_seqs=4, max_model_len=48,
                kv_cache_memory=14 * block_bytes)
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert same([o.prompt_logprobs for o in outs], want)


def test_prompt_logprobs_past_the_vocabulary_are_refused(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="request 0: SamplingParams.prompt_logprobs=100000 is more than the vocab"):
        llm.generate([[5, 6]], SamplingParams(prompt_logprobs=100000), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None or an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
