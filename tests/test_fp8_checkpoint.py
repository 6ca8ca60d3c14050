"""Block-scaled FP8 checkpoints, as DeepSeek releases them: `X.weight` in float8_e4m3fn plus `X.weight_scale_inv`
(or `X.scale`), one fp32 multiplier per block of `quantization_config.weight_block_size`. A tiny DeepSeek-V4
written that way with the reference block-scaling rule loads to exactly the weights of the same checkpoint
dequantised by hand, and generates transformers' tokens for them; bad scales are refused by name. The same
for DeepSeek-V4-Flash's FP4 routed experts (expert_dtype 'fp4')."""
import json
import shutil

import pytest
import torch

from deepinfer import LLM, SamplingParams
from test_deepseek_v4 import _rewrite_checkpoint, hf_greedy, make_checkpoint, prompt_of

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = (16, 24)  # the tiny model's matrices are 16-128 wide: several blocks each, ragged at the edges
FP8_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block=BLOCK):
    """Reference rule, per br x bc block: scale = amax / 448, q = fp8(w / scale) -> (q, scale_inv [nr, nc])."""
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, block[0], nc, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * block[0], nc * block[1])
    return q[:rows, :cols].contiguous(), scale


def dequantize_by_hand(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    rows, cols = q.shape
    full = scale[:, None, :, None].expand(-1, block[0], -1, block[1]).reshape(scale.shape[0] * block[0], -1)
    return q.float() * full[:rows, :cols]


def quantized(name: str, t: torch.Tensor) -> bool:
    """Linear weights are FP8 in DeepSeek's checkpoints; embeddings, the head and router gates are not."""
    return (t.dim() == 2 and name.endswith(".weight") and t.is_floating_point()
            and not any(x in name for x in ("embed", "head", ".gate.weight")))


# (which tensors, quantise, dequantise by hand): the first rule a tensor matches is applied
FP8_RULES = [(quantized, quantize_blocks, dequantize_by_hand)]


def stored(rules):
    """Checkpoint edit: each tensor a rule matches becomes its quantised form plus `_scale_inv`."""
    def edit(tensors: dict) -> dict:
        out = {}
        for name, t in tensors.items():
            rule = next((r for r in rules if r[0](name, t)), None)
            if rule is None:
                out[name] = t
            else:
                out[name], out[name + "_scale_inv"] = rule[1](t)
        return out
    return edit


def dequantized(rules):
    """Checkpoint edit: each tensor a rule matches becomes what its quantised form dequantises to."""
    def edit(tensors: dict) -> dict:
        rule_of = {n: next((r for r in rules if r[0](n, t)), None) for n, t in tensors.items()}
        return {n: t if rule_of[n] is None else rule_of[n][2](*rule_of[n][1](t)) for n, t in tensors.items()}
    return edit


def with_quant_config(path, **quant):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK), **quant}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def assert_loads_as(path, dequantized):
    """The checkpoint at path loads to exactly the parameters of the hand-dequantised one."""
    from deepinfer.models.loader import load_model

    ours = dict(load_model(str(path), torch.float32)[0].named_parameters())
    for name, p in load_model(str(dequantized), torch.float32)[0].named_parameters():
        assert torch.equal(ours[name], p), name


