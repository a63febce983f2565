"""SGLangEngine against SGLang 0.5.23's contract (its wheel's api_types.py) and against
``agentrl serve local`` (a real tiny model over real HTTP): requests, responses, log-probs, errors,
aborts, weight sync by disk, the start-up checks."""

import asyncio
import json

import pytest
import torch

from agentrl.config import ConfigError, TrainConfig, load_config
from agentrl.models import tiny_chat_model
from agentrl.rollout.engine import EngineError, SamplingParams
from agentrl.rollout.serve_local import local_server
from agentrl.rollout.sglang import SGLangEngine, check_server
from agentrl.rollout.sglang import from_config as sglang_from_config
from agentrl.rollout.sglang_api import (
    SAMPLING_KEYS,
    ContractError,
    abort_request,
    generate_request,
    parse_generation,
    sampling_params,
)
from tests.rollout.http_servers import contract, router_stand_in, serving


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    server = local_server(model, tok, "tiny-test", max_context=1024)
    with serving(server) as url:
        yield url, server


def reference_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


# -- the contract ---------------------------------------------------------------------------------


def test_our_sampling_keys_are_the_contracts():
    assert set(contract().SamplingParams.__struct_fields__) == SAMPLING_KEYS


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=40, stop_token_ids=[3], seed=11),
        SamplingParams(max_new_tokens=1, temperature=0.0),
        SamplingParams(top_k=0),
    ],
)
def test_every_request_the_client_builds_decodes_with_the_contract(params):
    api = contract()
    body = generate_request([1, 2, 3], params, "rid-1", {"min_p": 0.05})
    decoded = api.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
    assert decoded.input_ids == [1, 2, 3] and decoded.text is None and decoded.rid == "rid-1"
    assert decoded.return_logprob is True and decoded.logprob_start_len == -1
    sp = decoded.sampling_params
    assert isinstance(sp, api.SamplingParams)
    assert sp.max_new_tokens == params.max_new_tokens and sp.temperature == params.temperature
    assert sp.top_k == (params.top_k if params.top_k > 0 else -1)  # SGLang refuses 0
    assert sp.stop_token_ids == params.stop_token_ids and sp.sampling_seed == params.seed
    assert sp.no_stop_trim is True and sp.skip_special_tokens is False
    assert sp.spaces_between_special_tokens is False and sp.min_p == 0.05
    assert set(body) == {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid"}


def test_the_abort_bodies_decode_with_the_contract():
    api = contract()
    one = api.AbortRequest.from_json_value(abort_request("r-7"))
    every = api.AbortRequest.from_json_value(abort_request(None))
    assert (one.rid, one.abort_all) == ("r-7", False) and every.abort_all is True


def test_an_unknown_sampling_key_is_refused_by_the_contract_the_client_and_the_server(served):
    api = contract()
    url, _ = served
    body = generate_request([1, 2], SamplingParams(max_new_tokens=2), "r")
    body["sampling_params"]["max_tokens"] = 2  # OpenAI's name, not SGLang's
    with pytest.raises(api.JsonContractError, match="unknown field `max_tokens`"):
        api.GenerateRequest.from_json_value(body)
    with pytest.raises(
        ContractError, match="'max_tokens' \\(did you mean 'max_new_tokens'\\?\\).*Valid keys"
    ):
        sampling_params(SamplingParams(), {"max_tokens": 2})
    with pytest.raises(ContractError, match="max_tokens"):
        SGLangEngine(url, extra_sampling={"max_tokens": 2})
    cfg = load_config(
        TrainConfig, None, ["engine.kind=sglang", f"engine.url={url}", "engine.extra_sampling.max_tokens=2"]
    )
    with pytest.raises(ConfigError, match="engine.extra_sampling: unknown sampling_params key 'max_tokens'"):
        sglang_from_config(None, cfg)

    async def post():
        import aiohttp

        async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as r:
            return r.status, await r.json()

    status, answer = asyncio.run(post())
    assert status == 400 and "unknown field `max_tokens`" in answer["error"]["message"]


def recorded_response(finish: dict, entries: list) -> dict:
    """A /generate answer written by hand from the contract's GenerateResponse / GenerateMetaInfo."""
    return {
        "text": "",
        "output_ids": [e[1] for e in entries],
        "meta_info": {
            "id": "0f3a",
            "finish_reason": finish,
            "prompt_tokens": 12,
            "completion_tokens": len(entries),
            "cached_tokens": 8,
            "weight_version": "5",
            "weight_versions": [{"version": "5", "start": 0, "end": len(entries)}],
            "output_token_logprobs": entries,
            "e2e_latency": 0.25,
        },
    }


@pytest.mark.parametrize(
    "finish, status",
    [
        ({"type": "stop", "matched": 2}, "stop"),
        ({"type": "stop", "matched": "</s>"}, "stop"),
        ({"type": "length", "length": 3}, "length"),
        (
            {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None},
            "abort",
        ),
    ],
)
def test_a_recorded_response_parses_to_its_ids_logprobs_and_status(finish, status):
    entries = [[-0.5, 17, None], [-1.25, 4, None], [-0.0, 2, "</s>"]]
    body = recorded_response(finish, entries)
    api = contract()
    decoded = api.GenerateResponse.from_json_value(body)  # the record is one SGLang could send
    assert [e.token_id for e in decoded.meta_info.output_token_logprobs] == [17, 4, 2]
    gen = parse_generation(body)
    assert gen.output_ids == [17, 4, 2] and gen.logprobs == [-0.5, -1.25, 0.0]
    assert gen.finish_reason == status and gen.weight_version == "5"


def test_a_turn_that_spans_a_weight_update_carries_its_first_version():
    body = recorded_response(
        {"type": "length", "length": 3}, [[-0.5, 17, None], [-1.0, 4, None], [-2.0, 9, None]]
    )
    body["meta_info"]["weight_version"] = "6"
    body["meta_info"]["weight_versions"] = [
        {"version": "5", "start": 0, "end": 2},
        {"version": "6", "start": 2, "end": 3},
    ]
    assert contract().GenerateResponse.from_json_value(body).meta_info.weight_versions[1].version == "6"
    assert parse_generation(body).weight_version == "5"


def test_a_response_without_logprobs_or_with_an_unknown_finish_is_a_contract_error():
    body = recorded_response({"type": "stop"}, [[None, 17, None]])
    with pytest.raises(ContractError, match=r"output_token_logprobs\[0\] has log-prob None"):
        parse_generation(body)
    with pytest.raises(ContractError, match="finish_reason.type is 'paused'"):
        parse_generation(recorded_response({"type": "paused"}, [[-1.0, 3, None]]))
    with pytest.raises(ContractError, match="has no 'meta_info'"):
        parse_generation({"text": "hi"})


# -- against agentrl serve local --------------------------------------------------------------------


def test_serve_local_answers_with_the_contracts_types_and_the_engines_logprobs(tiny, served):
    model, tok = tiny
    url, server = served
    api = contract()
    engine = SGLangEngine(url)
    prompts = [tok.encode("def add(a, b):\n" * (i + 1), add_special_tokens=False) for i in range(6)]

    async def go():
        gens = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_new_tokens=12, temperature=0.8, seed=i))
                for i, p in enumerate(prompts)
            )
        )
        import aiohttp

        async with aiohttp.ClientSession() as s:
            body = generate_request(prompts[0], SamplingParams(max_new_tokens=5, temperature=0), "raw-1")
            async with s.post(f"{url}/generate", json=body) as r:
                raw = await r.json()
            infos = {}
            for path in ("/model_info", "/server_info"):
                async with s.get(url + path) as r:
                    infos[path] = await r.json()
            async with s.post(f"{url}/abort_request", json={"rid": "nothing-running"}) as r:
                abort_status = r.status
        await engine.close()
        return gens, raw, infos, abort_status

    batches_before = server.engine.stats["batches"]
    gens, raw, infos, abort_status = asyncio.run(go())
    for p, g in zip(prompts, gens, strict=True):
        assert len(g.output_ids) == len(g.logprobs) > 0
        ref = reference_logprobs(model, p, g.output_ids, 0.8)
        assert max(abs(a - b) for a, b in zip(ref, g.logprobs, strict=True)) < 1e-4
    assert server.engine.stats["batches"] - batches_before < len(prompts)  # batched over HTTP too
    decoded = api.GenerateResponse.from_json_value(raw)
    assert decoded.meta_info.id == "raw-1" and decoded.output_ids == raw["output_ids"]
    assert isinstance(decoded.meta_info.finish_reason, api.FinishLength | api.FinishStop)
    assert api.GetModelInfoResponse.from_json_value(infos["/model_info"]).model_path == "tiny-test"
    assert api.GetServerInfoResponse.from_json_value(infos["/server_info"]).model_path == "tiny-test"
    assert infos["/server_info"]["max_req_input_len"] == 1018  # what SGLang's scheduler reports
    assert abort_status == 200


