"""A toy multi-turn token task that runs agentrl's RL maths end to end on a CPU in seconds.

What it is: a tiny GRU policy answers a one-token prompt (a task id) in two assistant turns of
four tokens each, separated by a two-token "tool observation" it did not generate. The reward is
terminal and sparse in time: the fraction of its eight tokens that match the task's target
sequence, put on the last generated token. The "inference engine" samples from the same weights
with its logits rounded to bf16, so the rollout log-probs differ from the training engine's fp32
recomputation, as they do between SGLang and Megatron.

What it exercises, for real: per-token loss masks over prompt / assistant / tool segments, the
critic, ``gae`` over trainable tokens, ``icepop_weights``, ``policy_loss`` and ``value_loss``.
What it is not: an agent environment, a sandbox, a language model. ``make quickstart`` runs it
until the trainer on ``bugfix-v0`` exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from agentrl.algo import gae, icepop_weights, policy_loss, value_loss

VOCAB = 8
N_TASKS = 4
# Segment layout of one episode: (role, length). Roles: prompt, assistant (sampled), tool.
LAYOUT = (("prompt", 1), ("assistant", 4), ("tool", 2), ("assistant", 4))
ROLES = [role for role, n in LAYOUT for _ in range(n)]
GENERATED = torch.tensor([role == "assistant" for role in ROLES])


@dataclass
class ToyConfig:
    iterations: int = 60
    """PPO iterations (collect, then update)."""
    batch_size: int = 64
    """Episodes per iteration."""
    epochs: int = 4
    """Passes over each batch."""
    lr: float = 3e-3
    """Adam learning rate for both actor and critic."""
    gamma: float = 1.0
    lam: float = 0.95
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    hidden: int = 32
    seed: int = 0


class TinyGRU(nn.Module):
    """Embedding -> GRU -> linear head; ``out=VOCAB`` for the policy, ``out=1`` for the critic."""

    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB + N_TASKS, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(tokens))
        return self.head(h)


def target(task: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, 8]``: the answer tokens for each task."""
    return (task[:, None] * 3 + torch.arange(8)) % VOCAB


def tool_observation(first_turn: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    """The "tool" answers the first turn with a marker token and how many of its tokens were right."""
    right = (first_turn == target(task)[:, :4]).sum(1)
    return torch.stack([torch.full_like(right, VOCAB - 1), right], dim=1)


@torch.no_grad()
def rollout(policy: TinyGRU, batch: int, greedy: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Sample episodes. Returns tokens ``[B, 11]`` and the engine's log-probs ``[B, 11]`` (0 off-policy)."""
    task = torch.randint(0, N_TASKS, (batch,), generator=gen)
    tokens = torch.zeros(batch, len(ROLES), dtype=torch.long)
    tokens[:, 0] = VOCAB + task  # prompt tokens live after the answer vocabulary
    engine_logp = torch.zeros(batch, len(ROLES))
    for t in range(1, len(ROLES)):
        if ROLES[t] == "tool":
            if ROLES[t - 1] != "tool":
                tokens[:, t : t + 2] = tool_observation(tokens[:, 1:5], task)
            continue
        # The inference engine: same weights, logits rounded to bf16.
        logits = policy(tokens[:, :t])[:, -1].bfloat16().float()
        logp = torch.log_softmax(logits, -1)
        tok = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        tokens[:, t] = tok
        engine_logp[:, t] = logp.gather(1, tok[:, None]).squeeze(1)
    answer = tokens[:, GENERATED]
    score = (answer == target(task)).float().mean(1)
    return {"tokens": tokens, "engine_logp": engine_logp, "score": score}


def token_logp(policy: TinyGRU, tokens: torch.Tensor) -> torch.Tensor:
    """Training-engine log-prob of each token given its prefix; ``[B, T-1]`` for tokens 1..T-1."""
    logits = policy(tokens[:, :-1]).float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def run(config: ToyConfig | None = None, log=print) -> dict[str, float]:
    """Train the toy with PPO + critic + GAE + IcePop (no KL); returns before/after greedy scores."""
    cfg = config or ToyConfig()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    policy, critic = TinyGRU(cfg.hidden, VOCAB), TinyGRU(cfg.hidden, 1)
    opt_pi = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    opt_v = torch.optim.Adam(critic.parameters(), lr=cfg.lr)
    mask = GENERATED[1:].expand(cfg.batch_size, -1)  # token t+1 is trainable iff the policy sampled it
    before = float(rollout(policy, 256, True, gen)["score"].mean())
    start = time.perf_counter()
    for it in range(cfg.iterations):
        batch = rollout(policy, cfg.batch_size, False, gen)
        tokens = batch["tokens"]
        with torch.no_grad():
            old_logp = token_logp(policy, tokens)
            old_values = critic(tokens[:, :-1]).squeeze(-1)
        weights, ice = icepop_weights(
            old_logp, batch["engine_logp"][:, 1:], mask, cfg.icepop_low, cfg.icepop_high
        )
        rewards = torch.zeros_like(old_logp)
        rewards[:, -1] = batch["score"]  # terminal reward on the last generated token
        advantages, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        for _ in range(cfg.epochs):
            v_loss, v_metrics = value_loss(critic(tokens[:, :-1]).squeeze(-1), old_values, returns, mask)
            opt_v.zero_grad()
            v_loss.backward()
            opt_v.step()
            pi_loss, pi_metrics = policy_loss(
                token_logp(policy, tokens), old_logp, advantages, mask, token_weights=weights
            )
            opt_pi.zero_grad()
            pi_loss.backward()
            opt_pi.step()
        if it % 5 == 0 or it == cfg.iterations - 1:
            log(
                f"iter {it:3d}  reward {float(batch['score'].mean()):.3f}  "
                f"icepop_masked {ice['icepop_masked_frac']:.4f}  clip_frac {pi_metrics['clip_frac']:.3f}  "
                f"approx_kl {pi_metrics['approx_kl']:.4f}  value_ev {v_metrics['value_explained_var']:.3f}"
            )
    after = float(rollout(policy, 256, True, gen)["score"].mean())
    return {
        "greedy_score_before": before,
        "greedy_score_after": after,
        "train_seconds": time.perf_counter() - start,
    }
