"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on tiny random checkpoints (fp32), driven
through the model protocol with pools allocated from its CacheSpec and metadata built by hand."""
import random

import pytest
import torch
import torch.nn.functional as F

from deepinfer.formats.cache_spec import CacheTensor
from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides):
    from transformers import DeepseekV4Config

    kw = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5,
              num_experts_per_tok=2, n_routed_experts=6, o_groups=2, o_lora_rank=16,
              index_n_heads=4, index_head_dim=32, index_topk=3, sliding_window=8,
              layer_types=[SWA, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16},
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20,
              num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, max_position_embeddings=4096)
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomize_(model, seed=0):
    """Non-trivial values everywhere transformers initialises to zeros/ones: sinks, position biases,
    hyper-connection bases and scales, router correction biases, a non-zero tid2eid table."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "hc" not in name.split(".")[-2:][0] and not name.endswith(("fn", "position_bias")):
            p.data.normal_(0, p.shape[-1] ** -0.5, generator=g)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            p.data = 1 + 0.2 * torch.randn(p.shape, generator=g)
        else:
            p.data.normal_(0, 0.5, generator=g)
    model.model.embed_tokens.weight.data.normal_(0, 1, generator=g)
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def make_checkpoint(path, seed=0, **overrides):
    from transformers import DeepseekV4ForCausalLM as HF

    torch.manual_seed(seed)
    hf = HF(tiny_config(**overrides)).float().eval()
    randomize_(hf, seed)
    hf.save_pretrained(path)
    return hf


def load_ours(path, dtype=torch.float32):
    from deepinfer.models.loader import load_model

    model, _ = load_model(str(path), dtype)
    return model


class Driver:
    """Hands out shuffled blocks and state slots, builds AttentionMetadata, runs prefill/decode steps."""

    def __init__(self, model, block_size=16, num_blocks=64, num_slots=4, kv_cache_dtype="auto", seed=0):
        self.model, self.block_size = model, block_size
        spec = model.cache_spec(block_size, kv_cache_dtype)
        g = torch.Generator().manual_seed(seed)
        self.paged = {n: torch.zeros(num_blocks, *t.shape, dtype=t.dtype) for n, t in spec.paged.items()}
        # stale garbage in every state slot: the model must never read a row it has not written
        self.state = {n: 100 * torch.randn(num_slots, *t.shape, generator=g).to(t.dtype) for n, t in spec.state.items()}
        model.bind_cache(self.paged, self.state)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.free_slots = list(range(num_slots))[::-1]
        self.seqs = {}

    def add(self, sid, tokens):
        self.seqs[sid] = {"tokens": list(tokens), "blocks": [], "slot": self.free_slots.pop(), "cached": 0}

    def drop(self, sid):
        s = self.seqs.pop(sid)
        self.free_blocks += s["blocks"]
        self.free_slots.append(s["slot"])

    def _meta(self, sids, prefill):
        positions, qsl, ctxs, tables, slots = [], [0], [], [], []
        for sid in sids:
            s = self.seqs[sid]
            ctx = len(s["tokens"])
            while len(s["blocks"]) * self.block_size < ctx:
                s["blocks"].append(self.free_blocks.pop())
            positions += range(s["cached"], ctx)
            qsl.append(qsl[-1] + ctx - s["cached"])
            ctxs.append(ctx)
            slots.append(s["slot"])
            tables.append(s["blocks"])
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
        pos = torch.tensor(positions)
        return AttentionMetadata(is_prefill=prefill, positions=pos, slot_mapping=torch.zeros_like(pos),
                                 query_start_loc=torch.tensor(qsl), context_lens=torch.tensor(ctxs),
                                 block_tables=bt, state_slots=torch.tensor(slots), block_size=self.block_size,
                                 max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])), max_context_len=max(ctxs))

    def step(self, sids, prefill):
        """Runs every not-yet-cached token of sids; returns last-token logits [B, V]."""
        meta = self._meta(sids, prefill)
        ids = torch.tensor([t for sid in sids for t in self.seqs[sid]["tokens"][self.seqs[sid]["cached"]:]])
        hidden = self.model(ids, meta)
        for sid in sids:
            self.seqs[sid]["cached"] = len(self.seqs[sid]["tokens"])
        return self.model.compute_logits(hidden[meta.last_token_indices])

    def greedy(self, sids, logits):
        for sid, row in zip(sids, logits):
            self.seqs[sid]["tokens"].append(int(row.argmax()))


