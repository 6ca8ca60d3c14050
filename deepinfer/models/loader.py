"""Model directories and files: Hugging Face format (config.json + safetensors) and GGUF
(dequantised through the `gguf` package). Every failure names the file at fault."""
import glob
import hashlib
import json
import os
from typing import Iterator

import numpy as np
import torch

from deepinfer.formats import fp4
from deepinfer.models import get_model_class


def load_model(path: str, dtype: torch.dtype):
    """path: an HF model directory, a .gguf file, or a directory holding one .gguf file.
    Returns (model in eval mode with weights loaded, hf_config)."""
    gguf_file = find_gguf(path)
    # Parsing a GGUF header (its token list) takes seconds: read it once for config and weights.
    reader = _gguf_reader(gguf_file) if gguf_file else None
    hf_config = gguf_config(gguf_file, reader) if gguf_file else hf_dir_config(path)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{path}: config has no 'architectures' entry")
    model = get_model_class(archs[0])(hf_config, dtype)
    weights = gguf_weights(gguf_file, hf_config, reader) if gguf_file else \
        safetensors_weights(path, fp8_block_size(hf_config, path), fp4_experts(hf_config))
    with torch.no_grad():
        model.load_weights(weights)
    return model.eval(), hf_config


def find_gguf(path: str) -> str | None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file; pass a model directory")
        return path
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) != 1:
        raise FileNotFoundError(f"{path!r} has no config.json and {len(found)} .gguf files (need exactly one)")
    return found[0]


def hf_dir_config(path: str):
    from transformers import AutoConfig

    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            json.load(f)
        return AutoConfig.from_pretrained(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # transformers raises its own (non-ValueError) classes for bad fields
        raise ValueError(f"{config_path}: cannot parse model config: {e}") from e


def fp8_block_size(hf_config, path: str) -> tuple[int, int]:
    """The (rows, cols) block of an FP8 checkpoint's weight scales: DeepSeek's `quantization_config`
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}), or 128 x 128 where there is none."""
    q = _quantization_config(hf_config)
    if q is None:
        return (128, 128)
    if q.get("quant_method") != "fp8":
        raise ValueError(f"{path}: quantization_config quant_method {q.get('quant_method')!r} is not supported "
                         "(block-scaled 'fp8' is)")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{path}: quantization_config weight_block_size {block!r} must be two positive integers")
    return tuple(block)


def fp4_experts(hf_config) -> bool:
    """Whether int8 weights with scales are FP4-packed experts: DeepSeek-V4 declares expert_dtype 'fp4' in
    its quantization_config (V4.1's place; transformers moves V4's top-level field there too)."""
    q = _quantization_config(hf_config) or {}
    return (q.get("expert_dtype") or getattr(hf_config, "expert_dtype", None)) == "fp4"


def _quantization_config(hf_config) -> dict | None:
    """The config's quantization_config as a dict, None when it has none."""
    q = getattr(hf_config, "quantization_config", None)
    return q if q is None or isinstance(q, dict) else q.to_dict()


# A quantised weight `X.weight` carries its dequantisation multipliers, one per block, as `X.weight_scale_inv`
# (transformers' and DeepSeek's released layout) or `X.scale` (DeepSeek's inference layout). FP8 weights
# have blocks of quantization_config.weight_block_size; FP4 experts (int8, two E2M1 values per byte, the
# first in the low nibble) one scale per 32 values of a row, as E8M0 exponents or plain floats.
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP4_BLOCK = 32


def _scale_name(weight: str, names) -> str | None:
    for candidate in (weight + "_scale_inv", weight[:-len("weight")] + "scale"):
        if candidate in names:
            return candidate
    return None


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """weight [..., R, C] FP8 and scale_inv [..., ceil(R / br), ceil(C / bc)] -> float32 weight * its block's
    scale (the reference block-scaling rule: w = q * scale_inv over each br x bc block)."""
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"checkpoint tensor {name!r}: FP8 weight {tuple(weight.shape)} with {block[0]}x{block[1]} "
                         f"blocks needs scales of shape {want}, the checkpoint's are {tuple(scale_inv.shape)}")
    scale = scale_values(scale_inv).repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return weight.float() * scale[..., :cols]


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """weight [..., R, C/2] int8 (packed E2M1 pairs) and scale [..., R, C/32] -> float32 [..., R, C]: each value
    times its row's scale for its 32 columns (transformers' FP4 expert rule)."""
    rows, cols = weight.shape[-2], 2 * weight.shape[-1]
    want = (*weight.shape[:-1], cols // FP4_BLOCK)
    if cols % FP4_BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"checkpoint tensor {name!r}: FP4 weight {tuple(weight.shape)} ({cols} values a row) needs "
                         f"scales of shape {want}, one per {FP4_BLOCK}; the checkpoint's are {tuple(scale.shape)}")
    values = fp4.unpack_e2m1(weight.view(torch.uint8)).unflatten(-1, (-1, FP4_BLOCK))
    return (values * scale_values(scale).unsqueeze(-1)).flatten(-2)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales -> fp32 multipliers: E8M0 exponents (float8_e8m0fnu, or their raw uint8 bytes) are
    2^(byte - 127); float scales are themselves."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def safetensors_weights(path: str, fp8_block: tuple[int, int] = (128, 128),
                        fp4_packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor; FP8 weights and (with fp4_packed) FP4 experts come
    dequantised with their scales, which are not yielded themselves."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path!r} has no .safetensors files")
    where = {}
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as e:
            raise ValueError(f"{file}: not a readable safetensors file: {e}") from e
        where.update({name: handle for name in handle.keys()})
    scales = _quantized_weights(where, fp4_packed)
    for name, handle in where.items():
        if name in scales.values():
            continue
        tensor = handle.get_tensor(name)
        if name in scales:
            scale = where[scales[name]].get_tensor(scales[name])
            packed = tensor.dtype == torch.int8  # _quantized_weights takes int8 weights only as FP4 experts
            tensor = dequantize_fp4(tensor, scale, name) if packed else dequantize_fp8(tensor, scale, fp8_block, name)
        yield name, tensor


