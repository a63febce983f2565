"""Components chosen by config: inference engines (``engine.kind``) and training backends
(``trainer.backend``), each a name mapped to a factory.

A factory is ``"module:function"``, imported when first used, called as ``factory(policy, cfg)``
with the policy model and the whole ``TrainConfig``: an engine factory returns an ``Engine``
(``agentrl.rollout.engine``), a backend factory a ``TrainBackend`` (``agentrl.trainer.backend``).
Another package adds one with ``ENGINES.register("name", "pkg.module:factory")``. Sandboxes have
their own registry (``agentrl.sandbox.register_backend``); environments theirs (``agentrl.env``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """Names of one kind of component (``setting``, e.g. ``engine.kind``) and their factories."""

    def __init__(self, setting: str, entries: dict[str, str]):
        self.setting = setting
        self._entries = dict(entries)

    def register(self, name: str, entry_point: str) -> None:
        if ":" not in entry_point:
            raise ValueError(f"entry_point {entry_point!r} must look like 'package.module:function'")
        self._entries[name] = entry_point

    def names(self) -> list[str]:
        return sorted(self._entries)

    def check(self, name: str) -> None:
        """``ValueError`` naming the closest registered name and every one, when ``name`` is not one."""
        if name not in self._entries:
            close = difflib.get_close_matches(name, self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.setting} {name!r}.{hint} Registered: {', '.join(self.names())}")

    def factory(self, name: str) -> Callable[..., Any]:
        self.check(name)
        module, _, attr = self._entries[name].partition(":")
        return getattr(importlib.import_module(module), attr)


ENGINES = Registry(
    "engine.kind",
    {"local": "agentrl.rollout.local:from_config", "sglang": "agentrl.rollout.sglang:from_config"},
)
BACKENDS = Registry(
    "trainer.backend",
    {
        "torch": "agentrl.trainer.torch_backend:from_config",
        "megatron": "agentrl.trainer.megatron_backend:from_config",
    },
)
