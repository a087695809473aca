"""A rank actor uses a GPU only when Ray granted it one: CPU ranks on a GPU host must not all
land on cuda:0 (NCCL refuses a group whose ranks share a device)."""
import ray

from raydecode.actors.rank_worker import _granted_gpu


def test_outside_ray_any_visible_gpu_counts():
    assert _granted_gpu() is True


def test_actor_without_gpus_is_a_cpu_rank():
    ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False,
             object_store_memory=80 * 2**20, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0, num_gpus=0)
        def probe():
            return _granted_gpu()
        assert ray.get(probe.remote()) is False
    finally:
        ray.shutdown()
