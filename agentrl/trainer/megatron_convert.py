"""Hugging Face Llama / Qwen2 weights <-> megatron-core ``GPTModel`` weights, per tensor-parallel rank.

Layout rules (``H`` hidden size, ``d`` head dim, ``n`` query heads, ``g`` key/value groups, ``f`` MLP
width, ``V`` vocabulary, ``tp`` tensor-parallel size, rank ``r``; HF linear weights are ``[out, in]``):

- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: the vocabulary is padded with zero
  rows to a multiple of ``tp`` (``padded_vocab``) and split in ``tp`` contiguous row blocks; rank
  ``r`` holds rows ``[r V'/tp, (r+1) V'/tp)``. The padded rows are never a target and their logits
  are masked out of the normaliser (``megatron_logprobs``). Tied embeddings: no ``output_layer``.
- ``self_attention.linear_qkv.weight`` ``[(n + 2g) d / tp, H]``: one block per key/value group, in
  group order; block ``j`` holds the ``n/g`` query heads that share group ``j`` (HF's query heads
  ``j n/g .. (j+1) n/g - 1``, as ``repeat_kv`` pairs them), then key head ``j``, then value head
  ``j``, each ``d`` rows. Rank ``r`` holds groups ``[r g/tp, (r+1) g/tp)`` (``g % tp == 0``). The
  bias (Qwen2's ``q/k/v_proj.bias``) follows the same row order.
- ``self_attention.linear_proj.weight`` ``[H, n d / tp]``: ``o_proj`` split along its input columns.
- ``mlp.linear_fc1.weight`` ``[2 f / tp, H]``: rank ``r``'s slice of ``gate_proj`` rows followed by its
  slice of ``up_proj`` rows (Megatron's gated unit reads the first half as the gate).
- ``mlp.linear_fc2.weight`` ``[H, f / tp]``: ``down_proj`` split along its input columns.
- ``input_layernorm`` / ``pre_mlp_layernorm`` (HF ``post_attention_layernorm``) /
  ``decoder.final_layernorm`` (HF ``model.norm``): replicated.

Every conversion copies values only (slicing and concatenation), so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

SUPPORTED = ("llama", "qwen2")


def check_config(hf_config: Any, tp: int) -> None:
    """``ValueError`` naming the value when the HF config is not one this converter maps."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(
            f"the Megatron backend converts {', '.join(SUPPORTED)} models; got model_type {kind!r}: "
            "use trainer.backend=torch for it"
        )
    groups = _groups(hf_config)
    if groups % tp or hf_config.num_attention_heads % groups:
        raise ValueError(
            f"trainer.megatron.tp={tp} must divide the model's {groups} key/value heads "
            f"(and they its {hf_config.num_attention_heads} query heads): choose a tp that divides {groups}"
        )
    if hf_config.intermediate_size % tp:
        raise ValueError(f"trainer.megatron.tp={tp} must divide the MLP width {hf_config.intermediate_size}")
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"RoPE scaling {scaling} is not mapped to Megatron here; use trainer.backend=torch")
    # What the Megatron model built here (SwiGLU, no linear biases but q/k/v's, full attention) lacks
    unmapped = [
        f"hidden_act={act!r} (SwiGLU's silu only)"
        for act in [getattr(hf_config, "hidden_act", "silu")]
        if act != "silu"
    ]
    if kind == "llama" and getattr(hf_config, "attention_bias", False):
        unmapped.append("attention_bias=True (the o_proj bias)")
    if getattr(hf_config, "mlp_bias", False):
        unmapped.append("mlp_bias=True")
    if kind == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        unmapped.append("use_sliding_window=True")
    if unmapped:
        raise ValueError(
            f"the model's {', '.join(unmapped)} is not mapped to Megatron here; use trainer.backend=torch for it"
        )


def _groups(c: Any) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope_theta(c: Any) -> float:
    """RoPE's base: ``rope_parameters["rope_theta"]`` (transformers >= 5) or ``rope_theta``."""
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0))


def qkv_bias(c: Any) -> bool:
    """Qwen2 always has q/k/v biases; Llama when ``attention_bias``."""
    return c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def _rows(t: Tensor, tp: int, r: int) -> Tensor:
    n = t.shape[0] // tp
    return t[r * n : (r + 1) * n]


def _cols(t: Tensor, tp: int, r: int) -> Tensor:
    n = t.shape[1] // tp
    return t[:, r * n : (r + 1) * n]


