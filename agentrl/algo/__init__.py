"""The RL maths of agentrl: pure functions over ``[B, T]`` tensors.

``mask`` is 1 on tokens the policy generated and is trained on, 0 on prompt, tool-output and
padding tokens. Functions return ``(value, metrics)`` with metrics as detached floats (``gae``
returns ``(advantages, returns)``).
"""

from agentrl.algo.advantages import discounted_reverse_cumsum, gae, group_advantages, place_rewards, whiten
from agentrl.algo.logprobs import token_logprobs
from agentrl.algo.losses import (
    aggregate,
    explained_variance,
    icepop_weights,
    kl_penalty,
    policy_loss,
    tis_weights,
    value_loss,
)

__all__ = [
    "aggregate",
    "discounted_reverse_cumsum",
    "explained_variance",
    "gae",
    "group_advantages",
    "icepop_weights",
    "kl_penalty",
    "place_rewards",
    "policy_loss",
    "tis_weights",
    "token_logprobs",
    "value_loss",
    "whiten",
]
