"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on tiny random checkpoints (fp32), driven
through the model protocol with pools allocated from its CacheSpec and metadata built by hand."""
import random

import pytest
import torch

from deepinfer.layers.attention_metadata import AttentionMetadata
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two threads spin against the other jobs on this shared box and
    run 10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    # lengths: shorter than the window (8), one HCA window (16) plus a partial one, several of both
    path, hf = ckpt
    prompts = [prompt_of(5, 1), prompt_of(37, 2), prompt_of(70, 3), prompt_of(19, 4)]
    n_new = 20  # crosses CSA windows (4), HCA windows (16) and blocks (16) while decoding
    ours = run_schedule(load_ours(path), prompts, n_new, admit_late=(3,), chunks={2: 45})
    for p, got in zip(prompts, ours):
        assert got == hf_greedy(hf, p, n_new)
