"""Helpers of the HTTP engine tests: SGLang's contract loaded from its wheel, ``agentrl serve local``
on a free loopback port (in a thread, or as a real ``agentrl serve local`` process)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agentrl.rollout.serve_local import uvicorn_server


def contract():
    """``sglang/api/v1/api_types.py`` of the installed sglang wheel (``make setup`` installs it with
    ``--no-deps``), loaded by file path: importing the ``sglang`` package pulls its CUDA stack."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the sglang wheel is not installed (make setup installs it with --no-deps)")
    path = Path(dist.locate_file("sglang/api/v1/api_types.py"))
    name = "_sglang_api_types"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the annotations through the module
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(server):
    """``server`` (a ``LocalServer``, or any ASGI app) on a free loopback port, served by uvicorn on
    a thread; yields its URL."""
    port = free_port()
    uv = uvicorn_server(server, "127.0.0.1", port)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def wait_healthy(url: str, timeout_s: float = 120.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"agentrl serve local exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become healthy in {timeout_s}s")
        time.sleep(0.2)


def serve_process(model: str, port: int, log: Path) -> subprocess.Popen:
    """A real ``agentrl serve local --model MODEL --port PORT`` process (its output in ``log``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentrl.cli",
                "serve",
                "local",
                "--model",
                model,
                "--port",
                str(port),
                "--device",
                "cpu",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def router_stand_in(workers: list[str]):
    """What the client needs of ``sglang_router`` in front of ``workers``: ``GET /workers`` answered
    as SGLang's gateway documents it (``{"workers": [{"id", "url", ...}], "total", "stats"}``), and
    ``/generate`` forwarded to a worker (the first: one routing policy among others). Like the
    real router it does not forward ``/abort_request``: there is no such route here."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def list_workers(request):
        listed = [
            {
                "id": f"worker-{i}",
                "url": url,
                "model_id": "tiny-test",
                "priority": 50,
                "cost": 1.0,
                "worker_type": "regular",
                "is_healthy": True,
                "load": 0,
                "connection_mode": "Http",
            }
            for i, url in enumerate(workers)
        ]
        stats = {"prefill_count": 0, "decode_count": 0, "regular_count": len(workers)}
        return JSONResponse({"workers": listed, "total": len(workers), "stats": stats})

    async def generate(request):
        body = await request.body()
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{workers[0]}/generate", data=body, headers={"Content-Type": "application/json"}
            ) as r,
        ):
            return Response(await r.read(), status_code=r.status, media_type="application/json")

    return Starlette(
        routes=[
            Route("/workers", list_workers, methods=["GET"]),
            Route("/generate", generate, methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def stub_server(routes: list[tuple[str, str, Any]]):
    """An aiohttp server on a free loopback port answering ``routes`` (method, path, handler) the
    way a test needs a server to misbehave; yields its base URL."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
