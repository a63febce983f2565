"""A headless Chromium driven through its DevTools protocol (a websocket, aiohttp's client), for the
tests of pages agentrl writes: open a file, collect console errors and uncaught exceptions,
evaluate JavaScript, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    """The browser's path; the test skips without one, or fails where the run asked for one
    (``AGENTRL_REQUIRE_BROWSER=1``, set by tests/with_docker.sh after installing Debian's chromium)."""
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    why = "no Chromium here (Debian: apt-get install chromium; make test installs it as root)"
    if os.environ.get("AGENTRL_REQUIRE_BROWSER") == "1":
        pytest.fail(why)
    pytest.skip(why)


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.ids = ws, itertools.count(1)
        self.errors: list[str] = []
        self.events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        await self.ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            message = json.loads((await self.ws.receive(timeout=30)).data)
            if message.get("id") == n:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        self.events.append(message)
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a)) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            self.errors.append("exception: " + json.dumps(params.get("exceptionDetails", {}))[:500])
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append("log: " + params["entry"].get("text", ""))

    async def wait_for(self, method: str, timeout: float = 30) -> None:
        if any(e.get("method") == method for e in self.events):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = json.loads((await self.ws.receive(timeout=deadline - time.monotonic())).data)
            self._event(message)
            if message.get("method") == method:
                return
        raise TimeoutError(method)

    async def eval(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])


async def open_page(path: Path, check):
    """Start the browser, open ``path`` and run ``await check(page)``; the browser is stopped after."""
    # The profile may still be written to by a dying renderer: its removal must not fail the test.
    with tempfile.TemporaryDirectory(prefix="agentrl-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",  # as root in a container
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1200,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the browser and every helper process it starts: one group to stop
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            for _ in range(300):
                if port_file.exists() and port_file.read_text().strip():
                    break
                await asyncio.sleep(0.1)
            port = int(port_file.read_text().split()[0])
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    target = next(t for t in await r.json() if t["type"] == "page")
                async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    page = Page(ws)
                    for domain in ("Runtime", "Log", "Page"):
                        await page.send(f"{domain}.enable")
                    page.events.clear()  # about:blank's load is not the page's
                    await page.send("Page.navigate", url=path.resolve().as_uri())
                    await page.wait_for("Page.loadEventFired")
                    return await check(page)
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """The browser's whole process group ended (renderers and GPU helpers too), so that none is left
    to take the CPU from the tests after this one."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if _group_ended(proc, within=5.0):
            break
    proc.poll()


def _group_ended(proc: subprocess.Popen, within: float) -> bool:
    """Whether no process of ``proc``'s group is left within ``within`` seconds (``proc`` reaped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