def test_a_400_is_not_retried_and_its_message_reaches_the_caller(tiny, served):
    url, _ = served
    engine = SGLangEngine(url)

    async def go():
        try:
            # 1000 + 100 tokens > the server's 1024: SGLang answers such a request with 400.
            return await engine.generate([1] * 1000, SamplingParams(max_new_tokens=100))
        finally:
            await engine.close()

    with pytest.raises(
        EngineError, match="refused /generate with 400: .*exceeds the model's maximum context"
    ) as e:
        asyncio.run(go())
    assert not e.value.transient and sum(engine.stats["retries"].values()) == 0


def test_the_server_keeps_sglangs_context_limits(served):
    """SGLang refuses an input of context - 6 tokens or more, and cuts max_new_tokens to context - 2
    - input; the fake does as SGLang does, so a client tested against it fits the real one."""
    url, _ = served
    engine = SGLangEngine(url)

    async def go(n, new):
        return await engine.generate([1] * n, SamplingParams(max_new_tokens=new, temperature=0))

    async def all_of():
        try:
            refused = []
            for n in (1018, 1019):
                try:
                    await go(n, 1)
                except EngineError as e:
                    refused.append(str(e))
            cut = await go(1017, 7)  # asked for 7, SGLang gives at most 1024 - 2 - 1017 = 5
            return refused, cut
        finally:
            await engine.close()

    refused, cut = asyncio.run(all_of())
    assert len(refused) == 2 and all("the maximum allowed length (1018 tokens)" in r for r in refused)
    assert len(cut.output_ids) <= 5 and cut.finish_reason in ("length", "stop")