def assert_generates_transformers_tokens(path, hf):
    prompts = [prompt_of(9, 1), prompt_of(30, 2)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from transformers import DeepseekV4ForCausalLM as HF

    root = tmp_path_factory.mktemp("fp8")
    make_checkpoint(root / "bf", seed=11)
    fp8 = with_quant_config(_rewrite_checkpoint(root / "bf", root / "fp8", stored(FP8_RULES)))
    deq = _rewrite_checkpoint(root / "bf", root / "deq", dequantized(FP8_RULES))
    hf = HF.from_pretrained(str(deq), dtype=torch.float32).eval()
    return fp8, deq, hf


def test_fp8_weights_load_dequantised_by_their_block_scales(ckpts):
    from safetensors.torch import load_file

    fp8, deq, _ = ckpts
    stored = load_file(str(fp8 / "model.safetensors"))
    assert sum(t.dtype == torch.float8_e4m3fn for t in stored.values()) >= 20  # attention, experts, compressors
    assert_loads_as(fp8, deq)


def test_fp8_checkpoint_generates_transformers_tokens(ckpts):
    fp8, _, hf = ckpts
    assert_generates_transformers_tokens(fp8, hf)


def test_deepseek_inference_layout_scale_names(ckpts, tmp_path):
    """DeepSeek's own inference code names the scales `X.scale`."""
    fp8, deq, _ = ckpts
    renamed = _rewrite_checkpoint(fp8, tmp_path / "scale", lambda t: {
        (n[:-len("weight_scale_inv")] + "scale" if n.endswith("weight_scale_inv") else n): v for n, v in t.items()})
    assert_loads_as(renamed, deq)


def test_bad_fp8_checkpoints_are_refused_by_name(ckpts, tmp_path):
    from deepinfer.models.loader import load_model

    fp8, _, _ = ckpts
    name = "model.layers.1.attn.wq_a.weight"

    def bad_shape(t):
        t[name + "_scale_inv"] = t[name + "_scale_inv"][:, :1].contiguous()
        return t

    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight.*scales of shape"):
        load_model(str(_rewrite_checkpoint(fp8, tmp_path / "shape", bad_shape)), torch.float32)
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight.*FP8 but has no"):
        load_model(str(_rewrite_checkpoint(fp8, tmp_path / "missing",
                                           lambda t: {n: v for n, v in t.items() if n != name + "_scale_inv"})),
                   torch.float32)
    other = tmp_path / "awq"
    shutil.copytree(fp8, other)
    with pytest.raises(ValueError, match=r"quant_method 'awq'"):
        load_model(str(with_quant_config(other, quant_method="awq")), torch.float32)
    odd = tmp_path / "odd"
    shutil.copytree(fp8, odd)
    with pytest.raises(ValueError, match=r"weight_block_size \[0, 24\]"):
        load_model(str(with_quant_config(odd, weight_block_size=[0, 24])), torch.float32)


# ---- DeepSeek-V4-Flash's layout: routed experts in FP4 (int8 holding two E2M1 values, the first in the low
# nibble; one E8M0 scale per 32 values of a row), everything else quantised as above in FP8 ----------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def fp4_expert(name: str, t: torch.Tensor) -> bool:
    return ".ffn.experts." in name and name.endswith(".weight")


def quantize_fp4(w: torch.Tensor):
    """MX rule per 32 values: scale 2^(floor(log2 amax) - 2), values to the E2M1 grid -> (int8 [R, C/2], E8M0)."""
    from deepinfer.formats.fp4 import quantize_mxfp4

    packed, exponents = quantize_mxfp4(w.float())
    return packed.view(torch.int8), exponents.view(torch.float8_e8m0fnu)


def dequantize_fp4_by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u8 = packed.view(torch.uint8).long()
    values = torch.stack([E2M1[u8 & 15], E2M1[u8 >> 4]], dim=-1).flatten(-2)
    return values * scale.float().repeat_interleave(32, dim=-1)


FLASH_RULES = [(fp4_expert, quantize_fp4, dequantize_fp4_by_hand)] + FP8_RULES


@pytest.fixture(scope="module")
def flash(tmp_path_factory, ckpts):
    from transformers import DeepseekV4ForCausalLM as HF

    root = tmp_path_factory.mktemp("flash")
    bf = ckpts[0].parent / "bf"
    fp4 = with_quant_config(_rewrite_checkpoint(bf, root / "fp4", stored(FLASH_RULES)), expert_dtype="fp4")
    deq = _rewrite_checkpoint(bf, root / "deq", dequantized(FLASH_RULES))
    return fp4, deq, HF.from_pretrained(str(deq), dtype=torch.float32).eval()


def test_fp4_experts_load_dequantised_and_generate_transformers_tokens(flash):
    from safetensors.torch import load_file

    fp4, deq, hf = flash
    stored = load_file(str(fp4 / "model.safetensors"))
    assert sum(t.dtype == torch.int8 for t in stored.values()) == 4 * 6 * 3  # every layer's routed experts
    assert_loads_as(fp4, deq)
    assert_generates_transformers_tokens(fp4, hf)


def test_bad_fp4_experts_are_refused_by_name(flash, tmp_path):
    from deepinfer.models.loader import load_model

    fp4, _, _ = flash
    name = "model.layers.1.ffn.experts.0.w1.weight"
    undeclared = tmp_path / "undeclared"
    shutil.copytree(fp4, undeclared)
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*int8 with scales.*expert_dtype 'fp4'"):
        load_model(str(with_quant_config(undeclared)), torch.float32)

    def bad_shape(t):
        t[name + "_scale_inv"] = t[name + "_scale_inv"][:, :1].contiguous()
        return t

    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*FP4 weight .* one per 32"):
        load_model(str(_rewrite_checkpoint(fp4, tmp_path / "shape", bad_shape)), torch.float32)