def hf_greedy(hf, prompt, n):
    """transformers' greedy generate, EOS not special (the engine side runs with ignore_eos)."""
    hf.generation_config.eos_token_id = None  # min_new_tokens would instead forbid EOS: a different rule
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_schedule(model, prompts, n_new, admit_late=(), block_size=16, kv_cache_dtype="auto", chunks=None):
    """Greedy-decodes every prompt to n_new tokens. Prompts not in admit_late prefill together first;
    the late ones are admitted (prefilled) after a few decode steps of the others. chunks: {i: first chunk
    length} prefills prompt i in two steps."""
    d = Driver(model, block_size=block_size, num_slots=len(prompts) + 1, kv_cache_dtype=kv_cache_dtype)
    chunks = chunks or {}

    def admit(ids):
        for i in ids:
            d.add(i, prompts[i][: chunks.get(i, len(prompts[i]))])
        first = [i for i in ids if i in chunks]
        if first:
            d.step(first, True)
            for i in first:
                d.seqs[i]["tokens"] = list(prompts[i])
        d.greedy(ids, d.step(ids, True))

    early = [i for i in range(len(prompts)) if i not in admit_late]
    admit(early)
    running, step = list(early), 0
    while True:
        if step == 3 and admit_late:
            admit(list(admit_late))
            running += list(admit_late)
        live = [i for i in running if len(d.seqs[i]["tokens"]) < len(prompts[i]) + n_new]
        if not live:
            break
        d.greedy(live, d.step(live, False))
        step += 1
    return [d.seqs[i]["tokens"][len(prompts[i]):] for i in range(len(prompts))]


def prompt_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 96, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4") / "tiny"
    hf = make_checkpoint(path)
    return path, hf


def test_greedy_matches_transformers_batched_and_late_admission(ckpt):
    # lengths: shorter than the window (8), one HCA window (16) plus a partial one, several of both,
    # exactly two HCA windows (nothing left unfinished), and shorter than a CSA window (4)
    path, hf = ckpt
    prompts = [prompt_of(5, 1), prompt_of(37, 2), prompt_of(70, 3), prompt_of(19, 4), prompt_of(32, 6),
               prompt_of(2, 7)]
    n_new = 20  # crosses CSA windows (4), HCA windows (16) and blocks (16) while decoding
    ours = run_schedule(load_ours(path), prompts, n_new, admit_late=(3,), chunks={2: 45, 4: 16})
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, n_new)


def replay_deviation(model, prompt, replay_tokens, n=32):
    """Exact state vs the state rebuilt by replay_swa_state from the last R tokens, on one sequence whose
    prompt is in the pools. Returns (R used, max |logit error| teacher-forced over n decode steps, mean of
    it, greedy agreement of the free-running continuations over n tokens)."""
    d = Driver(model)
    d.add(0, prompt)
    first = d.step([0], True)[0]
    snap_paged = {k: v.clone() for k, v in d.paged.items()}
    exact_logits, exact_tokens = [], [int(first.argmax())]
    for _ in range(n):
        d.seqs[0]["tokens"].append(exact_tokens[-1])
        exact_logits.append(d.step([0], False)[0])
        exact_tokens.append(int(exact_logits[-1].argmax()))

    def rebuilt():
        for k, v in snap_paged.items():
            d.paged[k].copy_(v)
        slot = d.seqs[0]["slot"]
        for t in d.state.values():  # the StateBlock is gone: fill it with garbage
            t[slot] = 1e3
        table = torch.tensor(d.seqs[0]["blocks"])
        R = model.replay_swa_state(torch.tensor(prompt), len(prompt), table, slot, replay_tokens)
        d.seqs[0]["tokens"], d.seqs[0]["cached"] = list(prompt), len(prompt)
        return R

    R = rebuilt()
    errs = []
    for j in range(n):  # teacher-forced on the exact tokens
        d.seqs[0]["tokens"].append(exact_tokens[j])
        errs.append((d.step([0], False)[0] - exact_logits[j]).abs().max())
    rebuilt()
    free = [exact_tokens[0]]
    for _ in range(n):
        d.seqs[0]["tokens"].append(free[-1])
        free.append(int(d.step([0], False)[0].argmax()))
    agree = sum(a == b for a, b in zip(free[1:], exact_tokens[1:])) / n
    errs = torch.stack(errs)
    return R, float(errs.max()), float(errs.mean()), agree