def test_an_episode_as_long_as_the_start_up_check_allows_ends_truncated_never_refused(tiny, served):
    """rollout.max_context at the server's max_req_input_len, the largest the check lets through:
    episodes that fill it end truncated_context (trainable), none is refused with a 400."""
    from agentrl.env import Task
    from agentrl.rollout.agent_loop import LoopConfig, run_episode
    from tests.rollout.fakes import EchoEnv

    url, _ = served
    _, tok = tiny
    limit = 1018
    check_server(url, model_path=None, max_context=limit, timeout_s=5)
    engine = SGLangEngine(url)
    loop = LoopConfig(max_context=limit, max_new_tokens=256, max_turns=50, temperature=1.0, seed=0)

    async def go():
        try:
            return await asyncio.gather(
                *(run_episode(EchoEnv(episode_len=50), engine, tok, Task(f"t{i}"), loop) for i in range(4))
            )
        finally:
            await engine.close()

    episodes = asyncio.run(go())
    assert [t.status for t in episodes] == ["truncated_context"] * 4
    assert all(len(t.input_ids) == limit for t in episodes)


def test_a_retry_does_not_start_with_the_rid_it_aborts(tiny, served):
    """SGLang's /abort_request aborts every request whose rid starts with the one given: a retry
    named after the timed-out attempt would be aborted with it. The fake aborts by prefix too."""
    url, server = served

    async def go():
        import aiohttp

        seen: list[str] = []
        engine = SGLangEngine(url, request_timeout_s=0.5, retry_deadline_s=30)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/pause_generation", json={"mode": "in_place"}) as r:
                assert r.status == 200
            task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
            while len(seen) < 2:  # the first attempt times out while held; the retry is held too
                await asyncio.sleep(0.02)
                seen.extend(r for r in server.running if r not in seen)
            async with s.post(f"{url}/continue_generation", json={}) as r:
                assert r.status == 200
            gen = await asyncio.wait_for(task, 30)
        await engine.close()
        return seen, gen, engine

    seen, gen, engine = asyncio.run(go())
    assert not seen[1].startswith(seen[0]) and engine.stats["retries"]["timeout"] >= 1
    assert gen.finish_reason != "abort" and len(gen.output_ids) > 0


