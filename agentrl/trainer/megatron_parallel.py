"""The processes of the Megatron backend: the process group and Megatron's model-parallel groups,
and rank 0 driving the other ranks' backend calls under ``torchrun``."""

from __future__ import annotations

import datetime
import functools
import os

import torch
import torch.distributed as dist

FOLLOWER_WAIT_HOURS = 24
"""How long the other ranks wait for rank 0's next backend call (one iteration's rollouts) before
the process group times out."""


def init_parallel(tp: int, pp: int, dp: int, seed: int) -> None:
    """The process group (torchrun's, or one gloo process) and Megatron's model-parallel groups."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():  # one GPU per process, torchrun's local rank
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            # the followers wait in a broadcast while rank 0 collects rollouts: as long as that takes
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(hours=FOLLOWER_WAIT_HOURS))
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ValueError(
            f"trainer.megatron tp={tp} * pp={pp} * dp={dp} = {tp * pp * dp} ranks, but {world} processes "
            f"run: launch with torchrun --nproc-per-node {tp * pp * dp}, or change the sizes"
        )
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_pipeline_model_parallel_world_size() == pp
        ):
            return _seed(seed)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _seed(seed)


def _seed(seed: int) -> None:
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from agentrl.trainer import megatron_cpu

        megatron_cpu.apply(seed)


def collective(method):
    """A backend call every rank must make: on rank 0 it is first sent to the followers."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.driven and self.rank == 0 and not self._busy:
            dist.broadcast_object_list([(method.__name__, args, kwargs)], src=0)
        self._busy = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy = False

    return call
