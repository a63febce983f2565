"""What megatron-core 0.16 needs to run on CPU with gloo, applied only when training on CPU.

- Its global memory buffer and RoPE's frequencies move to ``torch.cuda.current_device()``: on a
  machine without CUDA that call answers ``"cpu"`` (only when CUDA is unavailable, so a GPU
  process is never affected).
- Its RNG tracker keeps CUDA generator states: the inference tracker forks no state (no dropout
  runs: every dropout is 0).
- Its activation recomputation (``trainer.megatron.recompute``) saves and restores the CUDA
  generator's state around each recomputed piece: without CUDA there is none to keep (the CPU
  generator's state is still kept), so those two calls do nothing.
- ``get_default_causal_mask`` allocates on ``cuda``: the backend never asks for it (it passes an
  explicit mask, or THD rows whose attention reads no mask).
- Sequence parallelism and every fused kernel stay off (``megatron_convert.build_gpt``).
- Its distributed optimizer allocates small tensors on ``device='cuda'`` by name, moves state with
  ``.cuda()`` and checks ``param.type()`` against ``'torch.cuda.FloatTensor'``: ``optimizer_calls()``
  runs those calls with the allocations and moves on CPU, and a CPU tensor's type named as its CUDA
  twin (``megatron_optim`` enters it around every call into the optimizer). From 0.19 its gradient
  reduction first orders itself after ``torch.cuda.current_stream()``: on CPU a stream with nothing
  to wait for.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _cpu_device() -> str:
    return "cpu"


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


class _NoStream:
    """The current stream of a machine without CUDA: every operation has already run."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _no_stream(device=None) -> _NoStream:
    return _NoStream()


def apply(seed: int) -> None:
    """Call after ``parallel_state.initialize_model_parallel`` and before building a model."""
    from megatron.core.tensor_parallel import random as mp_random

    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_device
        torch.cuda.current_stream = _no_stream
        mp_random._get_cuda_rng_state = _no_cuda_rng_state
        mp_random._set_cuda_rng_state = _no_cuda_rng_state
    mp_random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def _on_cuda(device) -> bool:
    return isinstance(device, int) or (device is not None and str(device).startswith("cuda"))


class _CudaNamedOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _on_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _on_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and ".cuda." not in out:
            out = out.replace("torch.", "torch.cuda.", 1)
        return out


def optimizer_calls() -> contextlib.AbstractContextManager:
    """The context for a call into Megatron's distributed optimizer: on a machine without CUDA its
    ``'cuda'`` allocations land on CPU and CPU tensors report CUDA type names; with CUDA, nothing."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaNamedOnCpu()
