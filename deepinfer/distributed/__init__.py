"""Multi-process pieces of the DP/EP engine (engine/dp.py): ray_launch (Ray start/join, rank actors),
process_groups (torch.distributed group, step vote), channels (zmq outputs, zero-copy tensors),
ep_moe (expert-parallel all-to-all MoE), expert_transfer (EPLB weight moves across ranks)."""
