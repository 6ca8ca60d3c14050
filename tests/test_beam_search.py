"""LLM.beam_search against vLLM's beam search run on transformers' logits (every beam re-scored from its whole
text each step, as vLLM's loop of one-token generates does), on forked sequences: full KV blocks shared, partial
blocks and V4's StateBlocks copied."""
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer import LLM, BeamSearchParams, _C
from deepinfer.engine.beam_search import BeamSearch
from test_deepseek_v4 import make_checkpoint, prompt_of

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [12, 13], [86, 74, 71, 223, 83, 87, 75, 69, 77, 223, 68, 84, 81, 89, 80]]


def reference(hf, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> list[tuple[list[int], float]]:
    """vLLM's algorithm: each beam's 2 * width most likely next tokens (transformers' log_softmax over its whole
    sequence) are the candidates; EOS ones complete, the best `width` others go on -> the best `width` of the
    completed and the last beams: (tokens with the prompt, cumulative logprob), best first."""
    width = params.beam_width

    def score(beam):
        return beam[1] / (len(beam[0]) - (beam[0][-1] in eos)) ** params.length_penalty

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            rows = hf(torch.tensor([b[0] for b in beams])).logits[:, -1].float().log_softmax(-1)
        candidates = []
        for (tokens, cum), row in zip(beams, rows):
            top = row.topk(2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                (completed if tok in eos else candidates).append((tokens + [tok], cum + lp))
        beams = sorted(candidates, key=score, reverse=True)[:width]
        if not beams:
            break
    return sorted(completed + beams, key=score, reverse=True)[:width]


def check(outs, prompts, hf, params, eos) -> None:
    assert len(outs) == len(prompts)
    for out, prompt in zip(outs, prompts):
        want = reference(hf, prompt, params, eos)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        for seq, (tokens, cum) in zip(out.sequences, want):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(seq.logprobs) == len(tokens) - len(prompt)
            assert seq.finish_reason == ("stop" if tokens[-1] in eos else "length")


def assert_engine_clean(llm) -> None:
    """Every sequence gone, every block and state slot free."""
    engine = llm.engine
    engine.scheduler.check_invariants()
    assert not engine.seqs and not engine.requests and not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.scheduler.num_free_state_slots == engine.config.max_num_seqs


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3_moe"])
def model(request):
    """(path, transformers' model in fp32) of a tiny checkpoint."""
    path = request.getfixturevalue(request.param)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("params", [BeamSearchParams(beam_width=3, max_tokens=6),
                                    BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5),
                                    BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True)])
def test_matches_vllm_algorithm_on_transformers(model, params):
    """Blocks of 4 tokens: beams fork from partial blocks and share full ones."""
    path, hf = model
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    outs = llm.beam_search(PROMPTS, params)
    eos = set() if params.ignore_eos else set(llm.engine.eos_token_ids())
    check(outs, PROMPTS, hf, params, eos)
    stopped = any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    assert not (stopped and params.ignore_eos)
    assert stopped or params.ignore_eos or "tiny_qwen3_moe" in path  # the tiny Llama's third prompt meets EOS
    tok, best = llm.get_tokenizer(), outs[2].sequences[0]
    assert best.text == tok.decode(best.tokens, skip_special_tokens=True)
    kept = llm.beam_search(PROMPTS[2:], replace(params, skip_special_tokens=False))[0].sequences[0]
    assert kept.tokens == best.tokens and kept.text == tok.decode(best.tokens)
    assert_engine_clean(llm)


