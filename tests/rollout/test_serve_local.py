"""``agentrl serve local`` over real HTTP with a tiny model: what it refuses with a 400 as SGLang's
contract does (and only the bad request fails), and what an abort stops."""

import asyncio

import pytest

from agentrl.models import tiny_chat_model
from agentrl.rollout.serve_local import KINDS, local_server
from agentrl.rollout.sglang_api import SAMPLING_KEYS
from tests.rollout.http_servers import contract, serving


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_chat_model()
    server = local_server(model, tok, "tiny-test", max_context=1024)
    with serving(server) as url:
        yield url, server


async def post(session, url: str, path: str, **kw):
    async with session.post(url + path, **kw) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def generate(url: str, *bodies: dict) -> list:
    """``/generate`` with each of ``bodies`` at once (they are decoded together): (status, answer)."""

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(post(s, url, "/generate", json=b) for b in bodies))

    return asyncio.run(go())


def test_the_sampling_types_are_the_contracts():
    api = contract()
    assert set(KINDS) == SAMPLING_KEYS == set(api.SamplingParams.__struct_fields__)


@pytest.mark.parametrize(
    "key, value",
    [
        ("top_k", 1.5),
        ("top_k", "5"),
        ("top_k", True),
        ("max_new_tokens", 2.0),
        ("temperature", "hot"),
        ("top_p", False),
        ("stop_token_ids", 5),
        ("stop_token_ids", [1, True]),
        ("sampling_seed", "x"),
        ("no_stop_trim", 1),
        ("min_p", False),  # equal to its default 0.0 in Python, a boolean in JSON
        ("n", True),
    ],
)
def test_a_wrongly_typed_sampling_key_is_refused_by_the_contract_and_the_server(served, key, value):
    url, _ = served
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, key: value}}
    with pytest.raises(contract().JsonContractError, match="invalid type"):
        contract().GenerateRequest.from_json_value(body)
    ((status, answer),) = generate(url, body)
    assert status == 400 and f"sampling_params.{key} must be" in answer["error"]["message"], answer


@pytest.mark.parametrize(
    "sampling, named",
    [
        ({"top_k": -2}, "top_k must be -1 (no top-k) or at least 1; got -2"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"sampling_seed": 2**63}, "sampling_seed must be in [-2**63, 2**63 - 1]"),
    ],
)
def test_a_sampling_value_out_of_sglangs_range_is_refused(served, sampling, named):
    url, _ = served
    ((status, answer),) = generate(url, {"input_ids": [1, 2], "sampling_params": sampling})
    assert status == 400 and f"sampling_params.{named}" in answer["error"]["message"], answer


def test_null_is_the_contracts_default():
    """null decodes to each key's default; a null max_new_tokens is as many as the context holds."""
    model, tok = tiny_chat_model()
    with serving(local_server(model, tok, "tiny-test", max_context=32)) as url:
        nulls = dict.fromkeys(("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids"))
        ((status, answer),) = generate(url, {"input_ids": [1, 2, 3], "sampling_params": nulls})
    assert status == 200 and len(answer["output_ids"]) == 32 - 2 - 3, answer


def test_a_bad_request_fails_alone_not_the_batch_it_would_have_joined(served):
    url, server = served
    batches = server.engine.stats["batches"]
    good, bad = generate(
        url,
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}},
        {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 8, "top_k": 1.5}},
    )
    assert good[0] == 200 and len(good[1]["output_ids"]) == 8
    assert bad[0] == 400 and "sampling_params.top_k must be an integer" in bad[1]["error"]["message"]
    assert server.engine.stats["batches"] == batches + 1  # the good one alone


@pytest.mark.parametrize(
    "body, named",
    [
        ({"input_ids": [True, 2]}, "input_ids must be one non-empty list of token ids"),
        ({"input_ids": [1, 2], "top_logprobs_num": 5}, "top_logprobs_num=5"),
        ({"input_ids": [1, 2], "token_ids_logprob": [3]}, "token_ids_logprob=[3]"),
    ],
)
def test_what_the_server_does_not_return_is_refused(served, body, named):
    url, _ = served
    ((status, answer),) = generate(url, body)
    assert status == 400 and named in answer["error"]["message"], answer
    ((status, _),) = generate(
        url, {"input_ids": [1, 2], "top_logprobs_num": 0, "sampling_params": {"max_new_tokens": 1}}
    )
    assert status == 200


@pytest.mark.parametrize(
    "path", ["/generate", "/abort_request", "/pause_generation", "/update_weight_version"]
)
def test_a_body_that_is_not_an_object_is_a_400(served, path):
    url, _ = served

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            return await post(s, url, path, data="[1]", headers={"content-type": "application/json"})

    status, answer = asyncio.run(go())
    assert status == 400 and "the body must be a JSON object; got list" in answer["error"]["message"]


def test_an_abort_with_an_empty_rid_aborts_nothing(served):
    """SGLang ignores ``{"rid": ""}`` (every rid starts with it) unless ``abort_all`` is set."""
    url, server = served

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            assert (await post(s, url, "/pause_generation", json={"mode": "in_place"}))[0] == 200
            body = {"input_ids": [1, 2, 3], "rid": "held", "sampling_params": {"max_new_tokens": 2}}
            task = asyncio.create_task(post(s, url, "/generate", json=body))
            while "held" not in server.running:
                await asyncio.sleep(0.01)
            empty = await post(s, url, "/abort_request", json={"rid": ""})
            wrong = await post(s, url, "/abort_request", json={"rid": 5})
            still = list(server.running)
            assert (await post(s, url, "/continue_generation", json={}))[0] == 200
            return empty[0], wrong, still, await task

    empty, wrong, still, (status, answer) = asyncio.run(go())
    assert empty == 200 and still == ["held"]
    assert wrong[0] == 400 and "rid must be a string" in wrong[1]["error"]["message"]
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/abort_request", {"rid": "long"}),
        ("/abort_request", {"abort_all": True}),
        ("/pause_generation", {"mode": "abort"}),
    ],
)
def test_an_abort_stops_the_decoding_and_frees_the_engine(served, path, body):
    url, server = served
    engine = server.engine
    steps = 1000

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            batches, row_steps = engine.stats["batches"], engine.stats["row_steps"]
            long = {"input_ids": [1, 2, 3], "rid": "long", "sampling_params": {"max_new_tokens": steps}}
            task = asyncio.create_task(post(s, url, "/generate", json=long))
            while engine.stats["batches"] == batches:  # until it decodes
                await asyncio.sleep(0.005)
            assert (await post(s, url, path, json=body))[0] == 200
            aborted = await task
            assert (await post(s, url, "/continue_generation", json={}))[0] == 200
            short = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            assert (await post(s, url, "/generate", json=short))[0] == 200  # runs once the engine is free
            return aborted, engine.stats["row_steps"] - row_steps

    (status, answer), row_steps = asyncio.run(go())
    assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert row_steps < steps  # the aborted batch stopped early: the next request did not wait for it


def test_serve_local_holds_its_port_before_the_model_loads(monkeypatch):
    """Taken by another process while the model loads, the port would fail the server only after it
    had announced its address: it is bound first, and let go when the model cannot load."""
    import socket

    import agentrl.models
    from agentrl.rollout import serve_local

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = []

    def load_model(name):
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
            except OSError:
                seen.append("bound")
        raise ValueError("no such model")

    monkeypatch.setattr(agentrl.models, "load_model", load_model)
    with pytest.raises(ValueError, match="no such model"):
        serve_local.main("nothing", "127.0.0.1", port)
    assert seen == ["bound"]
    with socket.socket() as again:  # let go once the model failed
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
