"""A loopback HTTP proxy that injects faults into ``/generate`` calls at configured rates: dropped
connections, delays past the client's timeout, 503 answers, truncated bodies. Everything else
passes through untouched. It counts what it injected, by kind, to compare with the client's retries."""

from __future__ import annotations

import asyncio
import collections
import random

import aiohttp
from aiohttp import web

# The client's retry cause for each fault (agentrl.rollout.sglang._Retry.cause).
CAUSES = {"drop": "connection", "delay": "timeout", "503": "http_503", "truncate": "truncated"}


class FaultProxy:
    """Forwards to ``upstream``; each ``/generate`` meets fault kind k with probability ``rates[k]``."""

    def __init__(self, upstream: str, rates: dict[str, float], *, delay_s: float = 2.0, seed: int = 0):
        assert set(rates) <= set(CAUSES) and sum(rates.values()) <= 1
        self.upstream, self.rates, self.delay_s = upstream.rstrip("/"), rates, delay_s
        self.random = random.Random(seed)
        self.injected: collections.Counter = collections.Counter()
        self.forwarded = 0
        self.upstream_errors = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    def _draw(self) -> str | None:
        x, edge = self.random.random(), 0.0
        for kind, rate in self.rates.items():
            edge += rate
            if x < edge:
                return kind
        return None

    async def _forward(self, request: web.Request) -> tuple[int, bytes, str]:
        body = await request.read()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            data=body,
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as r:
            return r.status, await r.read(), r.headers.get("Content-Type", "application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._draw() if request.path == "/generate" else None
        if fault is not None:
            self.injected[fault] += 1
        if fault == "drop":
            request.transport.abort()  # the connection is cut before any answer (close() could still let one out)
            return web.Response(status=500)
        if fault == "delay":
            await asyncio.sleep(self.delay_s)  # the client has given up by now
            request.transport.abort()
            return web.Response(status=500)
        if fault == "503":
            await request.read()
            return web.Response(status=503, text="upstream restarting")
        try:
            status, body, content_type = await self._forward(request)
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            # The upstream failed to answer the proxy (seen about once in 500 calls on 2 busy cores):
            # the client sees the connection cut, as for a drop, not a 500 of the proxy's own making.
            self.upstream_errors += 1
            request.transport.abort()
            return web.Response(status=500)
        self.forwarded += 1
        if fault == "truncate":
            # The full length announced, half the body sent, then the connection closed.
            response = web.StreamResponse(status=status, headers={"Content-Type": content_type})
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            request.transport.close()
            return response
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})

    async def start(self, port: int = 0) -> str:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