def test_waves_chunked_prefill_and_text_prompts(model):
    """Room for one prompt's beams at a time (KV blocks and max_num_seqs), prompts prefilled in chunks of 8 tokens
    while others' beams wait, or one prompt at a time by concurrency_limit: the same beams as all at once in one
    roomy engine; strings are tokenised as generate does."""
    path, hf = model
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    roomy = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    want = roomy.beam_search(PROMPTS, params)
    bytes_per_block = roomy.engine.cache.spec.bytes_per_block
    tight = LLM(path, dtype="float32", kv_cache_memory=24 * bytes_per_block, block_size=4, max_num_seqs=4,
                max_num_batched_tokens=8, max_model_len=64)
    text = roomy.get_tokenizer().decode(PROMPTS[2])
    got = tight.beam_search(PROMPTS[:2] + [text], params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
    prefills = roomy.engine.num_steps["prefill"]
    one_by_one = roomy.beam_search(PROMPTS, params, concurrency_limit=1, use_tqdm=True)
    assert roomy.engine.num_steps["prefill"] - prefills == 3  # one prompt (one prefill) per wave
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == [[s.tokens for s in o.sequences] for o in want]
    with pytest.raises(ValueError, match="concurrency_limit"):
        roomy.beam_search(PROMPTS, params, concurrency_limit=0)
    assert tight.engine.scheduler.num_preemptions == 0
    assert_engine_clean(tight)


def test_prefix_store_hits_give_the_same_beams(model, tmp_path):
    """Prompts whose blocks come from the prefix store (second search) fork from the loaded blocks alike."""
    path, hf = model
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4, prefix_cache=str(tmp_path / "store"))
    first = llm.beam_search(PROMPTS, params)
    store = llm.engine.prefix_cache.store
    hits = store.stats()["hits"]
    again = llm.beam_search(PROMPTS, params)
    assert store.stats()["hits"] > hits
    assert [[s.tokens for s in o.sequences] for o in again] == [[s.tokens for s in o.sequences] for o in first]
    check(again, PROMPTS, hf, params, set(llm.engine.eos_token_ids()))
    assert_engine_clean(llm)


def test_max_model_len_ends_the_search(model):
    """A prompt 3 tokens short of max_model_len searches 3 tokens, not max_tokens."""
    path, hf = model
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4, max_model_len=18)
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    out = llm.beam_search([PROMPTS[2]], params)[0]
    assert all(len(s.tokens) == 18 for s in out.sequences)
    check([out], [PROMPTS[2]], hf, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True), set())
    assert_engine_clean(llm)


def forced_logprobs(llm, prompt: list[int], path: list[int], params: BeamSearchParams) -> list[float]:
    """The logprob of each token of path (a beam's, under params) after prompt, decoded alone by the engine with no
    fork: each step's drawn token replaced by the path's (what a beam's own sequence does between steps)."""
    engine, got = llm.engine, []
    engine.add_request("forced", prompt, BeamSearch(engine, params).sampling, beam=True)
    (seq_id,) = engine.requests["forced"].seq_ids
    for token in path:
        engine.step()
        got.append(engine.seqs[seq_id].logprobs[-1][token].logprob)
        engine.set_last_token(seq_id, token)
    engine.abort_request("forced")
    return got


@pytest.mark.parametrize("index_topk, kv_cache_dtype", [(3, "auto"), (64, "auto"), (3, "fp4")])
def test_deepseek_v4_state_blocks_fork(tmp_path, index_topk, kv_cache_dtype):
    """V4: each fork copies the StateBlock (sliding window, compressor and indexer state) beside the partial block;
    the first prompt's beams cross compression windows. The beams are transformers' (vLLM's algorithm on its logits),
    and each beam's logprobs those its path gets decoded alone with no fork. With the indexer keeping every entry
    (index_topk 64) the logprobs are transformers' too; keeping 3, its top-k among exact-zero (ReLU) scores breaks
    ties by the score row's length, and a decode step's row differs from a whole-text forward's (up to ~5e-2 on
    this checkpoint, plain generate's too). fp4: the quantised pools' bytes and scales are copied as stored."""
    path = tmp_path / "v4"
    hf = make_checkpoint(path, seed=1, index_topk=index_topk)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    prompts = [prompt_of(21, 51), prompt_of(6, 52)]
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outs = llm.beam_search(prompts, params)
    eos = set(llm.engine.eos_token_ids())
    if index_topk == 64:
        check(outs, prompts, hf, params, eos)
    for out, prompt in zip(outs, prompts):
        if kv_cache_dtype == "auto":
            assert [s.tokens for s in out.sequences] == [w[0] for w in reference(hf, prompt, params, eos)]
        for seq in out.sequences:
            gen = seq.tokens[len(prompt):]
            want = forced_logprobs(llm, prompt, gen, params)
            assert [seq.logprobs[i][t].logprob for i, t in enumerate(gen)] == pytest.approx(want, abs=1e-5)
            assert seq.cum_logprob == pytest.approx(sum(want), abs=1e-5)
    assert_engine_clean(llm)


