"""Building the packed FlexAttention path's ``BlockMask``: from the documents' extents per block
(``document_block_mask``, what the PyTorch backend runs) against ``create_block_mask``, which
evaluates the mask over every (q, kv) pair of the pack first.

    .venv/bin/python benchmarks/block_mask.py [--tokens 4096 8192 16384] [--docs 8] [--repeats 3]

On the CPU. Each build runs in a fresh child process, so that the peak resident memory it adds is
its own; the time is the best of ``repeats`` after a warm-up build. A pack of ``tokens`` holds
``docs`` rows of random lengths. Prints the best time and the added peak memory of each, and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_train_step import timed


def build(kind: str, tokens: int, docs: int, repeats: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    from agentrl.trainer.torch_backend import document_block_mask

    generator = torch.Generator().manual_seed(tokens)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=generator)[: docs - 1] + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]))
    seg = torch.repeat_interleave(torch.arange(docs), lengths)

    def same_document_causal(b, h, q, kv):
        return (seg[q] == seg[kv]) & (q >= kv)

    def once():
        if kind == "create_block_mask":
            return create_block_mask(same_document_causal, None, None, tokens, tokens, "cpu")
        return document_block_mask(seg)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    best = timed(once, torch.device("cpu"), repeats)
    added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"seconds": best, "mib": added / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(build(args.child[0], int(args.child[1]), args.docs, args.repeats)))
        return
    print(f"{args.docs} rows per pack, best of {args.repeats} after a warm-up, each build in its own process")
    for tokens in args.tokens:
        got = {}
        for kind in ("create_block_mask", "document_block_mask"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", kind, str(tokens), "--docs", str(args.docs),
                 "--repeats", str(args.repeats)],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            got[kind] = json.loads(out.strip().splitlines()[-1])
        whole, ours = got["create_block_mask"], got["document_block_mask"]
        print(
            f"{tokens:>6} tokens: create_block_mask {whole['seconds']:.3f} s, +{whole['mib']:,.0f} MiB; "
            f"document_block_mask {ours['seconds'] * 1e3:.2f} ms, +{ours['mib']:,.0f} MiB; "
            f"time ratio {ours['seconds'] / whole['seconds']:.4f}"
        )


if __name__ == "__main__":
    main()