CONFIG_B = dict(  # sigmoid routing, 2 streams, window 6, rates 2 / 8, YaRN compress rope, HCA first
    scoring_func="sigmoid", hc_mult=2, sliding_window=6, num_hidden_layers=5,
    layer_types=[HCA, CSA, SWA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={CSA: 2, HCA: 8}, index_topk=5, index_n_heads=2, routed_scaling_factor=2.5, swiglu_limit=1.5,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1})


def test_greedy_matches_transformers_sigmoid_yarn_small_blocks(tmp_path):
    hf = make_checkpoint(tmp_path / "b", seed=5, **CONFIG_B)
    prompts = [prompt_of(3, 11), prompt_of(29, 12), prompt_of(50, 13)]
    ours = run_schedule(load_ours(tmp_path / "b"), prompts, 16, block_size=8, admit_late=(0,))
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, 16)


def test_preempted_sequence_recomputes_into_stale_blocks_and_slot(ckpt):
    """A sequence dropped mid-decode and re-prefilled from position 0 (into another sequence's freed
    blocks and stale state slot) continues exactly as an uninterrupted run."""
    path, hf = ckpt
    model = load_ours(path)
    a, b = prompt_of(33, 21), prompt_of(26, 22)
    d = Driver(model)
    d.add("a", a)
    d.add("b", b)
    d.greedy(["a", "b"], d.step(["a", "b"], True))
    for _ in range(6):
        d.greedy(["a", "b"], d.step(["a", "b"], False))
    a_tokens = d.seqs["a"]["tokens"]
    d.drop("a")
    d.drop("b")  # b's slot and blocks are handed out next, full of b's data
    d.add("a", a_tokens)
    d.greedy(["a"], d.step(["a"], True))
    for _ in range(7):
        d.greedy(["a"], d.step(["a"], False))
    assert d.seqs["a"]["tokens"][len(a):] == hf_greedy(hf, a, 15)


def teacher_forced_logits(model, prompts, tokens, kv_cache_dtype):
    d = Driver(model, kv_cache_dtype=kv_cache_dtype)
    ids = list(range(len(prompts)))
    for i, p in enumerate(prompts):
        d.add(i, p)
    out = [d.step(ids, True)]
    for j in range(len(tokens[0])):
        for i in ids:
            d.seqs[i]["tokens"].append(tokens[i][j])
        out.append(d.step(ids, False))
    return torch.stack(out)  # [steps, B, V]


QUANT_BOUNDS = {"fp8": (1.5, 0.1, 0.8), "fp4": (2.0, 0.2, 0.7), "fp4_all": (2.5, 0.3, 0.6)}


@pytest.mark.parametrize("kv_cache_dtype", list(QUANT_BOUNDS))
def test_quantised_kv_cache(ckpt, monkeypatch, kv_cache_dtype):
    """Quantised pools give exactly the exact pools' logits with every entry and ring row passed through
    quantise / dequantise on write (the plumbing), and stay close to the exact run. On this tiny random model
    (head_dim 32, logit std 1.05) over 51 teacher-forced positions, measured max |dlogit| / mean / argmax
    agreement: fp8 0.96 / 0.06 / 90%, fp4 0.99 / 0.11 / 84%, fp4_all 1.58 / 0.16 / 71%; QUANT_BOUNDS bound
    them. FP8's max error is not much below FP4's: a perturbed indexer key can flip which entries a query's
    top-k keeps, a discrete jump on a model this small (index_topk 3)."""
    from deepinfer.models.deepseek_v4 import KV_CACHE_FORMATS
    from deepinfer.layers import v4_attention

    path, _ = ckpt
    model = load_ours(path)
    prompts = [prompt_of(37, 2), prompt_of(70, 3), prompt_of(130, 5)]
    tokens = [t[:16] for t in run_schedule(model, prompts, 16)]
    exact = teacher_forced_logits(model, prompts, tokens, "auto")
    quant = teacher_forced_logits(model, prompts, tokens, kv_cache_dtype)
    err = (exact - quant).abs()
    agree = (exact.argmax(-1) == quant.argmax(-1)).float().mean()
    print(f"{kv_cache_dtype} vs exact: max |dlogit| {err.max():.3f}, mean {err.mean():.3f}, argmax agreement {agree:.2f}")
    max_err, mean_err, min_agree = QUANT_BOUNDS[kv_cache_dtype]
    assert err.max() < max_err and err.mean() < mean_err and agree >= min_agree

    # the exact run again, each pool tagged with the format kv_cache_dtype gives it and rounding through it
    main_fmt, index_fmt, ring_fmt = KV_CACHE_FORMATS[kv_cache_dtype]
    EntryPool, bind = v4_attention.EntryPool, model.bind_cache

    def simulated(pool, values):
        return EntryPool(pool.data, None, pool.sim, values.dtype).roundtrip(values) if hasattr(pool, "sim") else values

    def tagging_bind(paged, state):
        bind(paged, state)
        for layer in model.model.layers:
            layer.self_attn.ring.sim = ring_fmt
            if layer.self_attn.compressor is not None:
                layer.self_attn.compressor.pool.sim = main_fmt
                if layer.self_attn.indexer is not None:
                    layer.self_attn.indexer.pool.sim = index_fmt

    write, roundtrip = EntryPool.write, EntryPool.roundtrip
    monkeypatch.setattr(EntryPool, "write", lambda self, rows, values: write(self, rows, simulated(self, values)))
    monkeypatch.setattr(EntryPool, "roundtrip", lambda self, values: roundtrip(self, simulated(self, values)))
    monkeypatch.setattr(model, "bind_cache", tagging_bind)
    torch.testing.assert_close(teacher_forced_logits(model, prompts, tokens, "auto"), quant, rtol=0, atol=1e-5)