def test_a_failed_row_ends_only_its_beam(model, monkeypatch):
    """A beam whose row fails (non-finite logits: token -1) gives no continuations; the others carry the search to
    its end and the engine is left clean."""
    path, _ = model
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4)
    execute, calls = llm.engine._execute, []

    def failing(batch, states, *rest):
        out = execute(batch, states, *rest)
        calls.append(batch.seq_ids)
        if len(calls) == 3:  # the second decode step, three beams in it
            assert len(batch.seq_ids) == 3
            out.tokens = out.tokens.clone()
            out.tokens[1] = -1
        return out

    monkeypatch.setattr(llm.engine, "_execute", failing)
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0]
    assert len(out.sequences) == 3 and all(len(s.tokens) == len(PROMPTS[0]) + 5 for s in out.sequences)
    failed = calls[2][1]
    assert failed not in calls[3] and len(calls[3]) == 3
    assert_engine_clean(llm)


def test_bad_requests_are_refused(model):
    path, _ = model
    llm = LLM(path, dtype="float32", kv_cache_memory=32 << 20, block_size=4, max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="request 0: 3 beams"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=4))
    with pytest.raises(ValueError, match="request 1: prompt has 40 tokens"):
        llm.beam_search([PROMPTS[0], list(range(3, 43))], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], {"beam_width": 2})
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=4, temperature=-1.0)):
        with pytest.raises(ValueError, match="BeamSearchParams"):
            BeamSearchParams(**bad)
    assert_engine_clean(llm)
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(out[0].sequences) == 2
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(path, dtype="float32", kv_cache_memory=32 << 20, async_scheduling=True).beam_search(
            [PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))


def _scheduler(num_blocks=16, max_num_seqs=4):
    c = _C.SchedulerConfig()
    c.max_num_seqs, c.max_model_len, c.max_num_batched_tokens = max_num_seqs, 64, 64
    c.block_size, c.num_blocks, c.num_state_slots = 4, num_blocks, max_num_seqs
    return _C.Scheduler(c)


def test_scheduler_fork_shares_full_blocks_and_copies_the_partial_one():
    s = _scheduler()
    s.add_sequence(0, list(range(10, 16)), _C.SamplingLimits(8, 0, True, []))
    with pytest.raises(ValueError, match="not running"):
        s.fork(0, 1, 7)
    batch = s.schedule()
    s.process(batch, [20])  # 6 prompt tokens computed in blocks [b0 full, b1 partial]; token 20 drawn
    parent = s.sequence(0)
    src_block, dst_block, src_slot, dst_slot = s.fork(0, 1, 21)
    child = s.sequence(1)
    bm = s.block_manager
    assert list(child.token_ids) == list(range(10, 16)) + [21] and child.num_computed_tokens == 6
    assert child.block_table[0] == parent.block_table[0] and bm.ref_count(parent.block_table[0]) == 2
    assert (src_block, dst_block) == (parent.block_table[1], child.block_table[1]) and src_block != dst_block
    assert src_slot == parent.state_slot and dst_slot == child.state_slot != src_slot
    s.set_last_token(0, 22)
    assert s.sequence(0).token_ids[-1] == 22
    with pytest.raises(ValueError, match="already exists"):
        s.fork(0, 1, 23)
    s.check_invariants()
    batch = s.schedule()
    assert sorted(batch.seq_ids) == [0, 1]
    inputs = dict(zip(batch.seq_ids, batch.input_ids.tolist()))
    assert inputs == {0: 22, 1: 21}
    s.process(batch, [30, 31])
    s.finish(0, _C.FinishReason.ABORT)
    assert bm.ref_count(child.block_table[0]) == 1
    s.finish(1, _C.FinishReason.ABORT)
    s.check_invariants()
    assert bm.num_free_blocks == 16 and s.num_free_state_slots == 4


def test_scheduler_fork_needs_room():
    s = _scheduler(max_num_seqs=2)
    s.add_sequence(0, [1, 2, 3, 4, 5], _C.SamplingLimits(8, 0, True, []))
    s.process(s.schedule(), [9])
    s.fork(0, 1, 8)
    with pytest.raises(ValueError, match="no room to fork"):
        s.fork(0, 2, 7)
    s.check_invariants()
