"""Speed of ``gae`` and peak memory of ``token_logprobs``, each as a ratio against a baseline run here.

    .venv/bin/python benchmarks/algo.py            # full sizes (about a minute, ~6 GB RAM peak)
    .venv/bin/python benchmarks/algo.py --small    # a quick look at smaller sizes

1. ``gae`` at B=64, T=32768 with an agent-trajectory mask (prompt, then assistant and tool
   segments, then padding) against a reference that loops over T in Python, vectorised over B.
   Goal: at least 20x faster.
2. ``token_logprobs`` forward + backward at T=8192, V=49152, H=576 (SmolLM2-135M's head)
   against the naive ``log_softmax(hidden @ W.T).gather``; peak resident memory above the inputs,
   each measured in a fresh process. Goal: at most 1/8 of the naive peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from agentrl.algo import gae


def agent_batch(batch: int, length: int, seed: int = 0):
    """Rewards, values and a mask shaped like agent trajectories: segments of 50-800 tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    last = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        t = int(torch.randint(200, 2000, (1,), generator=g))  # system prompt + task
        end = length - int(torch.randint(0, length // 4, (1,), generator=g))  # padding after
        while t < end:
            n = int(torch.randint(50, 800, (1,), generator=g))  # an assistant turn
            mask[b, t : min(t + n, end)] = True
            last[b] = min(t + n, end) - 1
            t += n + int(torch.randint(50, 800, (1,), generator=g))  # a tool observation
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), last] = (torch.rand(batch, generator=g) > 0.5).float()
    values = torch.randn(batch, length, generator=g)
    return rewards, values, mask


def gae_reference_loop(rewards, values, mask, gamma, lam):
    """GAE over trainable tokens by a Python loop over T, each step vectorised over the batch."""
    batch, length = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(batch)
    next_adv = torch.zeros(batch)
    pending_reward = torch.zeros(batch)  # rewards seen at mask-0 positions after an action
    zero = torch.zeros(())
    for t in reversed(range(length)):
        m = mask[:, t]
        pending_reward += rewards[:, t]
        delta = pending_reward + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, zero)
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        pending_reward = torch.where(m, zero, pending_reward)
    return adv, torch.where(mask, adv + values, zero)


def time_call(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench_gae(batch, length):
    rewards, values, mask = agent_batch(batch, length)
    rows = []
    for gamma, lam in ((1.0, 1.0), (1.0, 0.95)):
        ref_s, (ref_adv, _) = time_call(
            lambda g=gamma, lm=lam: gae_reference_loop(rewards, values, mask, g, lm), 2
        )
        fast_s, (adv, _) = time_call(lambda g=gamma, lm=lam: gae(rewards, values, mask, g, lm), 7)
        rows.append(
            {
                "gamma": gamma,
                "lam": lam,
                "reference_s": round(ref_s, 4),
                "gae_s": round(fast_s, 4),
                "speedup": round(ref_s / fast_s, 1),
                "max_abs_diff": float((adv - ref_adv).abs().max()),
            }
        )
    return rows


MEMORY_CHILD = r"""
import json, sys, time, torch
from agentrl.algo import token_logprobs
mode, T, V, H, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
hidden = torch.randn(T, H, generator=g).requires_grad_(True)
weight = (torch.randn(V, H, generator=g) * 0.02).requires_grad_(True)
targets = torch.randint(0, V, (T,), generator=g)
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark to the current RSS
base = kib("VmRSS:")
start = time.perf_counter()
if mode == "naive":
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, targets[:, None]).squeeze(1)
else:
    logp = token_logprobs(hidden, weight, targets, chunk_size=chunk)
logp.sum().backward()
seconds = time.perf_counter() - start
print(json.dumps({"peak_mib": (kib("VmHWM:") - base) / 1024, "seconds": seconds}))
"""


def bench_memory(length, vocab, hidden, chunk):
    out = {}
    for mode in ("naive", "chunked"):
        proc = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, mode, str(length), str(vocab), str(hidden), str(chunk)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="smaller sizes for a quick look")
    args = parser.parse_args()
    batch, length = (16, 4096) if args.small else (64, 32768)
    T, V, H = (2048, 8192, 256) if args.small else (8192, 49152, 576)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    ok = True
    print(f"\n[gae] B={batch} T={length}, agent mask; reference = Python loop over T (vectorised over B)")
    for row in bench_gae(batch, length):
        met = row["speedup"] >= 20
        ok &= met
        print(
            f"  gamma={row['gamma']} lam={row['lam']}: reference {row['reference_s']:.3f}s, gae {row['gae_s']:.4f}s"
            f" -> speedup {row['speedup']:.1f}x (goal >= 20x: {'met' if met else 'MISSED'});"
            f" max |diff| {row['max_abs_diff']:.2e}"
        )

    print(f"\n[token_logprobs] T={T} V={V} H={H}, forward + backward, peak RSS above the inputs")
    mem = bench_memory(T, V, H, chunk=1024)
    ratio = mem["chunked"]["peak_mib"] / mem["naive"]["peak_mib"]
    met = ratio <= 1 / 8
    ok &= met
    print(
        f"  naive {mem['naive']['peak_mib']:.0f} MiB ({mem['naive']['seconds']:.2f}s), "
        f"chunked(1024) {mem['chunked']['peak_mib']:.0f} MiB ({mem['chunked']['seconds']:.2f}s)"
        f" -> ratio {ratio:.3f} = 1/{1 / ratio:.1f} (goal <= 1/8: {'met' if met else 'MISSED'})"
    )
    print("\nall goals met" if ok else "\nsome goals MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