def test_swa_bounded_replay_deviation(ckpt):
    """replay_swa_state rebuilds the StateBlock from the last R tokens. Measured on this 4-layer model
    (window 8, prompt 100): R=8 (default: window + drafts): max |dlogit| 0.96, mean 0.18, greedy agreement
    3% over 32 tokens; R=16: 0.058 / 0.006 / 100%; R=24: 0.0019 / 0.00017 / 100%; R=32 (layers x window):
    exact to fp32 rounding. The error shrinks with R; a full replay is exact."""
    path, _ = ckpt
    model = load_ours(path)
    prompt = prompt_of(100, 7)
    results = {R: replay_deviation(model, prompt, R) for R in (None, 16, 24, 100)}
    for R, (used, mx, mean, agree) in results.items():
        print(f"replay R={used}: max |dlogit| {mx:.4f}, mean {mean:.5f}, greedy agreement {agree:.2f}")
    assert results[None][0] == model.config.sliding_window  # default R: window + drafts (no drafts here)
    assert results[100][1] < 1e-4 and results[100][3] == 1.0  # full replay == exact state
    assert results[16][1] < results[None][1] and results[24][1] < results[16][1]
    assert results[24][1] < 0.05 and results[24][3] == 1.0


def _rewrite_checkpoint(src, dst, edit):
    """Copy of checkpoint src with its tensors passed through edit(dict) -> dict."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_name_the_tensor(ckpt, tmp_path):
    path, _ = ckpt

    def drop(t):
        del t["model.layers.1.attn.indexer.compressor.ape"]
        return t

    with pytest.raises(ValueError, match=r"missing.*compressor\.indexer\.position_bias"):
        load_ours(_rewrite_checkpoint(path, tmp_path / "missing", drop))

    def reshape(t):
        t["model.layers.2.attn.compressor.wkv.weight"] = t["model.layers.2.attn.compressor.wkv.weight"][:-1]
        return t

    with pytest.raises(ValueError, match=r"layers\.2\.attn\.compressor\.wkv\.weight.*shape"):
        load_ours(_rewrite_checkpoint(path, tmp_path / "shape", reshape))

    def extra(t):
        t["model.layers.0.attn.indexer.wq_b.weight"] = torch.zeros(4, 4)  # layer 0 is sliding: no indexer
        return t

    with pytest.raises(ValueError, match=r"unexpected.*layers\.0\.attn\.indexer\.wq_b\.weight"):
        load_ours(_rewrite_checkpoint(path, tmp_path / "extra", extra))

    def mtp(t):
        t["mtp.0.enorm.weight"] = torch.ones(64)
        t["mtp.1.enorm.weight"] = torch.ones(64)  # num_nextn_predict_layers is 1
        return t

    with pytest.raises(ValueError, match=r"mtp\.1\.enorm\.weight"):
        load_ours(_rewrite_checkpoint(path, tmp_path / "mtp", mtp))


def test_a_partial_mtp_layer_is_refused(ckpt, tmp_path):
    """MTP tensors are optional (transformers saves none), but once a checkpoint has some it needs all
    (tests/test_spec_mtp.py loads and runs a complete one)."""
    path, _ = ckpt
    partial = _rewrite_checkpoint(path, tmp_path / "mtp", lambda t: {**t, "mtp.0.enorm.weight": torch.randn(64)})
    with pytest.raises(ValueError, match=r"missing tensors.*0\.(hnorm|e_proj|h_proj|block)"):
        load_ours(partial)


def test_bad_configs_name_the_key(ckpt, tmp_path):
    import json
    import shutil

    path, _ = ckpt
    bad = tmp_path / "bad_type"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["layer_types"][1] = "linear_attention"
    (bad / "config.json").write_text(json.dumps(cfg))
    # transformers' config validation rejects it first (StrictDataclassClassValidationError, not a
    # ValueError), naming the key and the value
    with pytest.raises(Exception, match=r"layer_types.*linear_attention"):
        load_ours(bad)
    # configs that get past transformers' own checks
    cfg = tiny_config()
    cfg.layer_types = [SWA, "full_attention", HCA, CSA]
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'full_attention'"):
        DeepseekV4ForCausalLM(cfg)
    cfg = tiny_config(compress_rates={CSA: 0, HCA: 16})
    with pytest.raises(ValueError, match=r"compress_rates\['compressed_sparse_attention'\] = 0"):
        DeepseekV4ForCausalLM(cfg)
    cfg = tiny_config(compress_rates={CSA: 4, HCA: 12})
    model = DeepseekV4ForCausalLM(cfg)
    assert model.block_size_multiple == 12
    with pytest.raises(ValueError, match=r"block_size 16 cannot hold whole compression windows.*multiple of 12"):
        model.cache_spec(16)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        model.cache_spec(24, "int8")
    model = DeepseekV4ForCausalLM(tiny_config(head_dim=40))  # NVFP4 needs widths in blocks of 16
    with pytest.raises(ValueError, match=r"'fp4_all' stores layers\.0\.swa_ring as nvfp4 in blocks of 16.* width 40"):
        model.cache_spec(16, "fp4_all")
    assert model.cache_spec(16, "fp8").state["layers.0.swa_ring"] == CacheTensor((9, 40), torch.uint8)
    with pytest.raises(ValueError, match=r"fp4.*layers\.1\.csa_kv as nvfp4.*width 24"):
        DeepseekV4ForCausalLM(tiny_config(head_dim=24)).cache_spec(16, "fp4")


def test_cache_spec_layout_and_memory_plan():
    from deepinfer.models.deepseek_v4 import bytes_per_token_by_layer_type

    model = DeepseekV4ForCausalLM(tiny_config())
    model.max_backtracking = 3  # two draft tokens
    exact, quant = model.cache_spec(32), model.cache_spec(32, "fp4")
    assert set(exact.paged) == {"layers.1.csa_kv", "layers.1.indexer_k", "layers.2.hca_kv",
                                "layers.3.csa_kv", "layers.3.indexer_k"}
    assert exact.paged["layers.1.csa_kv"].shape == (8, 32)  # 32 tokens / rate 4, head_dim
    assert exact.paged["layers.2.hca_kv"].shape == (2, 32)  # 32 tokens / rate 16
    assert exact.state["layers.0.swa_ring"].shape == (8 + 3, 32)  # window + max_backtracking
    # raw rings: 2 windows of rate 4 (Ca of the previous, the current) + max_backtracking, Ca|Cb wide
    assert exact.state["layers.1.csa_kv_ring"].shape == (2 * 4 + 3, 2 * 32)
    assert exact.state["layers.1.idx_gate_ring"].shape == (2 * 4 + 3, 2 * 32)
    # online softmax (max, sum, weighted sum) after each of the last max_backtracking positions
    assert exact.state["layers.2.hca_acc"] == CacheTensor((3, 3, 32), torch.float32)
    # 4 SWA rings, 2 CSA layers x (main, indexer) x (kv, gate) rings, 1 HCA accumulator ring; all fp32
    assert exact.bytes_per_state_block == 4 * (4 * 11 * 32 + 2 * 2 * 2 * 11 * 64 + 3 * 3 * 32)
    assert quant.paged["layers.1.csa_kv"].shape == (8, 16) and quant.paged["layers.1.csa_kv_scale"].shape == (8, 2)
    assert quant.paged["layers.1.indexer_k_scale"].shape == (8, 1)
    # 'fp4': the SWA ring in FP8 (E4M3 bytes + an fp32 scale per row); the compression rings stay exact
    ring_fp8 = {"layers.0.swa_ring": CacheTensor((11, 32), torch.uint8),
                "layers.0.swa_ring_scale": CacheTensor((11, 1), torch.float32)}
    assert {n: t for n, t in quant.state.items() if n.startswith("layers.0.")} == ring_fp8
    assert {n: t for n, t in quant.state.items() if "swa_ring" not in n} == \
        {n: t for n, t in exact.state.items() if "swa_ring" not in n}
    fp8, fp4_all = model.cache_spec(32, "fp8"), model.cache_spec(32, "fp4_all")
    assert fp8.paged["layers.1.csa_kv"] == CacheTensor((8, 32), torch.uint8)
    assert fp8.paged["layers.1.indexer_k_scale"] == CacheTensor((8, 1), torch.float32)
    assert {n: t for n, t in fp8.state.items() if n.startswith("layers.0.")} == ring_fp8
    assert fp4_all.paged == quant.paged
    assert fp4_all.state["layers.0.swa_ring_scale"] == CacheTensor((11, 2), torch.uint8)  # NVFP4: per 16
    sizes = [spec.bytes_per_state_block for spec in (exact, fp8, quant, fp4_all)]
    assert sizes[0] > sizes[1] == sizes[2] > sizes[3]
    per_type = bytes_per_token_by_layer_type(exact, 32)
    assert per_type == {SWA: 0.0, CSA: (8 * 32 + 8 * 32) * 4 / 32, HCA: 2 * 32 * 4 / 32}
    per_type_fp4 = bytes_per_token_by_layer_type(quant, 32)
    assert per_type_fp4[CSA] == (8 * (16 + 2) + 8 * (16 + 1)) / 32
    assert exact.bytes_per_block / quant.bytes_per_block > 7
    lines = model.memory_plan_lines(fp4_all, 32)  # the plan names the formats of the last cache_spec()
    assert any("compressed_sparse_attention: 2 layers" in line for line in lines)
    assert "compressed main KV nvfp4, indexer keys mxfp4, SWA ring nvfp4" in lines[0]
    ring_bytes = 4 * 11 * (16 + 2)
    assert f"SWA rings of 11 tokens {ring_bytes} B + compression accumulators {sizes[3] - ring_bytes} B" in lines[-1]


def test_routing_softmax_and_grouped_experts_match_per_token_loop():
    """softmax scoring (which transformers' V4 cannot instantiate) and the expert grouping, against a
    plain per-token reference (the shared expert included)."""
    from deepinfer.models.deepseek_v4 import MoE

    def expert(w13, w2, x):
        gate, up = (w13 @ x).chunk(2)
        return w2 @ (F.silu(gate.clamp(max=0.7)) * up.clamp(-0.7, 0.7))

    cfg = tiny_config(scoring_func="softmax", swiglu_limit=0.7)
    moe = MoE(cfg, is_hash=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    for p in moe.parameters():
        p.data.normal_(0, 0.5, generator=g)
    x = torch.randn(9, cfg.hidden_size, generator=g)
    got = moe(x, torch.zeros(9, dtype=torch.long))
    ref = []
    for t in range(9):
        probs = torch.softmax(moe.gate.weight @ x[t], dim=-1)
        ids = torch.topk(probs + moe.gate.e_score_correction_bias, cfg.num_experts_per_tok).indices
        w = probs[ids] / probs[ids].sum() * cfg.routed_scaling_factor
        y = expert(moe.shared_experts.gate_up_proj[0], moe.shared_experts.down_proj[0], x[t])
        for e, we in zip(ids, w):
            y = y + we * expert(moe.experts.gate_up_proj[e], moe.experts.down_proj[e], x[t])
        ref.append(y)
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(ckpt):
    """bf16 weights run through the C++ kernel (fp32 accumulation) and fp32 attention, against the fp32
    reference over the last logits of four prompts. One prompt's max |dlogit| moves by 1.5x with the thread
    counts (a bf16 rounding flipped early cascades), so the bound is on all four: measured on Zen 4 over
    every torch / kernel thread count of 1 and 2, ours RMS 0.0183 and max 0.055-0.073, transformers' bf16
    RMS 0.0165 and max 0.057."""
    from transformers import DeepseekV4ForCausalLM as HF

    path, hf32 = ckpt
    hf16 = HF.from_pretrained(path, dtype=torch.bfloat16)
    ours, theirs = [], []
    for prompt in (prompt_of(70, 3), prompt_of(37, 2), prompt_of(19, 4), prompt_of(45, 5)):
        with torch.no_grad():
            ref = hf32(torch.tensor([prompt])).logits[0, -1].float()
            theirs.append(hf16(torch.tensor([prompt])).logits[0, -1].float() - ref)
        d = Driver(load_ours(path, torch.bfloat16))
        d.add(0, prompt)
        ours.append(d.step([0], True)[0] - ref)
    ours, theirs = torch.stack(ours), torch.stack(theirs)
    assert ours.pow(2).mean().sqrt() <= 1.25 * theirs.pow(2).mean().sqrt()
    assert ours.abs().max() <= 1.5 * theirs.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hyper_connection_matches_transformers_modules(dtype):
    """The C++ mHC kernels against transformers' DeepseekV4HyperConnection and its decoder layer's merge,
    over 19 tokens (two full chunks of 8 and a ragged one): fp32 to rounding, bf16 to one bf16 step."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from deepinfer.layers.hyper_connection import HyperConnection, hc_merge

    cfg = tiny_config()
    g = torch.Generator().manual_seed(3)
    ref = DeepseekV4HyperConnection(cfg)
    for p in ref.parameters():
        p.data = torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 2 else 0.5)
    ours = HyperConnection(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    streams = torch.randn(1, 19, cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
    block_out = torch.randn(1, 19, cfg.hidden_size, generator=g).to(dtype)
    with torch.no_grad():
        post_r, comb_r, coll_r = ref(streams)
        merged_r = post_r.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb_r.to(dtype).transpose(-1, -2), streams)
    post, comb, coll = ours(streams[0])
    torch.testing.assert_close(post, post_r[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_r[0], rtol=1e-5, atol=1e-6)
    step = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # bf16 keeps 8 significant bits
    torch.testing.assert_close(coll.float(), coll_r[0].float(), rtol=step, atol=1e-5)
    merged = hc_merge(block_out[0], streams[0], post_r[0], comb_r[0])
    torch.testing.assert_close(merged.float(), merged_r[0].float(), rtol=step, atol=1e-5)
    assert merged.dtype == coll.dtype == dtype


def test_input_projections_share_one_fused_weight(ckpt):
    """After loading, every attention layer's projections of the block input (q_a, kv, compressor and
    indexer kv / gate, indexer head weights) are views of one fused weight, holding the checkpoint's values."""
    path, hf = ckpt
    model = load_ours(path)
    kinds = set()
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        attn = ours.self_attn
        fused, mods = attn.input_weight, attn.input_projections()
        kinds.add(len(mods))
        assert fused.shape[0] == sum(m.weight.shape[0] for m in mods)
        for m in mods:
            assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert torch.equal(attn.q_a_proj.weight, theirs.self_attn.q_a_proj.weight)
        assert torch.equal(attn.kv_proj.weight, theirs.self_attn.kv_proj.weight)
    assert kinds == {2, 4, 7}  # sliding, HCA, CSA


def test_bench_weight_reads_count_the_touched_experts(ckpt):
    """examples/bench_v4.py's floor: bytes a step reads = all non-expert weights (no embedding, hash
    table or MTP) + each distinct routed expert its tokens went to, counted per step."""
    from examples.bench_v4 import WeightReads

    model = load_ours(ckpt[0])
    reads = WeightReads(model)
    experts = model.model.layers[0].mlp.experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 4
    dense = sum(p.numel() * 4 for n, p in model.named_parameters()
                if ".experts." not in n and "embed_tokens" not in n and "tid2eid" not in n)
    assert (reads.dense, reads.expert_bytes) == (dense, per_expert)
    x = torch.randn(3, experts.gate_up_proj.shape[2])
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]])
    experts(x, ids, torch.ones(3, 2))
    model.model.layers[1].mlp.experts(x[:1], ids[:1], torch.ones(1, 2))
    nbytes, flops = reads.take(tokens=3)
    assert nbytes == dense + (3 + 2) * per_expert
    assert flops == 2 * 3 * (dense / 4 + len(reads.experts) * 2 * per_expert / 4)
    assert reads.take(tokens=1)[0] == dense  # counts restart every step
