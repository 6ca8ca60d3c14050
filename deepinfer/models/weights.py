"""Copies checkpoint tensors into model parameters, fused ones included, and refuses anything
missing, unexpected, duplicated or misshapen, naming the tensor."""
import torch
from torch import nn


class WeightLoader:
    """Parameters may carry `shard_sizes` (row blocks of a fused projection, per expert if the
    parameter is [E, rows, cols])."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())
        self.loaded_numel = {name: 0 for name in self.params}
        self.seen: set = set()

    def load(self, target: tuple[str, int | None, int | None], tensor: torch.Tensor, hf_name: str = "") -> None:
        name, expert, shard = target
        label = hf_name or name
        if name not in self.params:
            raise ValueError(f"unexpected checkpoint tensor {label!r}: the model has no parameter {name!r}")
        if target in self.seen:
            raise ValueError(f"checkpoint tensor {label!r} appears twice")
        self.seen.add(target)
        dst = self._slice(self.params[name], expert, shard, label)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {label!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self.loaded_numel[name] += dst.numel()

    @staticmethod
    def _slice(param: torch.Tensor, expert, shard, label) -> torch.Tensor:
        dst = param.data if expert is None else param.data[expert]
        if shard is None:
            return dst
        sizes = getattr(param, "shard_sizes", None)
        if not sizes or shard >= len(sizes):
            raise ValueError(f"checkpoint tensor {label!r} targets a shard the parameter does not have")
        start = sum(sizes[:shard])
        return dst[start:start + sizes[shard]]

    def finish(self, ignore: set[str] = frozenset()) -> None:
        missing = [n for n, p in self.params.items() if self.loaded_numel[n] != p.numel() and n not in ignore]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for parameters: {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))
