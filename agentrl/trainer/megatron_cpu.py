"""What megatron-core 0.16 needs to run on CPU with gloo, applied only when training on CPU.

- Its global memory buffer and RoPE's frequencies move to ``torch.cuda.current_device()``: on a
  machine without CUDA that call answers ``"cpu"`` (only when CUDA is unavailable, so a GPU
  process is never affected).
- Its RNG tracker keeps CUDA generator states: the inference tracker forks no state (no dropout
  runs: every dropout is 0).
- Its activation recomputation (``trainer.megatron.recompute``) saves and restores the CUDA
  generator's state around each recomputed piece: without CUDA there is none to keep (the CPU
  generator's state is still kept), so those two calls do nothing.
- ``get_default_causal_mask`` allocates on ``cuda``: the backend always passes an explicit mask.
- Sequence parallelism and every fused kernel stay off (``megatron_convert.build_gpt``).
"""

from __future__ import annotations

import torch


def _cpu_device() -> str:
    return "cpu"


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def apply(seed: int) -> None:
    """Call after ``parallel_state.initialize_model_parallel`` and before building a model."""
    from megatron.core.tensor_parallel import random as mp_random

    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_device
        mp_random._get_cuda_rng_state = _no_cuda_rng_state
        mp_random._set_cuda_rng_state = _no_cuda_rng_state
    mp_random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
