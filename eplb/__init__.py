"""Expert-parallel load balancing: placement policy, load statistics, runtime placement, replanning."""
from eplb.placement import (ExpertPlacement, load_plan, moe_lb, moe_lb_total, plan_transfers, rearrange,
                            save_plan)
from eplb.policy import REFERENCE_FLAGS, rebalance_experts
from eplb.stats import ExpertLoadRecorder, load_stats

__all__ = ["ExpertLoadRecorder", "ExpertPlacement", "REFERENCE_FLAGS", "load_plan", "load_stats", "moe_lb",
           "moe_lb_total", "plan_transfers", "rearrange", "rebalance_experts", "save_plan"]