def _pad_vocab(t: Tensor, padded: int) -> Tensor:
    if t.shape[0] == padded:
        return t
    return torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))])


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, c: Any) -> Tensor:
    """HF q/k/v (weights ``[heads d, H]`` or biases ``[heads d]``) -> Megatron's grouped rows."""
    g, d = _groups(c), _head_dim(c)
    per = c.num_attention_heads // g
    q = q.reshape(g, per * d, *q.shape[1:])
    k = k.reshape(g, d, *k.shape[1:])
    v = v.reshape(g, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(qkv: Tensor, c: Any) -> tuple[Tensor, Tensor, Tensor]:
    g, d = _groups(c), _head_dim(c)
    per = c.num_attention_heads // g
    blocks = qkv.reshape(g, (per + 2) * d, *qkv.shape[1:])
    q, k, v = blocks.split([per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def hf_to_megatron(hf: dict[str, Tensor], c: Any, tp: int = 1, rank: int = 0) -> dict[str, Tensor]:
    """Tensor-parallel rank ``rank``'s share of an HF state dict, under ``GPTModel``'s names."""
    tied = bool(getattr(c, "tie_word_embeddings", False))
    vocab = padded_vocab(c.vocab_size, tp)
    unused = set(hf) - ({"lm_head.weight"} if tied else set())
    hf = _Reading(hf, unused)
    out = {
        "embedding.word_embeddings.weight": _rows(
            _pad_vocab(hf["model.embed_tokens.weight"], vocab), tp, rank
        ),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not tied:
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], vocab), tp, rank)
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        names = ("weight", "bias") if qkv_bias(c) else ("weight",)
        for name in names:
            fused = _fuse_qkv(*(hf[f"{attn}{p}_proj.{name}"] for p in "qkv"), c)
            out[f"{m}self_attention.linear_qkv.{name}"] = _rows(fused, tp, rank)
        out[m + "self_attention.linear_proj.weight"] = _cols(hf[attn + "o_proj.weight"], tp, rank)
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, tp, rank), _rows(up, tp, rank)])
        out[m + "mlp.linear_fc2.weight"] = _cols(hf[h + "mlp.down_proj.weight"], tp, rank)
    if unused:  # a weight the Megatron model has no place for: it would compute another function
        raise ValueError(f"HF weights with no Megatron counterpart: {', '.join(sorted(unused)[:6])}")
    return {k: v.detach().clone() for k, v in out.items()}


class _Reading(dict):
    """The state dict, striking each key it is read by from ``unread``."""

    def __init__(self, state: dict[str, Tensor], unread: set[str]):
        super().__init__(state)
        self.unread = unread

    def __getitem__(self, key: str) -> Tensor:
        self.unread.discard(key)
        return super().__getitem__(key)


