"""EPLB in the engine: every MoE layer's routing is counted per step (a ring of the last W steps),
logical experts map to physical slots of a placement (with redundant replicas), and every N steps
the placement is replanned on the window and expert weights move to their new slots."""
import logging
from dataclasses import dataclass

import torch

from deepinfer.config import dataclass_from_dict
from eplb.placement import ExpertPlacement, identity_phy2log, load_plan, moe_lb_total, rearrange
from eplb.policy import rebalance_experts
from eplb.stats import ExpertLoadRecorder

logger = logging.getLogger("deepinfer")


@dataclass
class EplbConfig:
    """vLLM's names where they exist. num_gpus / num_nodes / num_groups describe the expert-parallel
    layout the placement is planned for (on one process the slots are all local)."""

    window_size: int = 1000
    step_interval: int = 10000
    num_redundant_experts: int = 0
    num_gpus: int = 1
    num_nodes: int = 1
    num_groups: int = 1

    @classmethod
    def from_dict(cls, d: dict | None) -> "EplbConfig":
        cfg = dataclass_from_dict(cls, d, "eplb_config")
        for name in cls.__dataclass_fields__:
            value = getattr(cfg, name)
            if not isinstance(value, int) or value < (0 if name == "num_redundant_experts" else 1):
                raise ValueError(f"LLM(eplb_config={{{name!r}: {value!r}}}) must be a positive integer")
        return cfg


class EplbState:
    def __init__(self, blocks: list, config: EplbConfig, enabled: bool, plan_path: str | None):
        self.blocks, self.config, self.enabled = blocks, config, enabled
        num_experts = blocks[0].experts.num_experts
        self.recorder = ExpertLoadRecorder(len(blocks), num_experts, config.window_size)
        if plan_path is not None:
            self.placement = load_plan(plan_path, len(blocks), num_experts)
        else:
            phy2log = identity_phy2log(len(blocks), num_experts, num_experts + config.num_redundant_experts)
            self.placement = ExpertPlacement(phy2log, config.num_gpus, num_experts)
        for i, block in enumerate(blocks):
            block.moe_index, block.eplb = i, self
            block.experts.to_physical(self.placement.phy2log[i])
        self.num_moved = self.num_replans = 0

    def on_route(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Counts logical ids [T, k] and returns the physical slots [T, k] they run on."""
        self.recorder.record(layer, ids)
        return self.placement.map_to_physical(ids, layer)

    def end_step(self) -> None:
        self.recorder.end_step()
        if self.enabled and self.recorder.steps % self.config.step_interval == 0:
            self.replan()

    def steps_to_replan(self) -> int | None:
        """Engine steps until the one whose end_step() replans (1: the next), or None when replanning is off."""
        if not self.enabled:
            return None
        return self.config.step_interval - self.recorder.steps % self.config.step_interval

    def replan(self) -> None:
        """Plans on the window with the current placement as the previous one (fewer moves), then
        moves weights with the same transfer list an expert-parallel engine runs across ranks."""
        c, load = self.config, self.recorder.total()
        old = self.placement.phy2log
        new = rebalance_experts(load, self.placement.num_physical, c.num_groups, c.num_nodes,
                                self.placement.num_gpus, prev_phy2log=old)[0]
        moved = sum(rearrange(b.experts.slot_weights(), old[i], new[i], self.placement.num_gpus)
                    for i, b in enumerate(self.blocks))
        before, after = moe_lb_total(load, old, c.num_gpus), moe_lb_total(load, new, c.num_gpus)
        self.placement = ExpertPlacement(new, self.placement.num_gpus, self.placement.num_experts)
        self.num_moved += moved
        self.num_replans += 1
        logger.info("eplb replan at step %d: moe_lb %.4f -> %.4f, %d experts moved",
                    self.recorder.steps, before, after, moved)