def test_the_fake_aborts_by_rid_prefix_as_sglang_does(served):
    _, server = served

    async def go():
        held = asyncio.Event()

        async def hang():
            await held.wait()

        tasks = {rid: asyncio.create_task(hang()) for rid in ("abc", "abc-1", "xabc")}
        server.running.update(tasks)
        n = server.abort("abc", "test")
        for rid in tasks:
            server.running.pop(rid, None)
            server.aborted.pop(rid, None)
        await asyncio.sleep(0)
        return n, {rid: t.cancelled() or t.cancelling() > 0 for rid, t in tasks.items()}

    n, cancelled = asyncio.run(go())
    assert n == 2 and cancelled == {"abc": True, "abc-1": True, "xabc": False}


def test_a_cancelled_request_is_aborted_on_the_server(tiny, served):
    url, server = served
    engine = SGLangEngine(url)

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/pause_generation", json={"mode": "in_place"}) as r:
                assert r.status == 200
            task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
            for _ in range(200):  # until the server holds it
                await asyncio.sleep(0.01)
                if server.running:
                    break
            held = list(server.running)
            async with s.post(f"{url}/flush_cache") as r:
                flush_while_running = r.status
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.close()  # waits for the abort it sent
            async with s.post(f"{url}/continue_generation", json={}) as r:
                assert r.status == 200
            async with s.post(f"{url}/flush_cache") as r:
                flush_idle = r.status
        return held, flush_while_running, flush_idle

    held, flush_while_running, flush_idle = asyncio.run(go())
    assert len(held) == 1 and not server.running and engine.stats["aborts_sent"] == 1
    assert (flush_while_running, flush_idle) == (400, 200)  # SGLang's rule: no flush while requests run


def test_behind_a_router_a_cancelled_request_is_aborted_on_every_worker(tiny, served):
    """The router does not forward aborts: the client lists the workers (``GET /workers``) and
    sends ``/abort_request`` to each, so the worker that holds the request stops it."""
    url, server = served
    model, tok = tiny
    other = local_server(model, tok, "tiny-test", max_context=1024)
    with serving(other) as other_url, serving(router_stand_in([url, other_url])) as router:
        engine = SGLangEngine(router)

        async def go():
            import aiohttp

            async with aiohttp.ClientSession() as s:
                for worker in (url, other_url):
                    async with s.post(f"{worker}/pause_generation", json={"mode": "in_place"}) as r:
                        assert r.status == 200
                task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
                for _ in range(300):  # until the first worker holds it, through the router
                    await asyncio.sleep(0.01)
                    if server.running:
                        break
                held = list(server.running)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await engine.close()  # waits for the aborts it sent
                still = list(server.running)
                for worker in (url, other_url):
                    async with s.post(f"{worker}/continue_generation", json={}) as r:
                        assert r.status == 200
            return held, still

        held, still = asyncio.run(go())
    assert len(held) == 1 and still == [], (held, still)
    assert engine.abort_urls == [url, other_url] and engine.stats["aborts_sent"] == 2


