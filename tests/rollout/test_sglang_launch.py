"""``agentrl serve sglang``: the processes it starts (SGLang itself cannot run here, so its argv is
checked, and the launcher runs real stand-in servers): the health wait, the logs, the group stop."""

import os
import sys
import textwrap
import time

import pytest

from agentrl.rollout.sglang_launch import Launcher, Process, sglang_plan
from tests.rollout.http_servers import free_port

PY = sys.executable


def test_one_server_or_a_router_in_front_of_several():
    (one,) = sglang_plan("/models/qwen", tp=2, port=31000, python=PY)
    assert one.argv == [
        PY, "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "2", "--dp-size", "1", "--base-gpu-id", "0",
    ]  # fmt: skip
    assert (one.url, one.health) == ("http://127.0.0.1:31000", "/health_generate")
    *servers, router = sglang_plan("/m", tp=2, dp=2, servers=3, port=31000, python=PY)
    assert [s.url for s in servers] == [f"http://127.0.0.1:{p}" for p in (31001, 31002, 31003)]
    assert [s.argv[s.argv.index("--base-gpu-id") + 1] for s in servers] == [
        "0",
        "4",
        "8",
    ]  # tp * dp GPUs each
    assert router.argv == [
        PY, "-m", "sglang_router.launch_router", "--worker-urls", *[s.url for s in servers],
        "--host", "127.0.0.1", "--port", "31000", "--policy", "cache_aware",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--servers must be >= 1; got 0"):
        sglang_plan("/m", servers=0)


STAND_IN = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    child = subprocess.Popen(["sleep", "300"])  # what SGLang's scheduler processes are to it
    open(sys.argv[2], "w").write(str(child.pid))
    time.sleep(float(sys.argv[3]))  # loading the model
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()
        def log_message(self, *a):
            print("request", self.path, flush=True)
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_the_launcher_waits_for_health_logs_each_process_and_stops_its_group(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)
    ports = [free_port(), free_port()]
    plan = [
        Process(
            f"s{i}",
            [PY, str(script), str(port), str(tmp_path / f"child{i}"), "0.5"],
            f"http://127.0.0.1:{port}",
            "/health_generate",
        )
        for i, port in enumerate(ports)
    ]
    launcher = Launcher(plan, tmp_path / "logs")
    started = time.monotonic()
    launcher.start(timeout_s=30)
    assert time.monotonic() - started >= 0.5  # it waited for the model to "load"
    children = [int((tmp_path / f"child{i}").read_text()) for i in range(2)]
    assert all(alive(p.popen.pid) for p in plan) and all(alive(c) for c in children)
    launcher.stop(grace_s=5)
    assert not any(alive(p.popen.pid) for p in plan)
    for _ in range(50):  # the children went with their group
        if not any(alive(c) for c in children):
            break
        time.sleep(0.1)
    assert not any(alive(c) for c in children)
    for i in range(2):
        log = (tmp_path / "logs" / f"s{i}.log").read_text()
        assert "serving" in log and "request /health_generate" in log


def test_a_server_that_exits_or_never_answers_is_named_with_its_log(tmp_path):
    dying = Process(
        "sglang-0",
        [PY, "-c", "import sys; print('CUDA error'); sys.exit(3)"],
        "http://127.0.0.1:9",
        "/health",
    )
    launcher = Launcher([dying], tmp_path)
    with pytest.raises(
        RuntimeError, match=r"sglang-0 exited with status 3 before serving; see .*sglang-0.log"
    ):
        launcher.start(timeout_s=30)
    launcher.stop()
    assert "CUDA error" in (tmp_path / "sglang-0.log").read_text()
    silent = Process(
        "sglang-1", [PY, "-c", "import time; time.sleep(60)"], f"http://127.0.0.1:{free_port()}", "/health"
    )
    launcher = Launcher([silent], tmp_path)
    with pytest.raises(RuntimeError, match=r"sglang-1 did not answer http://127.0.0.1:\d+/health in 1s"):
        launcher.start(timeout_s=1)
    launcher.stop(grace_s=2)
    assert silent.popen.poll() is not None


def test_a_run_can_start_its_own_server_and_stops_it_when_its_engine_closes(tmp_path):
    import asyncio

    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.models import tiny_chat_model
    from agentrl.rollout.engine import SamplingParams
    from agentrl.rollout.sglang import from_config

    with pytest.raises(ConfigError, match="either starts its servers or connects to one"):
        load_config(
            TrainConfig,
            None,
            [
                "engine.kind=sglang",
                "engine.url=http://x:1",
                "engine.launch.server=local",
                "engine.launch.model=tiny",
            ],
        )
    with pytest.raises(ConfigError, match="engine.launch.server=sglang needs engine.launch.model"):
        load_config(TrainConfig, None, ["engine.kind=sglang", "engine.launch.server=sglang"])
    with pytest.raises(ConfigError, match="engine.launch is for engine.kind sglang; engine.kind is local"):
        load_config(TrainConfig, None, ["engine.launch.server=local", "engine.launch.model=tiny"])
    port = free_port()
    cfg = load_config(
        TrainConfig,
        None,
        [f"run.output_dir={tmp_path}", "engine.kind=sglang", "engine.launch.server=local",
         f"engine.launch.port={port}", "rollout.max_context=1024"],
    )  # fmt: skip
    # Another shape than `--model tiny`'s: with no engine.launch.model the server loads the run's policy.
    policy, tok = tiny_chat_model(seed=5, hidden=32)
    engine = from_config(policy, cfg)  # writes the policy, starts `agentrl serve local` on it, pushes it
    (server,) = engine.launcher.plan
    assert engine.url == f"http://127.0.0.1:{port}" and server.popen.poll() is None

    async def go():
        gen = await engine.generate(
            tok.encode("def f(x):", add_special_tokens=False), SamplingParams(max_new_tokens=3)
        )
        await engine.close()
        return gen

    gen = asyncio.run(go())
    assert len(gen.output_ids) == 3 and gen.weight_version == "1"  # the pushed policy
    import torch

    prompt = tok.encode("def f(x):", add_special_tokens=False)
    with torch.no_grad():
        lp = torch.log_softmax(policy(torch.tensor([prompt + gen.output_ids])).logits[0], -1)
    ref = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(gen.output_ids)]
    assert max(abs(a - b) for a, b in zip(ref, gen.logprobs, strict=True)) < 1e-4
    assert server.popen.poll() is not None and engine.launcher is None
    log = (tmp_path / "run" / "engine_logs" / "serve-local.log").read_text()
    assert f"agentrl serve local: {(tmp_path / 'run' / 'engine_weights' / 'initial').resolve()} on" in log


