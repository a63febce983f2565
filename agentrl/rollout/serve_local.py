"""``agentrl serve local``: the embedded engine served over SGLang's HTTP API, so that
``SGLangEngine`` runs the agent loop and the trainer against a real model on a machine where SGLang
cannot run (a CPU).

An ASGI app (Starlette, served by uvicorn) with SGLang 0.5.23's endpoints and JSON
(``agentrl.rollout.sglang_api``): ``/generate``, ``/health``, ``/health_generate``, ``/model_info``,
``/server_info``, ``/abort_request``, ``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/update_weight_version``, and the update group's
``/init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``,
``/end_weight_update``, ``/destroy_weights_update_group`` (``agentrl.rollout.sglang_sync``; gloo on a
CPU). Concurrent ``/generate`` requests are decoded together by ``LocalEngine``'s batcher.

Where it differs from SGLang, it says so with a 400 rather than answering something else:
text prompts, streaming, several prompts in one request, prompt log-probs, top log-probs
(``top_logprobs_num``, ``token_ids_logprob``), and sampling keys it does not implement (penalties,
grammars, stop strings, ``n`` > 1) set to anything but their default. As SGLang does, it answers 400
to a body that is not a JSON object and to a value of another JSON type than the contract's or out
of SGLang's range, before the request joins a batch. It has no prefix cache: ``/flush_cache`` only
keeps SGLang's rule (400 while requests run). A pause holds new requests; a batch already running
finishes (``abort`` mode aborts it instead). An aborted request's decoding stops at the engine's
next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from typing import Any

from agentrl.rollout.engine import Generation, SamplingParams
from agentrl.rollout.local import LocalEngine
from agentrl.rollout.sglang_api import CONTEXT_RESERVE, SAMPLING_KEYS, finish_reason, unknown_sampling_keys

HONOURED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "sampling_seed",
    # about text only, which this server returns untrimmed with special tokens: ids are the record
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
}
DEFAULTS: dict[str, Any] = {
    "stop": None,
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "stream_interval": None,
    "logit_bias": {},
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": [],
}
"""The sampling keys this server does not implement, with the values that make them no-ops."""
assert HONOURED | set(DEFAULTS) == SAMPLING_KEYS

_IS = {
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a string or a list of strings": lambda v: (
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(e, str) for e in v))
    ),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(e, str) for e in v),
    "a list of integers": lambda v: isinstance(v, list) and all(_IS["an integer"](e) for e in v),
    "an object": lambda v: isinstance(v, dict),
    "any JSON value": lambda v: True,
}
KINDS = {
    "max_new_tokens": "an integer",
    "stop": "a string or a list of strings",
    "stop_token_ids": "a list of integers",
    "stop_regex": "a string or a list of strings",
    "temperature": "a number",
    "top_p": "a number",
    "top_k": "an integer",
    "min_p": "a number",
    "frequency_penalty": "a number",
    "presence_penalty": "a number",
    "repetition_penalty": "a number",
    "min_new_tokens": "an integer",
    "n": "an integer",
    "json_schema": "a string",
    "regex": "a string",
    "ebnf": "a string",
    "structural_tag": "a string",
    "ignore_eos": "a boolean",
    "skip_special_tokens": "a boolean",
    "spaces_between_special_tokens": "a boolean",
    "no_stop_trim": "a boolean",
    "stream_interval": "an integer",
    "logit_bias": "an object",
    "sampling_seed": "an integer",
    "custom_params": "any JSON value",
    "beam_width": "an integer",
    "watermark": "an object",
    "choice": "a list of strings",
}
"""Each sampling key's JSON type in SGLang's contract (``api_types.SamplingParams``; null is its
default): SGLang answers another with a 400 before the request is queued, and so does this server,
so that a bad request never reaches a batch it would fail."""
assert set(KINDS) == SAMPLING_KEYS


class BadRequest(ValueError):
    """Answered 400 with ``{"error": {"message": ...}}``."""


def _sampling(sampling: Any, prompt_len: int, max_context: int, vocab: int) -> SamplingParams:
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params must be one JSON object (this server takes one prompt per request)")
    bad = unknown_sampling_keys(sampling)
    if bad:  # SGLang's own wording (serde's unknown_field)
        valid = ", ".join(f"`{k}`" for k in sorted(SAMPLING_KEYS))
        raise BadRequest(f"unknown field `{bad[0]}`, expected one of {valid}")
    for key, value in sampling.items():
        if value is not None and not _IS[KINDS[key]](value):
            raise BadRequest(f"sampling_params.{key} must be {KINDS[key]} (or null); got {value!r}")
    for key, default in DEFAULTS.items():
        if key in sampling and sampling[key] is not None and sampling[key] != default:
            raise BadRequest(
                f"sampling_params.{key}={sampling[key]!r}: agentrl serve local does not implement it "
                f"(only {', '.join(sorted(HONOURED))}); leave it out"
            )
    # SGLang's limits, in its words (CONTEXT_RESERVE): the tokenizer's, then the scheduler's
    limit = max_context - CONTEXT_RESERVE
    if prompt_len >= limit:
        raise BadRequest(
            f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({limit} tokens)."
        )
    room = max_context - 2 - prompt_len
    max_new_tokens = sampling.get("max_new_tokens", 128)
    if max_new_tokens is None:  # SGLang: as many as the context holds
        max_new_tokens = room
    elif prompt_len + max_new_tokens > max_context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {max_context} tokens. "
            f"You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} tokens "
            f"from the input messages and {max_new_tokens} tokens for the completion."
        )
    temperature = _given(sampling, "temperature", 1.0)
    if not math.isfinite(temperature):  # Python's JSON reads NaN and Infinity
        raise BadRequest(f"sampling_params.temperature must be a finite number; got {temperature}")
    top_k = _given(sampling, "top_k", -1)
    if top_k >= 1 << 30:
        top_k = -1
    if top_k < -1 or top_k == 0:
        raise BadRequest(f"sampling_params.top_k must be -1 (no top-k) or at least 1; got {top_k}")
    stops = _given(sampling, "stop_token_ids", [])
    if any(not 0 <= t < vocab for t in stops):
        raise BadRequest(f"sampling_params.stop_token_ids must be token ids below {vocab}; got {stops}")
    seed = sampling.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise BadRequest(f"sampling_params.sampling_seed must be in [-2**63, 2**63 - 1]; got {seed}")
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=_given(sampling, "top_p", 1.0),
            top_k=top_k,
            stop_token_ids=list(stops),
            seed=seed,
        )
    except ValueError as e:
        raise BadRequest(f"sampling_params.{e}") from None
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))


def _given(sampling: dict[str, Any], key: str, default: Any) -> Any:
    """``sampling[key]``, or ``default`` where it is absent or null (the contract's default)."""
    value = sampling.get(key)
    return default if value is None else value


class LocalServer:
    """The state behind the app: the engine, the requests running by rid, the pause gate."""

    def __init__(
        self, engine: LocalEngine, *, model_path: str, tokenizer=None, max_context: int, vocab_size: int
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_path, self.tokenizer_path = model_path, model_path
        self.max_context, self.vocab_size = max_context, vocab_size
        self.running: dict[str, asyncio.Task] = {}
        self.aborted: dict[str, str] = {}
        self.started = time.time()
        self._resumed: asyncio.Event | None = None
        self.groups: dict[str, Any] = {}  # weight-update groups joined, by name
        self.updating = False  # between /begin_weight_update and /end_weight_update

    @property
    def resumed(self) -> asyncio.Event:
        if self._resumed is None:  # made in the server's loop
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def abort(self, rid: str | None, message: str) -> int:
        """Abort the requests whose rid starts with ``rid`` (every one for None); their decoding
        stops at the engine's next step. An empty rid aborts none (SGLang ignores it)."""
        if rid == "":
            return 0
        # SGLang aborts every request whose rid starts with the one given, not only an equal one.
        rids = [r for r in self.running if rid is None or r.startswith(rid)]
        for r in rids:
            self.aborted[r] = message
            self.running[r].cancel()
        return len(rids)

    async def generate(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("input_ids is required: agentrl serve local takes token ids, not text")
        if not isinstance(ids, list) or not ids or not all(_IS["an integer"](t) for t in ids):
            raise BadRequest("input_ids must be one non-empty list of token ids (one prompt per request)")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise BadRequest(f"input_ids holds ids outside the vocabulary [0, {self.vocab_size})")
        if body.get("stream"):
            raise BadRequest("stream is not implemented by agentrl serve local; send stream: false")
        if body.get("logprob_start_len") not in (None, -1):
            raise BadRequest("logprob_start_len must be -1 (output log-probs only) here")
        for key in ("top_logprobs_num", "token_ids_logprob"):
            if body.get(key) not in (None, 0):
                raise BadRequest(
                    f"{key}={body[key]!r}: agentrl serve local returns only the output tokens' log-probs; "
                    "leave it out"
                )
        params = _sampling(body.get("sampling_params") or {}, len(ids), self.max_context, self.vocab_size)
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("rid must be one string")
        if rid in self.running:
            raise BadRequest(f"duplicate request id {rid!r}: it is still running")
        start = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._generate(ids, params))
        self.running[rid] = task  # abortable from here on, while paused too
        message = ""
        try:
            gen = await task
        except asyncio.CancelledError:
            if rid not in self.aborted:
                raise  # the handler itself was cancelled: the client went away
            gen = Generation([], [], "abort", self.engine.weight_version)
        finally:
            self.running.pop(rid, None)
            message = self.aborted.pop(rid, "")
        out = gen.output_ids
        logprobs = [[lp, t, None] for lp, t in zip(gen.logprobs, out, strict=True)]
        return {
            "text": self.tokenizer.decode(out, skip_special_tokens=False) if self.tokenizer and out else "",
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "finish_reason": finish_reason(gen.finish_reason, out, message),
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": gen.weight_version,
                "weight_versions": [{"version": gen.weight_version, "start": 0, "end": len(out)}],
                "output_token_logprobs": logprobs if body.get("return_logprob") else None,
                "e2e_latency": time.monotonic() - start,
            },
        }

    async def _generate(self, ids: list[int], params: SamplingParams) -> Generation:
        await self.resumed.wait()
        return await self.engine.generate(ids, params)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
        }

    def server_info(self) -> dict[str, Any]:
        import agentrl

        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "context_length": self.max_context,  # SGLang: server_args, plus the scheduler's limits
            "max_req_input_len": self.max_context - CONTEXT_RESERVE,
            "max_total_num_tokens": self.max_context,
            "version": f"agentrl-serve-local {agentrl.__version__}",
            "internal_states": [dict(self.engine.stats, running=len(self.running))],
            "startup_time": self.started,
        }

    async def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path (a checkpoint directory or state-dict file) is required")
        if body.get("abort_all_requests"):
            self.abort(None, "aborted by a weight update")
        version = body.get("weight_version") or self.engine.weight_version
        await self.engine.update_weights(path=body["model_path"], version=str(version))
        self.model_path = body["model_path"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    async def init_weights_update_group(self, body: Any) -> dict[str, Any]:
        from agentrl.rollout.sglang_sync import GROUP_NAME, join_update_group

        try:
            args = (
                str(body["master_address"]), int(body["master_port"]), int(body["world_size"]),
                int(body["rank_offset"]), str(body.get("group_name", GROUP_NAME)), str(body.get("backend", "nccl")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(
                f"master_address, master_port, rank_offset and world_size are required ({e!r})"
            ) from None
        if args[4] in self.groups:
            raise BadRequest(f"already in the weight update group {args[4]!r}")
        # One rank: this server's model is on one device. Blocks until the trainer has joined too.
        self.groups[args[4]], _ = await asyncio.get_running_loop().run_in_executor(
            None, join_update_group, *args
        )
        return {"success": True, "message": f"joined {args[4]} as rank {args[3]} of {args[2]}"}

    async def update_weights_from_distributed(self, body: Any) -> dict[str, Any]:
        from agentrl.rollout.sglang_sync import GROUP_NAME, receive

        if not self.updating:  # SGLang 0.5.21+ refuses the same
            raise BadRequest(
                "update_weights_from_distributed must be wrapped in /begin_weight_update ... /end_weight_update"
            )
        group = self.groups.get(body.get("group_name", GROUP_NAME))
        if group is None:
            raise BadRequest(
                f"no weight update group {body.get('group_name', GROUP_NAME)!r}: call /init_weights_update_group"
            )
        if body.get("abort_all_requests"):
            self.abort(None, "aborted by a weight update")
        tensors = await asyncio.get_running_loop().run_in_executor(
            None, receive, group, body["names"], body["dtypes"], body["shapes"], self.engine.device
        )
        await self.engine.assign(tensors, body.get("weight_version"))
        return {"success": True, "message": f"updated {len(tensors)} tensors"}

    def destroy_weights_update_group(self, body: Any) -> dict[str, Any]:
        from agentrl.rollout.sglang_sync import GROUP_NAME, leave_update_group

        group = self.groups.pop(body.get("group_name", GROUP_NAME), None)
        if group is None:
            raise BadRequest("no such weight update group")
        leave_update_group(group)
        return {"success": True, "message": "left the weight update group"}


def build_app(server: LocalServer):
    """The Starlette app over ``server``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            import json

            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the body must be a JSON object; got {type(body).__name__}")
        return body

    async def generate(request: Request):
        try:
            return JSONResponse(await server.generate(await body_of(request)))
        except BadRequest as e:
            return error(400, str(e))

    async def health(request: Request):
        return Response(status_code=200)

    async def health_generate(request: Request):
        try:
            await asyncio.wait_for(
                server.engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0)), 60
            )
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(request: Request):
        return JSONResponse(server.model_info())

    async def server_info(request: Request):
        return JSONResponse(server.server_info())

    async def abort_request(request: Request):
        try:
            body = await body_of(request)
        except BadRequest as e:
            return error(400, str(e))
        rid, every = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(every, bool):  # the contract's AbortRequest
            return error(400, f"rid must be a string and abort_all a boolean; got {rid!r} and {every!r}")
        server.abort(None if every else rid, "aborted by /abort_request")
        return Response(status_code=200)

    async def flush_cache(request: Request):
        if server.running:
            return Response("Flush cache failed: requests are running.\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    async def pause_generation(request: Request):
        try:
            body = await body_of(request)
        except BadRequest as e:
            return error(400, str(e))
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error(400, f"mode must be abort, retract or in_place; got {mode!r}")
        server.resumed.clear()
        if mode == "abort":
            server.abort(None, "aborted by /pause_generation")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request):
        server.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(request: Request):
        try:
            return JSONResponse(await server.update_weights_from_disk(await body_of(request)))
        except BadRequest as e:
            return error(400, str(e))
        except Exception as e:  # a checkpoint that does not fit the model, a missing file
            message = f"Failed to update weights: {type(e).__name__}: {e}"
            return JSONResponse(
                {"success": False, "message": message, "num_paused_requests": 0}, status_code=400
            )

    async def update_weight_version(request: Request):
        try:
            body = await body_of(request)
        except BadRequest as e:
            return error(400, str(e))
        new = body.get("new_version")
        if not isinstance(new, str):
            return JSONResponse({"success": False, "message": "new_version (a string) is required"}, 400)
        if body.get("abort_all_requests", True):
            server.abort(None, "aborted by /update_weight_version")
        server.engine.weight_version = new
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    def control(method):
        """A route whose answer is ``{"success": ..., "message": ...}``: 400 with ``success: false`` on failure."""

        async def route(request: Request):
            try:
                result = method(await body_of(request))
                if asyncio.iscoroutine(result):
                    result = await result
                return JSONResponse(result)
            except Exception as e:  # a bad request, a group that cannot form, tensors that do not fit
                return JSONResponse(
                    {"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400
                )

        return route

    def begin(body):
        server.updating = True
        return {"success": True, "message": "weight update begun"}

    def end(body):
        server.updating = False
        return {"success": True, "message": "weight update ended"}

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/init_weights_update_group", control(server.init_weights_update_group), methods=["POST"]),
        Route("/begin_weight_update", control(begin), methods=["POST"]),
        Route(
            "/update_weights_from_distributed",
            control(server.update_weights_from_distributed),
            methods=["POST"],
        ),
        Route("/end_weight_update", control(end), methods=["POST"]),
        Route(
            "/destroy_weights_update_group", control(server.destroy_weights_update_group), methods=["POST"]
        ),
    ]
    return Starlette(routes=routes)


def local_server(
    model, tokenizer, model_path: str, *, max_context: int | None = None, **engine_args
) -> LocalServer:
    """A ``LocalServer`` over ``model`` (its context: ``max_position_embeddings`` unless given)."""
    config = model.config
    context = max_context or getattr(config, "max_position_embeddings", None) or 4096
    vocab = model.get_output_embeddings().weight.shape[0]
    return LocalServer(
        LocalEngine(model, **engine_args),
        model_path=model_path,
        tokenizer=tokenizer,
        max_context=context,
        vocab_size=vocab,
    )


def uvicorn_server(server, host: str, port: int, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``server``'s app, or for ``server`` when it is an ASGI app already
    (``.run()`` serves until ``should_exit``)."""
    import uvicorn

    app = build_app(server) if isinstance(server, LocalServer) else server
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off")
    return uvicorn.Server(config)


def main(
    model_name: str, host: str, port: int, *, device: str = "auto", max_context: int | None = None
) -> None:
    """``agentrl serve local``: load ``model_name`` (``tiny``, ``smollm2`` or a directory) and serve it.
    A directory needs no tokenizer (the checkpoint a run writes of its policy has none): the
    answers' ``text`` is then empty, as ids are the record."""
    import socket

    # Bound before the model loads and the address is announced: taken meanwhile by another
    # process, the port would fail the server only once it had said where it serves.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.create_server((host, port), family=family)
    try:
        server = _load(model_name, device, max_context)
    except BaseException:
        listening.close()
        raise
    print(
        f"agentrl serve local: {model_name} on http://{host}:{port} (max context {server.max_context})",
        flush=True,
    )
    uvicorn_server(server, host, port, log_level="warning").run(sockets=[listening])


def _load(model_name: str, device: str, max_context: int | None):
    from pathlib import Path

    from agentrl.device import resolve_device
    from agentrl.models import load_model

    if Path(model_name).is_dir() and not any(Path(model_name).glob("tokenizer*")):
        from transformers import AutoModelForCausalLM

        model, tokenizer = AutoModelForCausalLM.from_pretrained(model_name), None
    else:
        model, tokenizer = load_model(model_name)
    model = model.to(resolve_device(device)).eval()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    return local_server(model, tokenizer, model_name, max_context=max_context)
