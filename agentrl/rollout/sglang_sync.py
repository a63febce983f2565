"""Weight sync from the trainer to SGLang workers, the two ways ``engine.weight_sync`` names:
``disk`` (``write_checkpoint``: a Hugging Face checkpoint every worker loads with
``/update_weights_from_disk``) and ``distributed`` (``broadcast_update``: the trainer broadcasts its
tensors over an update group, NCCL on GPUs, gloo where there are none, as in the tests here).

SGLang 0.5.23's side of it: ``/init_weights_update_group`` {``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend``} makes each worker rank join the group;
``/update_weights_from_distributed`` {``names``, ``dtypes``, ``shapes``, ``group_name``,
``flush_cache``, ``weight_version``} makes them receive one broadcast per name, in that order, from
rank 0 (the trainer); since 0.5.21 that call must sit between ``/begin_weight_update`` and
``/end_weight_update`` or it answers ``success: false``; ``/destroy_weights_update_group`` leaves.

The group is joined the way SGLang joins it: a rendezvous at ``tcp://master``, the store wrapped in
``PrefixStore(group_name)``, a new process group over it. ``init_process_group`` would not do: its
store keys differ from the server's, and both sides wait for each other until the timeout
(sglang#4096). The group is not the default one, so the trainer's own ``torch.distributed`` (if any)
is untouched.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from agentrl.rollout.engine import EngineError
from agentrl.rollout.sglang_api import error_message

GROUP_NAME = "weight_update_group"


def join_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
    store=None,
):
    """This process's member of the update group (rank 0 is the trainer; it hosts the store). Blocks
    until every rank has joined. Returns the group and its rendezvous store. ``store``: the
    rendezvous store of an earlier join, kept by the trainer so that a second join neither binds the
    port again nor reads an old group's keys (each join has a group name of its own)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    if store is None:
        store, rank, world_size = next(rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
        store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {
        i: i for i in range(world_size)
    }  # collectives map group ranks through this
    return group, store


def leave_update_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``bfloat16``: how SGLang names dtypes in ``dtypes``."""
    return str(dtype).removeprefix("torch.")


def buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in their order, cut into runs of at most ``bucket_bytes`` (a larger tensor is a
    bucket of its own): one ``/update_weights_from_distributed`` call each, so that a worker holds
    one bucket of received tensors at a time."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def bucket_request(
    bucket: list[tuple[str, torch.Tensor]], group_name: str, version: str | None
) -> dict[str, Any]:
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": False,  # flushed once, after the last bucket
        "weight_version": version,
    }


def broadcast(group, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Rank 0's side of one bucket: each tensor, in order (blocks until every rank has it)."""
    import torch.distributed as dist

    for _, tensor in bucket:
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)


def receive(
    group, names: list[str], dtypes: list[str], shapes: list[list[int]], device
) -> dict[str, torch.Tensor]:
    """A worker's side of one bucket: the tensors rank 0 broadcasts, in order."""
    import torch.distributed as dist

    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        out[name] = tensor
    return out


async def broadcast_update(engine, state_dict: dict[str, Any], version: str) -> None:
    """Broadcast ``state_dict`` to every worker: join the update group once, then pause, begin,
    one ``/update_weights_from_distributed`` per bucket (the version set with the last), end,
    flush, continue (``agentrl.rollout.sglang_sync``)."""
    loop = asyncio.get_running_loop()
    workers = await engine.workers()
    if engine.update_group is None:
        engine.update_joins += 1  # a group left after a failed update is joined anew, under a new name
        host, _, port = engine.sync_master.rpartition(":")
        world = 1 + engine.ranks_per_worker * len(workers)
        joins = [
            asyncio.ensure_future(
                engine.post_ok(
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": host,
                        "master_port": int(port),
                        "rank_offset": 1 + i * engine.ranks_per_worker,
                        "world_size": world,
                        "group_name": engine.update_group_name,
                        "backend": engine.sync_backend,
                    },
                    once=True,  # joining twice is not joining once
                )
            )
            for i, url in enumerate(workers)
        ]
        group = loop.run_in_executor(
            None,
            join_update_group,
            host,
            int(port),
            world,
            0,
            engine.update_group_name,
            engine.sync_backend,
            300.0,
            engine.update_store,
        )
        (engine.update_group, engine.update_store), *_ = await asyncio.gather(group, *joins)
    try:  # every worker sent a pause is continued, those that paused while another refused too
        await _post_every(engine, workers, "/pause_generation", {"mode": "retract"})  # requests resume after
        await engine.post_all("/begin_weight_update", {"selector": "all"})
        try:
            chunks = buckets(state_dict, engine.bucket_bytes)
            try:
                for k, bucket in enumerate(chunks):
                    body = bucket_request(
                        bucket, engine.update_group_name, version if k == len(chunks) - 1 else None
                    )
                    posts = [  # once: a bucket sent again would wait for a broadcast that never comes
                        asyncio.ensure_future(
                            engine.post_ok(url, "/update_weights_from_distributed", body, once=True)
                        )
                        for url in workers
                    ]
                    await loop.run_in_executor(None, broadcast, engine.update_group, bucket)
                    await asyncio.gather(*posts)
            except Exception:  # the group's ranks may be out of step: leave it, join anew next time
                await engine.leave_update_group()
                raise
        finally:  # a failed update closes its session too, or the next one could not begin
            await engine.post_all("/end_weight_update", {})
        await flush(engine, workers)
    finally:
        await _post_every(engine, workers, "/continue_generation", {})


async def _post_every(engine, workers: list[str], path: str, body: dict[str, Any]) -> None:
    """``post_ok`` to every worker; each answer is awaited before the first error is raised
    (``post_all`` raises at the first, while the others may still be on their way)."""
    outcomes = await asyncio.gather(
        *(engine.post_ok(url, path, body) for url in workers), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def flush(engine, workers: list[str], timeout_s: float = 60.0) -> None:
    """``/flush_cache`` on each worker, again while it answers 400 (SGLang's answer while requests run)."""
    deadline = time.monotonic() + timeout_s
    for url in workers:
        while True:
            status, data = await engine.post(url, "/flush_cache", None)
            if status == 200:
                break
            if status != 400 or time.monotonic() > deadline:
                raise EngineError(f"{url}/flush_cache failed ({status}): {error_message(data, 'no message')}")
            await asyncio.sleep(0.2)


def write_checkpoint(state_dict: dict[str, Any], target: Path, model_config: Any = None) -> Path:
    """``target`` as a Hugging Face checkpoint (``config.json`` when ``model_config`` is given, and
    ``model.safetensors``), written beside it and renamed into place, so that a server never reads
    half of one."""
    from safetensors.torch import save_file

    target = Path(target)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if model_config is not None:
        model_config.save_pretrained(partial)
    # Tied weights (an output head that is the embedding) are one tensor under several names:
    # safetensors stores one of them, as Hugging Face checkpoints do, and loading ties them again.
    tensors, seen = {}, set()
    for name, value in state_dict.items():
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = value.detach().to("cpu").contiguous()
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
