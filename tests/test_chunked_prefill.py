"""Chunked prefill: prompts longer than a step's token budget arrive over several prefill steps with outputs
identical to whole-prompt prefill (fp32: greedy, seeded, logprobs, with speculation, preemption, structured
outputs) on Llama, Qwen3-MoE and DeepSeek-V4 (against transformers), and a short prompt's first token beside a
long prompt's chunks."""
import pytest
import torch

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
KW = dict(dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_model_len=128)
PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=6, n=2, max_tokens=8, ignore_eos=True)]


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 40, 3, 77, 20, 33)]


def run(path, **kw):
    llm = LLM(path, **{**KW, **kw})
    ps = prompts()
    outs = llm.generate(ps, [PARAMS[i % 3] for i in range(len(ps))], use_tqdm=False)
    return [[(c.token_ids, [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in c.logprobs or []])
             for c in o.outputs] for o in outs], llm


@pytest.fixture(scope="module")
def whole(tiny_qwen3_moe, tiny_llama):
    return {m: run(p)[0] for m, p in (("qwen", tiny_qwen3_moe), ("llama", tiny_llama))}


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
@pytest.mark.parametrize("model", ["qwen", "llama"])
def test_chunked_outputs_equal_whole_prompt_prefill(tiny_qwen3_moe, tiny_llama, whole, model, chunk):
    path = tiny_qwen3_moe if model == "qwen" else tiny_llama
    got, llm = run(path, max_num_batched_tokens=chunk)
    assert got == whole[model]
    assert llm.engine.num_steps["prefill"] >= sum(len(p) for p in prompts()) // max(chunk, 1) // 4
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cache.num_blocks


def test_threshold_and_speculation_and_preemption_keep_outputs(tiny_qwen3_moe, whole):
    got, _ = run(tiny_qwen3_moe, long_prefill_token_threshold=6, speculative={"method": "ngram", "num_draft_tokens": 3})
    assert got == whole["qwen"]
    # 24 blocks of 4 tokens: chunked prefills and decodes evict each other and recompute (in chunks again).
    got, llm = run(tiny_qwen3_moe, max_num_batched_tokens=16, max_num_seqs=5, max_model_len=96,
                   kv_cache_memory=24 * LLM(tiny_qwen3_moe, **KW).engine.cache.spec.bytes_per_block)
    assert got == whole["qwen"] and llm.engine.scheduler.num_preemptions > 0


def test_structured_outputs_with_chunked_prefill(tiny_qwen3_moe):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, structured_outputs={"regex": "[a-c]{2,4}-[0-9]{2}"})
    ps = prompts()
    want = [o.outputs[0].text for o in LLM(tiny_qwen3_moe, **KW).generate(ps, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in LLM(tiny_qwen3_moe, **KW, max_num_batched_tokens=9).generate(ps, params, use_tqdm=False)]
    assert got == want


def test_a_short_prompt_gets_its_first_token_beside_a_long_prompts_chunks(tiny_qwen3_moe):
    """With long_prefill_token_threshold the first prefill step holds the long prompt's first chunk and the
    whole short prompt: the short one's first token comes after one step, not after the long prefill."""
    llm = LLM(tiny_qwen3_moe, **KW, long_prefill_token_threshold=16)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("long", prompts()[3], params)
    engine.add_request("short", prompts()[0], params)
    engine.step()
    assert engine.requests["short"].metrics.first_token_time is not None
    assert engine.requests["long"].metrics.first_token_time is None
    while engine.has_unfinished():
        engine.step()


@pytest.fixture(scope="module")
def v4_chunk_case(tmp_path_factory):
    from test_deepseek_v4 import hf_greedy, make_checkpoint, prompt_of

    path = str(tmp_path_factory.mktemp("v4") / "v4")
    hf = make_checkpoint(path, seed=1)
    ps = [prompt_of(5, 31), prompt_of(90, 33), prompt_of(300, 36)]
    return path, ps, [hf_greedy(hf, p, 12) for p in ps]


V4_KW = dict(dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=4, max_model_len=512)


def test_deepseek_v4_chunks_equal_transformers(v4_chunk_case):
    """Prompts up to 300 tokens in chunks of 1, 7, 16 and 100: windows of both compression rates (4, 128) and
    the sliding window (8) straddle chunk borders; greedy tokens equal transformers'."""
    path, ps, refs = v4_chunk_case
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for chunk in (1, 7, 16, 100):
        llm = LLM(path, max_num_batched_tokens=chunk, **V4_KW)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)] == refs
        assert llm.engine.num_steps["prefill"] > 3


# Chunked against whole-prompt prefill, first token's top-20 logprobs. Not bit-identical: a chunk's attention
# tiles span other key counts, so fp32 sums round differently (~1e-6 in the exact pools), and a value on a
# quantisation boundary can then round the other way. Measured: fp8 <= 0.009, fp4 <= 0.016, fp4_all 0.47 at
# chunks of 16 (such a flip changed an indexer top-k pick; the other chunkings <= 0.017), against 0.14 / 0.32
# / 1.38 for the formats' own error against the exact pools. A misplaced row would be an error of that size.
CHUNKED_BOUNDS = {"fp8": 0.05, "fp4": 0.05, "fp4_all": 0.6}


@pytest.mark.parametrize("kv_cache_dtype", list(CHUNKED_BOUNDS))
def test_deepseek_v4_quantised_chunks_match_whole_prompts(v4_chunk_case, kv_cache_dtype):
    path, ps, _ = v4_chunk_case
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)

    def top_logprobs(**kw):
        outs = LLM(path, kv_cache_dtype=kv_cache_dtype, **V4_KW, **kw).generate(ps, first, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    whole = top_logprobs()
    for chunk in (1, 7, 16, 100):
        for a, b in zip(top_logprobs(max_num_batched_tokens=chunk), whole):
            assert next(iter(a)) == next(iter(b))  # the same greedy token
            assert max(abs(a[t] - b[t]) for t in a.keys() & b.keys()) <= CHUNKED_BOUNDS[kv_cache_dtype]


def test_bad_chunking_keywords(tiny_llama):
    with pytest.raises(ValueError, match="max_num_batched_tokens=16.*enable_chunked_prefill=False"):
        LLM(tiny_llama, **KW, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(tiny_llama, **KW, long_prefill_token_threshold=-1)
