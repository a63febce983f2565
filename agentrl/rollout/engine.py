"""The inference engine protocol: token ids in, sampled token ids and their log-probs out.

Log-probs follow SGLang's definition: ``log_softmax(logits / temperature)`` of the sampled token
over the full vocabulary, taken before top-p / top-k filtering (``log_softmax(logits)`` for greedy
requests). The trainer compares them with its own recomputation (IcePop), so every engine must
report them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    max_new_tokens: int = 512
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) means no top-k filtering."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after emitting one of these (it is kept in output_ids)."""
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")


@dataclass
class Generation:
    output_ids: list[int]
    """Sampled ids, including the stop token when one ended the generation."""
    logprobs: list[float]
    """One per output id (see the module doc for the definition)."""
    finish_reason: str
    """``stop`` (a stop token), ``length`` (max_new_tokens), or ``abort``."""
    weight_version: str = "0"


class EngineError(RuntimeError):
    """The engine failed to serve a request. ``transient`` errors are worth retrying."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@runtime_checkable
class Engine(Protocol):
    """What the agent loop and the trainer need from an inference engine (``engine.kind`` names one
    registered in ``agentrl.registry.ENGINES``).

    - ``generate``: one request, token ids in, sampled ids and their log-probs out.
    - ``update_weights``: new policy weights, from a state dict (in-process engines) or from a
      checkpoint directory on disk (``path=``, what a server loads); ``version`` names them, and the
      engine tags later generations with it. Returns the version now served.
    - ``health``: whether it serves; ``close``: release it (idempotent).
    - ``weight_version``: the version of the weights it serves now (the last ``update_weights``'s);
      the trainer counts tokens sampled with any other as off-policy.
    """

    weight_version: str

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation: ...
    async def update_weights(
        self, state_dict: dict[str, Any] | None = None, version: str | None = None, *, path: str | None = None
    ) -> str: ...
    async def health(self) -> bool: ...
    async def close(self) -> None: ...
