"""Ray placement of DP ranks: start (or join) Ray bound to 127.0.0.1, start one actor per rank with
fractional resources, and kill them."""
import logging
import os

logger = logging.getLogger("deepinfer")


def ensure_ray(address: str | None, num_cpus: float | None = None) -> bool:
    """Joins the cluster at `address`, or starts a local one on 127.0.0.1 (no dashboard) when None.
    Returns True when this call started Ray (its owner shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address is not None:
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=True)
    return True


def start_actors(cls, world_size: int, make_args, num_cpus: float, num_gpus: float) -> list:
    """One actor of `cls` per rank; make_args(rank) -> constructor args. Construction runs
    concurrently (the ranks meet in init_process_group)."""
    import ray

    remote = ray.remote(cls)
    return [remote.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                           name=None).remote(*make_args(rank)) for rank in range(world_size)]


def kill_actors(actors: list) -> None:
    """Kills every actor process now (no graceful path: a rank may be stuck in a collective)."""
    import ray

    if not ray.is_initialized():
        return  # Ray is down (its own atexit ran first) and took its actors with it; never re-init
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as exc:  # already dead or Ray already down: nothing left to kill
            logger.debug("ray.kill: %s", exc)


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
