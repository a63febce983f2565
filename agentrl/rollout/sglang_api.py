"""SGLang's HTTP JSON for ``/generate`` (0.5.23, read from ``sglang/api/v1/api_types.py`` in its wheel):
the request ``SGLangEngine`` writes and ``agentrl serve local`` reads, the response the other way.

Request (``POST /generate``)::

    {"input_ids": [...], "rid": "<fresh>", "return_logprob": true, "logprob_start_len": -1,
     "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                         "no_stop_trim": true, "skip_special_tokens": false,
                         "spaces_between_special_tokens": false, "sampling_seed"?}}

- Token ids only, never text: what the policy sampled is what is trained on.
- ``logprob_start_len: -1``: log-probs of the output only (none for the prompt).
- An unknown key inside ``sampling_params`` is answered 400 since 0.5.22 (unknown top-level keys
  are ignored), so both sides check the keys against ``SAMPLING_KEYS`` before anything else.
- ``top_k`` -1 means no top-k (SGLang refuses 0); ``temperature`` 0 is greedy.

Response::

    {"text": ..., "output_ids": [...],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": ...}
                                              | {"type": "length", "length": n}
                                              | {"type": "abort", "message": ...},
                   "output_token_logprobs": [[logprob, token_id, text_or_null], ...],
                   "weight_version": "3", "weight_versions": [{"version", "start", "end"}],
                   "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}

Ids and log-probs are read from ``output_token_logprobs`` (they include the stop token; only
``text`` is trimmed), never from ``text``. Log-probs are ``log_softmax(logits / T)`` of the sampled
token before top-p / top-k (``log_softmax(logits)`` when greedy), the ``Engine`` protocol's
definition, unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.
"""

from __future__ import annotations

import difflib
from typing import Any

from agentrl.rollout.engine import Generation, SamplingParams

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    }
)
"""Every key SGLang 0.5.23 accepts inside ``sampling_params`` (a test compares it with the contract's)."""

CONTEXT_RESERVE = 6
"""Tokens of its context length SGLang keeps for itself: it refuses (400) an input of
``max_req_input_len = context_length - 1 - 5`` tokens or more, an input plus ``max_new_tokens`` over
``context_length``, and cuts ``max_new_tokens`` to ``context_length - 2 - input``. An episode of
``rollout.max_context`` tokens fits when ``rollout.max_context <= max_req_input_len`` (``/server_info``
reports it; its KV cache can make it smaller than the context length says)."""
FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}
"""``meta_info.finish_reason.type`` → ``Generation.finish_reason`` (the agent loop ends an
episode whose generation was aborted with status ``aborted``)."""


class ContractError(ValueError):
    """A request or response that breaks the contract above; the message says which field and why."""


def unknown_sampling_keys(sampling: dict[str, Any]) -> list[str]:
    return sorted(k for k in sampling if k not in SAMPLING_KEYS)


def check_sampling_keys(sampling: dict[str, Any]) -> None:
    """``ContractError`` naming each key SGLang would answer 400 to, its closest valid key, and all of them."""
    bad = unknown_sampling_keys(sampling)
    if bad:
        hints = []
        for key in bad:
            close = difflib.get_close_matches(key, SAMPLING_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ContractError(
            f"unknown sampling_params key {', '.join(hints)}: SGLang answers it with 400. "
            f"Valid keys: {', '.join(sorted(SAMPLING_KEYS))}"
        )


def sampling_params(params: SamplingParams, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``params``; ``extra`` (checked) adds keys the protocol lacks."""
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k and params.top_k > 0 else -1,
        "stop_token_ids": list(params.stop_token_ids),
        # The stop token stays in output_ids and text is not re-rendered: ids are the record.
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if params.seed is not None:
        body["sampling_seed"] = params.seed
    if extra:
        body.update(extra)
    check_sampling_keys(body)
    return body


def generate_request(
    input_ids: list[int], params: SamplingParams, rid: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The whole ``/generate`` body for one request (see the module doc)."""
    return {
        "input_ids": input_ids,
        "sampling_params": sampling_params(params, extra),
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": rid,
    }


def abort_request(rid: str | None) -> dict[str, Any]:
    """``/abort_request``'s body: one request by ``rid``, or every request (None)."""
    return {"rid": rid} if rid is not None else {"abort_all": True}


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise ContractError(f"{where} has no {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        raise ContractError(f"{where}.{key} is {value!r}, not a {getattr(kind, '__name__', kind)}")
    return value


def parse_generation(body: Any) -> Generation:
    """The ``Generation`` in a ``/generate`` response: ids and log-probs from
    ``meta_info.output_token_logprobs``, the finish type, the weight version; ``ContractError`` when
    something the loop needs is missing or malformed (the body is then worth asking again for)."""
    meta = _field(body, "meta_info", dict, "response")
    entries = _field(meta, "output_token_logprobs", list, "meta_info")
    ids, logprobs = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 3:
            raise ContractError(f"meta_info.output_token_logprobs[{i}] is {entry!r}, not [logprob, id, text]")
        logprob, token, _text = entry
        if not isinstance(token, int) or isinstance(token, bool):
            raise ContractError(f"meta_info.output_token_logprobs[{i}] has token id {token!r}")
        if not isinstance(logprob, int | float) or isinstance(logprob, bool):
            # SGLang writes null where it has no log-prob (return_logprob off): nothing to train on.
            raise ContractError(f"meta_info.output_token_logprobs[{i}] has log-prob {logprob!r}")
        ids.append(token)
        logprobs.append(float(logprob))
    reason = _field(meta, "finish_reason", dict, "meta_info")
    kind = reason.get("type")
    if kind not in FINISH_TYPES:
        raise ContractError(f"meta_info.finish_reason.type is {kind!r}, not one of {sorted(FINISH_TYPES)}")
    version = meta.get("weight_version")
    spans = meta.get("weight_versions") or []
    if spans and isinstance(spans[0], dict) and spans[0].get("version") is not None:
        # Weights updated while the request ran (0.5.23's spans): the turn is stamped with the
        # version its first tokens came from, so that it counts as off-policy once that is old.
        version = spans[0]["version"]
    return Generation(ids, logprobs, FINISH_TYPES[kind], "0" if version is None else str(version))


def finish_reason(kind: str, output_ids: list[int], message: str = "") -> dict:
    """``meta_info.finish_reason`` as SGLang writes it, for ``serve local``."""
    if kind == "stop":
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    if kind == "length":
        return {"type": "length", "length": len(output_ids)}
    return {"type": "abort", "message": message or "aborted", "status_code": None, "err_type": None}


def error_message(body: Any, fallback: str) -> str:
    """The message of an error body: ``{"error": "..."}``, ``{"error": {"message": ...}}`` or
    ``{"message": ...}`` (SGLang writes each, by endpoint)."""
    if isinstance(body, dict):
        error = body.get("error", body.get("message"))
        if isinstance(error, dict):
            error = error.get("message")
        if isinstance(error, str) and error:
            return error
    return fallback