def test_weight_sync_by_disk_advances_the_version_and_serves_the_new_weights(tmp_path):
    model, tok = tiny_chat_model(seed=1)
    server = local_server(model, tok, "tiny-seed-1", max_context=512)
    trained, _ = tiny_chat_model(seed=2)  # "the trainer's" weights: another random model of the same shape
    prompt = tok.encode("def f(x):", add_special_tokens=False)
    with serving(server) as url:
        engine = SGLangEngine(url, sync_dir=tmp_path / "sync", model_config=trained.config, keep_synced=1)

        async def go():
            before = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
            first = await engine.update_weights({k: v.clone() for k, v in trained.state_dict().items()})
            after = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
            second = await engine.update_weights(trained.state_dict(), version="step-7")
            again = await engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0))
            with pytest.raises(EngineError, match="could not load weights from .*nowhere"):
                await engine.update_weights(path=str(tmp_path / "nowhere"))
            await engine.close()
            return before, first, after, second, again

        before, first, after, second, again = asyncio.run(go())
    assert (before.weight_version, first, after.weight_version) == ("0", "1", "1")
    assert (second, again.weight_version) == ("step-7", "step-7")
    ref = reference_logprobs(trained, prompt, after.output_ids, 0)
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs, strict=True)) < 1e-4
    # The checkpoint is a Hugging Face one, and only the last one is kept.
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["weights-step-7"]
    assert {p.name for p in (tmp_path / "sync/weights-step-7").iterdir()} == {
        "config.json",
        "model.safetensors",
    }
    assert server.model_path.endswith("weights-step-7")


def test_the_start_up_check_stops_on_another_model_or_a_shorter_context(served):
    url, _ = served
    info = check_server(url, model_path="tiny-test", max_context=1000, timeout_s=5)
    assert info["weight_version"] is not None
    with pytest.raises(ConfigError, match="engine.model_path='Qwen/Qwen3-8B', but .* serves 'tiny-test'"):
        check_server(url, model_path="Qwen/Qwen3-8B", max_context=1000, timeout_s=5)
    check_server(url, model_path=None, max_context=1018, timeout_s=5)  # its max_req_input_len
    with pytest.raises(
        ConfigError, match="rollout.max_context=1019, but .* takes inputs of fewer than 1018 tokens"
    ):
        check_server(url, model_path=None, max_context=1019, timeout_s=5)
    with pytest.raises(ConfigError, match="engine.url=http://127.0.0.1:9: no SGLang server answers"):
        check_server("http://127.0.0.1:9", model_path=None, max_context=8, timeout_s=0.5)
    with pytest.raises(ConfigError, match="engine.kind sglang needs engine.url"):
        load_config(TrainConfig, None, ["engine.kind=sglang"])


def test_a_generation_the_server_aborts_ends_the_episode_as_aborted(tiny, served):
    from agentrl.env import Task
    from agentrl.rollout.agent_loop import LoopConfig, run_episode
    from tests.rollout.fakes import EchoEnv

    _, tok = tiny
    url, server = served
    engine = SGLangEngine(url)

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/pause_generation", json={"mode": "retract"}) as r:
                assert r.status == 200
            episode = asyncio.create_task(
                run_episode(EchoEnv(episode_len=3), engine, tok, Task("t"), LoopConfig(max_new_tokens=4))
            )
            while not server.running:
                await asyncio.sleep(0.01)
            async with s.post(f"{url}/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            traj = await episode
            async with s.post(f"{url}/continue_generation", json={}) as r:
                assert r.status == 200
        await engine.close()
        return traj

    traj = asyncio.run(go())
    assert traj.status == "aborted" and traj.finish_reasons == ["abort"] and traj.reward == 0.0
