"""The ops' argument checks and the index helper the CPU engine shares with them: used by the TileLang kernels, their
torch references and the C++ CPU kernels (deepinfer/layers/cpu_ops.py) alike. Free of TileLang, so an engine whose
ops all run CPU kernels never imports it (~2.5 s at every start)."""
import torch

GROUP = {"nvfp4": 16, "mxfp4": 32}  # FP4 formats -> elements per scale


def check(cond: bool, msg: str):
    """Boundary validation: a clear ValueError before any launch."""
    if not cond:
        raise ValueError(msg)


def check_tensor(t, name: str, dtypes, ndim: int):
    check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor")
    check(t.dtype in dtypes, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), 2)
    B = logits.shape[0]
    for name, t, dts in [("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32, torch.int64)),
                         ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,)),
                         ("seeds", seeds, (torch.int64,)), ("offsets", offsets, (torch.int64,))]:
        check_tensor(t, name, dts, 1)
        check(t.shape[0] == B, f"sample: {name} has {t.shape[0]} rows for {B} logits rows")


def check_token_mask(logits, bitmask):
    check_tensor(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), 2)
    check_tensor(bitmask, "bitmask", (torch.int32,), 2)
    B, V = logits.shape
    check(bitmask.shape == (B, (V + 31) // 32),
          f"apply_token_mask: bitmask must be [{B}, {(V + 31) // 32}] for logits [{B}, {V}], "
          f"got {tuple(bitmask.shape)}")


def check_kv_store(x, slot_mapping, packed, scales, fmt):
    check(fmt in GROUP, f"kv_store: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    G = GROUP[fmt]
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16), 2)
    check_tensor(slot_mapping, "slot_mapping", (torch.int32, torch.int64), 1)
    check_tensor(packed, "packed", (torch.uint8,), 3)
    check_tensor(scales, "scales", (torch.uint8,), 3)
    N, D = x.shape
    check(D % G == 0, f"kv_store: D={D} must be a multiple of the {fmt} group {G}")
    check(slot_mapping.shape[0] == N, f"kv_store: slot_mapping has {slot_mapping.shape[0]} entries for {N} tokens")
    check(packed.shape[-1] == D // 2 and scales.shape[-1] == D // G and packed.shape[:2] == scales.shape[:2],
          f"kv_store: packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit D={D} {fmt}")
    return G


def check_kv_load(packed, scales, block_table, indices, fmt):
    check(fmt in GROUP, f"kv_load: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    check_tensor(packed, "packed", (torch.uint8,), 3)
    check_tensor(scales, "scales", (torch.uint8,), 3)
    check_tensor(block_table, "block_table", (torch.int32, torch.int64), 2)
    check_tensor(indices, "indices", (torch.int32, torch.int64), 2)
    D = packed.shape[-1] * 2
    check(scales.shape[:2] == packed.shape[:2] and scales.shape[-1] * GROUP[fmt] == D,
          f"kv_load: scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} for {fmt}")
    check(block_table.shape[0] == indices.shape[0],
          f"kv_load: block_table batch {block_table.shape[0]} != indices batch {indices.shape[0]}")


def check_v4_decode_attention(q, ring, ring_len, comp, comp_valid, sinks):
    fl = (torch.float32, torch.bfloat16, torch.float16)
    check_tensor(q, "q", fl, 3)
    check_tensor(ring, "ring", fl, 3)
    check_tensor(comp, "comp", fl, 3)
    check_tensor(ring_len, "ring_len", (torch.int32, torch.int64), 1)
    check_tensor(comp_valid, "comp_valid", (torch.bool, torch.uint8, torch.int32, torch.int64), 2)
    check_tensor(sinks, "sinks", (torch.float32, torch.bfloat16), 1)
    B, H, D = q.shape
    check(ring.shape[0] == B and comp.shape[0] == B and ring_len.shape[0] == B and comp_valid.shape[0] == B,
          f"v4_decode_attention: batch sizes differ: q {B}, ring {ring.shape[0]}, ring_len {ring_len.shape[0]}, "
          f"comp {comp.shape[0]}, comp_valid {comp_valid.shape[0]}")
    check(ring.shape[2] == D and comp.shape[2] == D, f"v4_decode_attention: head dim {D} != ring/comp dims")
    check(comp_valid.shape[1] == comp.shape[1], "v4_decode_attention: comp_valid [B, K] must match comp [B, K, D]")
    check(sinks.shape[0] == H, f"v4_decode_attention: sinks has {sinks.shape[0]} entries for {H} heads")


def entry_slots(block_table, indices, block_entries: int):
    """-> (flat pool rows [B, k] of the entries at `indices` (padding: row 0), valid [B, k])."""
    valid = indices >= 0
    pos = indices.long().clamp(min=0)
    return block_table.long().gather(1, pos // block_entries).clamp(min=0) * block_entries + pos % block_entries, valid