def megatron_to_hf(shards: list[dict[str, Tensor]], c: Any) -> dict[str, Tensor]:
    """The HF state dict from every tensor-parallel rank's ``GPTModel`` weights (``shards[r]``: rank r's).

    Tied embeddings give ``lm_head.weight`` equal to ``model.embed_tokens.weight``, as an HF model's
    own ``state_dict`` does."""
    tied = bool(getattr(c, "tie_word_embeddings", False))
    first = shards[0]

    def rows(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards])

    def cols(key: str) -> Tensor:
        return torch.cat([s[key] for s in shards], dim=1)

    embed = rows("embedding.word_embeddings.weight")[: c.vocab_size]
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": first["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = embed if tied else rows("output_layer.weight")[: c.vocab_size]
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        names = ("weight", "bias") if qkv_bias(c) else ("weight",)
        for name in names:
            # each rank's rows are whole groups: splitting rank by rank and concatenating is the same
            view = _RankView(c, len(shards))
            parts = [_split_qkv(s[f"{m}self_attention.linear_qkv.{name}"], view) for s in shards]
            for j, p in enumerate("qkv"):
                out[f"{attn}{p}_proj.{name}"] = torch.cat([part[j] for part in parts])
        out[attn + "o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[h + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    return {k: v.detach().clone() for k, v in out.items()}


class _RankView:
    """The head counts one tensor-parallel rank holds (for splitting its fused QKV rows)."""

    def __init__(self, c: Any, tp: int):
        self.num_attention_heads = c.num_attention_heads // tp
        self.num_key_value_heads = _groups(c) // tp
        self.head_dim = _head_dim(c)
        self.hidden_size = c.hidden_size


def to_stage(state: dict[str, Tensor], c: Any, pp: int, stage: int) -> dict[str, Tensor]:
    """Pipeline stage ``stage``'s part of one TP rank's weights (``hf_to_megatron``'s names): layers
    ``[stage L/pp, (stage+1) L/pp)`` renumbered from 0, the embedding on the first stage, the final
    norm and output layer on the last (with tied embeddings over several stages, the last stage's
    ``output_layer.weight`` is a copy of the embedding)."""
    per = c.num_hidden_layers // pp
    tied = bool(getattr(c, "tie_word_embeddings", False))
    out = {}
    for key, value in state.items():
        if key.startswith("decoder.layers."):
            index, rest = key[len("decoder.layers.") :].split(".", 1)
            if stage * per <= int(index) < (stage + 1) * per:
                out[f"decoder.layers.{int(index) - stage * per}.{rest}"] = value
        elif key.startswith("embedding."):
            if stage == 0:
                out[key] = value
        elif stage == pp - 1:
            out[key] = value
    if tied and pp > 1 and stage == pp - 1:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def from_stages(stages: list[dict[str, Tensor]], c: Any) -> dict[str, Tensor]:
    """One TP rank's weights from every pipeline stage's (``to_stage``'s inverse)."""
    pp, per = len(stages), c.num_hidden_layers // len(stages)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    out = {}
    for stage, state in enumerate(stages):
        for key, value in state.items():
            if key.startswith("decoder.layers."):
                index, rest = key[len("decoder.layers.") :].split(".", 1)
                out[f"decoder.layers.{int(index) + stage * per}.{rest}"] = value
            elif not (tied and pp > 1 and key == "output_layer.weight"):
                out[key] = value
    return out


RECOMPUTE = ("none", "selective", "full")
"""The values of ``trainer.megatron.recompute`` (``config.MegatronConfig`` says what each does)."""


def _recompute(mode: str) -> dict[str, Any]:
    """megatron-core's ``TransformerConfig`` fields for one of ``RECOMPUTE``."""
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"trainer.megatron.recompute={mode!r}: use one of {', '.join(RECOMPUTE)}")


def build_gpt(
    c: Any,
    *,
    dtype: torch.dtype = torch.float32,
    cpu: bool = True,
    recompute: str = "none",
    rows: bool = False,
):
    """A megatron-core ``GPTModel`` shaped like the HF config ``c`` (random weights; load them with
    ``hf_to_megatron``), for the model-parallel groups already initialised.

    Local layer spec (no Transformer Engine): RMSNorm, SwiGLU, GQA, RoPE at ``rope_theta``
    (Megatron's rotate-half RoPE is HF's), no dropout, every fusion off (they need CUDA kernels or
    Apex; on GPU the backend may turn them on). ``rows``: its core attention also reads THD
    ``PackedSeqParams`` (``megatron_attention.RowAttention``), so packed rows need no mask."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_config(c, tp)
    if c.num_hidden_layers % pp:
        raise ValueError(f"trainer.megatron.pp={pp} must divide the model's {c.num_hidden_layers} layers")
    with warnings.catch_warnings():
        # selective recompute warns that Transformer Engine's fused attention needs none: this is
        # the local spec, whose core attention may keep [heads, s, s] scores (the mask's, or a
        # row's where SDPA runs its math kernel, as on CPU)
        warnings.filterwarnings("ignore", message=".*core_attn recompute is really needed")
        config = TransformerConfig(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=_groups(c),
            kv_channels=_head_dim(c),
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=qkv_bias(c),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=dtype,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            use_cpu_initialization=cpu,
            # every weight is then loaded from the HF checkpoint, but only the initialisers mark the
            # parameters that are split over tensor-parallel ranks (the gradient norm reads the mark)
            perform_initialization=True,
            persist_layer_norm=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            attention_softmax_in_fp32=True,
            cuda_graph_scope=[],  # no CUDA graphs; megatron-core 0.16's default, "full", warns as deprecated
            **_recompute(recompute),
        )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if rows:
        from agentrl.trainer.megatron_attention import RowAttention

        spec.submodules.self_attention.submodules.core_attention = RowAttention
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(c.vocab_size, tp),
        max_sequence_length=c.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # over several stages the tied copies are two parameters that the backend keeps equal
        share_embeddings_and_output_weights=bool(getattr(c, "tie_word_embeddings", False)) and pp == 1,
        position_embedding_type="rope",
        rotary_base=rope_theta(c),
        parallel_output=True,
    )
