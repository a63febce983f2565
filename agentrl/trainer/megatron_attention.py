"""Core attention over packed rows for megatron-core's local layer spec, with no ``[T, T]`` mask.

Megatron's own ``DotProductAttention`` (the local spec's) takes a dense mask over the whole pack and
keeps ``[heads, T, T]`` scores; it refuses THD ``PackedSeqParams``, which only Transformer Engine's
attention reads. ``RowAttention`` reads them: given ``cu_seqlens`` it runs each packed row through
causal ``scaled_dot_product_attention`` on its own (flash or memory-efficient kernels on a GPU,
memory linear in the row's length), grouped-query heads as megatron groups them (query head ``h``
reads key/value group ``h // (heads / groups)``; the groups are repeated for it, as megatron's own
attention does, rather than left to ``enable_gqa``, which not every GPU kernel takes). Without
``PackedSeqParams`` it is megatron's.

RoPE under THD is megatron's too: each row's rotation is applied from its ``cu_seqlens`` offsets,
which changes no score (within a row every query-key offset is the row's own).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class RowAttention(DotProductAttention):
    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise ValueError(
                f"RowAttention reads THD packed rows without an attention bias, not "
                f"qkv_format={packed_seq_params.qkv_format!r}"
            )
        # [T, heads, dim] and [T, groups, dim] for the whole pack; rows at cu_seqlens
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        rows = []
        for start, end in pairwise(bounds):
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            if k.shape[1] != q.shape[1]:  # every query head its group's keys and values
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            rows.append(out[0].transpose(0, 1))
        return torch.cat(rows).reshape(query.shape[0], -1)
