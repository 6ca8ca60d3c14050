"""Tiny random checkpoints made with transformers' config classes (no hub), plus a small
trained tokenizer so text paths are exercised too."""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Measured GEMM plans and step-time curves go to a fresh folder: a test never reads a cache that an
# earlier run (or the user's engine) left behind.
os.environ["DEEPINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="deepinfer-test-cache-")

TINY_VOCAB = 256


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread (two threads spin against the other jobs on this shared box and
    run 10x slower). Modules opt in with pytestmark = pytest.mark.usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _save_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, stop here. the end",
              "paris is the capital of france", "one two three four five six seven eight nine ten"] * 50
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def tiny_experts_plan_label(llm=None) -> str | tuple[str, str]:
    """The tiny Qwen3-MoE's experts as the GEMM plan names them in llm's engine: packed or not, as the engine
    measured (their shapes are multiples of 16), or fp32 weights (an fp32 engine's); without llm every name (an
    engine in another process)."""
    import torch

    from deepinfer.layers.moe import FusedMoE
    names = ("experts H 64 2I 64 (packed)", "experts H 64 2I 64 (fp32 weights)", "experts H 64 2I 64")
    if llm is None:
        return names
    moe = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
    if any(m.packed for m in moe):
        return names[0]
    return names[1] if moe[0].gate_up_proj.dtype == torch.float32 else names[2]


def assert_logprobs_alike(got: list, want: list, abs_tol: float) -> None:
    """Two lists of per-position logprob entries ({token id: Logprob}, or None where nothing scored) alike: the same
    positions and tokens, ranks and decoded tokens, logprobs within abs_tol (a chunk, batch or kernel sums in its own
    order)."""
    import pytest

    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert (x is None) == (y is None) and (x is None or x.keys() == y.keys())
        for tok in x or {}:
            assert x[tok].rank == y[tok].rank and x[tok].decoded_token == y[tok].decoded_token
            assert x[tok].logprob == pytest.approx(y[tok].logprob, abs=abs_tol)


def our_kernel_path(dtype: torch.dtype, m: int, w: torch.Tensor, packed: bool = False) -> str:
    """A GemmPlan.linear_path that keeps every linear on our kernels (the fused halves need them): the exact ISA,
    or for weights the engine packed the kernel that reads them."""
    from deepinfer.layers import cpu_ops
    return f"cpu-{cpu_ops.PACKED_ISA if packed else cpu_ops.EXACT_ISA}"


def our_expert_paths(w13: torch.Tensor, w2: torch.Tensor, counts: list[int], packed: bool = False) -> tuple:
    """A GemmPlan.expert_paths that keeps every expert on our grouped kernel (the fused MoE half needs it), as
    our_kernel_path does for linears: on a loaded host the timed plan can pick torch for a tiny expert shape."""
    return our_kernel_path(torch.bfloat16, max(counts, default=0), w13, packed), []


def make_llama(path: str, **overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=TINY_VOCAB + 6, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    _save_tokenizer(path, TINY_VOCAB)
    return path


def make_qwen3_moe(path: str, **overrides) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=TINY_VOCAB + 6, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    # transformers initialises the router to zeros; random routers make routing matter.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    _save_tokenizer(path, TINY_VOCAB)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return make_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module (bound to 127.0.0.1), which engines join instead of each starting one;
    yields the ray module. 4 logical CPUs: engine actors take fractions of them."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield ray
    ray.shutdown()