def _quantized_weights(where: dict, fp4_packed: bool) -> dict[str, str]:
    """{quantised weight: its scale tensor} of a checkpoint; refuses FP8 weights without scales and int8
    weights with scales in a checkpoint that does not declare FP4 experts."""
    scales = {}
    for name, handle in where.items():
        dtype, scale = handle.get_slice(name).get_dtype(), _scale_name(name, where)
        if dtype in _FP8_DTYPES and scale is None:
            raise ValueError(f"checkpoint tensor {name!r} is FP8 but has no {name + '_scale_inv'!r} scales")
        if dtype == "I8" and scale is not None and not fp4_packed:
            raise ValueError(f"checkpoint tensor {name!r} is int8 with scales {scale!r}: FP4-packed experts, but "
                             "the config's quantization_config does not declare expert_dtype 'fp4'")
        if dtype in _FP8_DTYPES or (dtype == "I8" and scale is not None):
            scales[name] = scale
    return scales


def _gguf_reader(file: str):
    import gguf

    try:
        return gguf.GGUFReader(file)
    except Exception as e:
        raise ValueError(f"{file}: not a readable GGUF file: {e}") from e


def _field(reader, key, file, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"{file}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def gguf_config(file: str, reader=None):
    """A transformers LlamaConfig from GGUF metadata (only the llama architecture is mapped)."""
    from transformers import LlamaConfig

    reader = reader or _gguf_reader(file)
    arch = _field(reader, "general.architecture", file)
    if arch != "llama":
        raise ValueError(f"{file}: GGUF architecture {arch!r} is not supported (llama only)")
    get = lambda key, default=None: _field(reader, f"llama.{key}", file, default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", file, -1),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", file, -1),
    )


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_weights(file: str, hf_config, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = reader or _gguf_reader(file)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "rope_freqs":
            continue
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES.get(parts[2], parts[2])}.{parts[3]}"
        else:
            name = f"{_GGUF_NAMES.get(parts[0], parts[0])}.{parts[1]}"
        try:
            weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), copy=True))
        except Exception as e:
            raise ValueError(f"{file}: cannot dequantise tensor {tensor.name!r}: {e}") from e
        yield name, _unpermute_qk(parts, weight, hf_config)


def _unpermute_qk(parts: list[str], w: torch.Tensor, cfg) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of q and k rows; undo it for the
    rotate-half convention transformers (and we) use."""
    if parts[0] != "blk" or parts[2] not in ("attn_q", "attn_k"):
        return w
    heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_tokenizer(path: str):
    """The tokenizer (and chat template) from the model directory, or converted once from a GGUF
    file's metadata and cached beside the user's other caches. None if the model ships none."""
    from transformers import AutoTokenizer

    gguf_file = find_gguf(path)
    if gguf_file is None:
        has_tok = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        return AutoTokenizer.from_pretrained(path) if has_tok else None
    stat = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.abspath(gguf_file)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = os.path.join(os.path.expanduser("~/.cache/deepinfer/tokenizers"), key)
    if os.path.exists(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    tok.save_pretrained(cache)
    return tok
