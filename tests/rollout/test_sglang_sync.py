"""Weight sync by broadcast (``engine.weight_sync: distributed``) between this process (the trainer,
rank 0) and a real ``agentrl serve local`` process (rank 1) over a gloo update group: NCCL's path, on
the CPU. Joined as SGLang joins (rendezvous + PrefixStore + a new group), several buckets, wrapped in
begin/end, with pause, flush and continue around it."""

import asyncio
import os
import signal

import aiohttp
import pytest
import torch

from agentrl.models import tiny_chat_model
from agentrl.rollout.engine import EngineError, SamplingParams
from agentrl.rollout.sglang import SGLangEngine
from agentrl.rollout.sglang_sync import buckets
from tests.rollout.http_servers import free_port, serve_process, stub_server, wait_healthy


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """One ``agentrl serve local --model tiny`` process for the tests below (each leaves its group)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = serve_process("tiny", port, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        wait_healthy(url, process=server)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def distributed_engine(url: str, **kwargs) -> SGLangEngine:
    return SGLangEngine(
        url, weight_sync="distributed", sync_master=f"127.0.0.1:{free_port()}", sync_backend="gloo", **kwargs
    )


def test_buckets_keep_the_order_and_their_size():
    tensors = {f"w{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5])}  # 4 bytes each element
    cut = buckets(tensors, bucket_bytes=80)
    assert [[name for name, _ in b] for b in cut] == [["w0", "w1"], ["w2"], ["w3", "w4"]]


def test_a_failed_distributed_update_still_resumes_generation_and_the_next_one_joins_anew(server_url):
    """A bucket the server cannot take (a name its model lacks) fails the update with the server's
    message, and /continue_generation is sent all the same: the server is not left paused. Both sides
    leave the update group, whose ranks may be out of step; the next update joins it again."""
    served, _ = tiny_chat_model(seed=0)  # what the server serves: it is left as it was

    async def go():
        engine = distributed_engine(server_url)
        try:
            await engine.update_weights({"no.such.weight": torch.zeros(3)})
        except EngineError as e:
            error = e
        left = engine.update_group is None
        gen = await asyncio.wait_for(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)), 30)
        version = await engine.update_weights(served.state_dict(), version="0")
        await engine.close()  # leaves the group: the server first
        return error, left, gen, version

    error, left, gen, version = asyncio.run(go())
    assert "update_weights_from_distributed failed (400)" in str(error) and "no.such.weight" in str(error)
    assert left and len(gen.output_ids) == 2 and gen.weight_version == "0" and version == "0"


def test_joining_the_group_and_sending_a_bucket_are_never_sent_twice():
    """The server may have acted on a call whose connection then dropped (joined the group, posted
    its receives): sent again, it would wait for a broadcast the trainer never repeats. Such calls
    are sent once and their fault is an error; an idempotent call is still retried."""
    from aiohttp import web

    calls: list[str] = []

    async def taken_then_dropped(request):
        calls.append(request.path)
        if calls.count(request.path) == 1:
            request.transport.abort()  # the call reached the server; its answer never comes back
        return web.json_response({"success": True, "message": ""})

    async def go():
        paths = ("/init_weights_update_group", "/update_weights_from_distributed", "/begin_weight_update")
        async with stub_server([("POST", path, taken_then_dropped) for path in paths]) as url:
            engine = SGLangEngine(url, weight_sync="distributed", retry_deadline_s=10)
            errors = []
            for path in paths[:2]:
                try:
                    await engine.post_ok(url, path, {}, once=True)
                except EngineError as e:
                    errors.append(str(e))
            await engine.post_ok(url, "/begin_weight_update", {})  # retried: the second answer counts
            await engine.close()
        return errors

    errors = asyncio.run(go())
    assert calls == [
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/begin_weight_update",
        "/begin_weight_update",
    ]
    assert len(errors) == 2 and all("not sent again" in e for e in errors)


def test_a_broadcast_update_reaches_the_server_and_its_version_is_set(server_url):
    url = server_url
    trained, tok = tiny_chat_model(seed=3)  # the server serves seed 0's weights: these are new to it
    state = trained.state_dict()
    prompt = tok.encode("def f(x):", add_special_tokens=False)

    async def go():
        engine = distributed_engine(url, bucket_bytes=64 << 10)  # several buckets for this model
        before = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
        async with aiohttp.ClientSession() as s:
            # Outside begin/end the server refuses, as SGLang 0.5.21+ does.
            body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]]}
            async with s.post(f"{url}/update_weights_from_distributed", json=body) as r:
                refused = r.status, await r.json()
        version = await engine.update_weights(state)
        after = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0))
        again = await engine.update_weights(state, version="step-2")  # the group is joined once
        await engine.close()
        return before, refused, version, after, again, engine

    before, refused, version, after, again, engine = asyncio.run(go())
    assert refused[0] == 400 and refused[1]["success"] is False
    assert "begin_weight_update" in refused[1]["message"]
    assert (before.weight_version, version, after.weight_version, again) == ("0", "1", "1", "step-2")
    with torch.no_grad():
        logits = trained(torch.tensor([prompt + after.output_ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    ref = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(after.output_ids)]
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs, strict=True)) < 1e-4
    assert engine.stats["weight_updates"] == 2 and sum(engine.stats["retries"].values()) == 0


def test_a_worker_that_refuses_to_pause_leaves_no_other_worker_paused():
    """Two workers: the first pauses (slowly), the second refuses. The update fails with the
    refusal, and only after every worker that was sent a pause was continued: a worker left paused
    would hold every later /generate sent to it."""
    from aiohttp import web

    calls: list[tuple[str, str]] = []

    def worker(name: str, refuses: bool):
        async def handle(request):
            calls.append((name, request.path))
            if request.path == "/pause_generation":
                if refuses:
                    return web.json_response({"success": False, "message": "busy"}, status=400)
                await asyncio.sleep(0.3)  # still pausing when the other worker has refused
            return web.json_response({"success": True, "message": ""})

        return handle

    paths = ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update")

    async def go():
        async with (
            stub_server([("POST", p, worker("a", False)) for p in paths]) as a,
            stub_server([("POST", p, worker("b", True)) for p in paths]) as b,
        ):
            engine = SGLangEngine(a, weight_sync="distributed", abort_urls=[a, b], retry_deadline_s=2)
            engine.update_group = object()  # joined already: the pause is what this test is about
            with pytest.raises(EngineError, match=r"/pause_generation failed \(400\): busy"):
                await engine.update_weights({"w": torch.zeros(2)})
            engine.update_group = None  # nothing to leave
            await engine.close()

    asyncio.run(go())
    for name in "ab":
        assert [p for n, p in calls if n == name] == ["/pause_generation", "/continue_generation"], calls