def test_a_launched_model_that_cannot_take_the_policys_weights_stops_the_run_at_start(tmp_path):
    """engine.launch.model=tiny is the generic tiny model: another vocabulary and width than a run's
    tiny policy. The run stops with a config error naming the way out, and its server is stopped."""
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.models import tiny_chat_model
    from agentrl.rollout.sglang import from_config

    port = free_port()
    cfg = load_config(
        TrainConfig,
        None,
        [f"run.output_dir={tmp_path}", "engine.kind=sglang", "engine.launch.server=local",
         "engine.launch.model=tiny", f"engine.launch.port={port}", "rollout.max_context=1024"],
    )  # fmt: skip
    policy, _ = tiny_chat_model(seed=5, hidden=32)
    with pytest.raises(
        ConfigError,
        match=r"engine.launch.model=tiny would not load the policy's weights .*do not fit the served model: "
        r"model\.embed_tokens\.weight is \[",
    ) as e:
        from_config(policy, cfg)
    assert "leave engine.launch.model unset" in str(e.value)
    import socket

    with pytest.raises(ConnectionRefusedError):  # the server it started is gone
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_distributed_sync_with_launched_servers_counts_each_servers_tp_ranks():
    """SGLang joins each tensor-parallel rank of a server to the update group as rank_offset +
    tp_rank, and refuses data-parallel replicas there: the group's size and offsets follow tp."""
    from agentrl.config import ConfigError, TrainConfig, load_config

    base = [
        "engine.kind=sglang",
        "engine.launch.server=sglang",
        "engine.launch.model=m",
        "engine.weight_sync=distributed",
        "engine.launch.servers=2",
    ]
    cfg = load_config(TrainConfig, None, [*base, "engine.launch.tp=2"])
    assert cfg.engine.ranks_per_worker == 2
    assert TrainConfig.model_validate_json(cfg.model_dump_json()).engine.ranks_per_worker == 2
    with pytest.raises(
        ConfigError, match=r"engine.ranks_per_worker=1, but each server .* engine.launch.tp=2"
    ):
        load_config(TrainConfig, None, [*base, "engine.launch.tp=2", "engine.ranks_per_worker=1"])
    with pytest.raises(
        ConfigError,
        match=r"engine.launch.dp=2 with engine.weight_sync=distributed: .*launch.servers=4 with dp 1",
    ):
        load_config(TrainConfig, None, [*base, "engine.launch.dp=2"])


def test_weight_versions_advance_without_growing():
    from agentrl.rollout.sglang import _next_version

    assert [_next_version(v) for v in ("0", "9", "step-7", "default", "default-1", "v2.10")] == [
        "1",
        "10",
        "step-8",
        "default-1",
        "default-2",
        "v2.11",
    ]


def test_a_port_that_another_server_answers_on_is_refused_before_anything_starts(tmp_path):
    """Another run's server on the port answers the health check at once, while ours would die on
    "address already in use": the launcher names the port instead of taking that server for its own."""
    import http.server
    import threading

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    port = free_port()
    other = http.server.HTTPServer(("127.0.0.1", port), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)
    ours = Process(
        "serve-local",
        [PY, str(script), str(port), str(tmp_path / "child"), "0.5"],
        f"http://127.0.0.1:{port}",
        "/health_generate",
    )
    launcher = Launcher([ours], tmp_path / "logs")
    try:
        with pytest.raises(
            RuntimeError,
            match=rf"serve-local: port {port} on 127.0.0.1 is already in use .*choose another port",
        ):
            launcher.start(timeout_s=30)
        assert ours.popen is None  # nothing was started
    finally:
        launcher.stop(grace_s=2)
        other.shutdown()
        other.server_close()


def test_a_server_that_exits_before_serving_is_reported_with_the_end_of_its_log(tmp_path):
    lines = "; ".join(f"print('line {i}')" for i in range(30))
    dying = Process(
        "sglang-0",
        [PY, "-c", f"import sys; {lines}; print('CUDA error: out of memory'); sys.exit(3)"],
        f"http://127.0.0.1:{free_port()}",
        "/health",
    )
    launcher = Launcher([dying], tmp_path)
    with pytest.raises(RuntimeError) as e:
        launcher.start(timeout_s=30)
    launcher.stop()
    message = str(e.value)
    assert "sglang-0 exited with status 3 before serving" in message
    assert message.endswith("line 29\n  CUDA error: out of memory")
    assert "line 10\n" not in message  # the last 20 lines only
