"""``engine.kind: sglang``: an ``Engine`` that talks to an SGLang server (or ``sglang_router`` in front
of several, or ``agentrl serve local``) over HTTP, token ids in, ids and log-probs out.

- Requests are exactly SGLang 0.5.23's ``/generate`` (``agentrl.rollout.sglang_api``): ``input_ids``,
  only known ``sampling_params`` keys (an unknown one is refused here, before sending, with the
  valid ones), ``return_logprob``, ``logprob_start_len: -1``, a fresh ``rid`` per attempt.
- Faults that a second try can cure are retried with tenacity, with exponential backoff and full
  jitter under a total deadline (``retry_deadline_s``): refused or reset connections, timeouts,
  502/503/504 and truncated bodies. Each retry is counted by cause in ``stats["retries"]``. A 400
  is never retried; its message is surfaced. When the deadline passes, ``/health`` is asked before
  the engine is declared dead: a healthy server gives a transient error (the loop may try again),
  a silent one a final error.
- A cancelled request (an episode's deadline, a stopped run) sends ``/abort_request`` for its rid to
  the worker that took it: the server, or every worker of a router (the router does not forward
  aborts; ``GET /workers`` lists them, or ``abort_urls`` names them).
- Weight sync by disk: ``update_weights(state_dict)`` writes a Hugging Face checkpoint (config +
  safetensors) under ``sync_dir``, atomically, and asks every worker to load it with
  ``/update_weights_from_disk`` and the new ``weight_version``; ``update_weights(path=...)`` loads
  one the trainer wrote itself. Later generations carry that version.
- Weight sync by broadcast (``weight_sync="distributed"``): the trainer joins an update group with
  every worker rank and broadcasts the tensors bucket by bucket (``agentrl.rollout.sglang_sync``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from agentrl.rollout.engine import EngineError, Generation, SamplingParams
from agentrl.rollout.sglang_api import (
    CONTEXT_RESERVE,
    ContractError,
    abort_request,
    check_sampling_keys,
    error_message,
    generate_request,
    parse_generation,
)

RETRY_STATUSES = (502, 503, 504)
HEALTH_WAIT_S = 20.0
"""How long SGLang's ``/health`` waits for its scheduler to answer (``SGLANG_HEALTH_CHECK_TIMEOUT``)."""
"""Answers of a proxy or router whose upstream is restarting or overloaded: worth another try."""


class _Retry(Exception):
    """One attempt failed in a way a later attempt may not; ``cause`` names the kind."""

    def __init__(self, cause: str, detail: str):
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


class SGLangEngine:
    """An ``Engine`` over SGLang's HTTP API at ``url`` (a server, a router, or ``agentrl serve local``)."""

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retry_deadline_s: float = 120.0,
        update_timeout_s: float = 600.0,
        extra_sampling: dict[str, Any] | None = None,
        abort_urls: list[str] | None = None,
        sync_dir: str | Path | None = None,
        model_config: Any = None,
        keep_synced: int = 2,
        weight_version: str = "0",
        weight_sync: str = "disk",
        sync_master: str = "127.0.0.1:29600",
        sync_backend: str = "nccl",
        bucket_bytes: int = 512 << 20,
        ranks_per_worker: int = 1,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine.url must be an http(s) URL like http://127.0.0.1:30000; got {url!r}")
        self.url = url.rstrip("/")
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.retry_deadline_s, self.update_timeout_s = retry_deadline_s, update_timeout_s
        self.extra_sampling = dict(extra_sampling or {})
        check_sampling_keys(self.extra_sampling)  # a typo stops here, not as 400s mid-run
        self.abort_urls = [u.rstrip("/") for u in abort_urls] if abort_urls else None
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.model_config, self.keep_synced = model_config, keep_synced
        self.weight_version = weight_version
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be disk or distributed; got {weight_sync!r}")
        self.weight_sync, self.sync_master, self.sync_backend = weight_sync, sync_master, sync_backend
        self.bucket_bytes, self.ranks_per_worker = bucket_bytes, ranks_per_worker
        self.update_group = None
        self.update_joins = 0  # each join of the update group has a name of its own
        self.update_store = None  # the trainer's rendezvous store, kept across joins
        self.launcher = None
        """The servers this engine's run started (``engine.launch``), stopped by ``close``."""
        self.stats: dict[str, Any] = {
            "requests": 0,
            "retries": collections.Counter(),
            "failed": 0,
            "aborts_sent": 0,
            "weight_updates": 0,
        }
        self._session = None
        self._background: set[asyncio.Task] = set()
        self._synced: list[Path] = []

    # -- HTTP ---------------------------------------------------------------------------------------

    def _client(self):
        import aiohttp

        if self._session is None or self._session.closed:
            # No connection cap: the rollout's concurrency is the cap (aiohttp's default is 100).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _once(self, method: str, url: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        """One HTTP exchange: ``(status, parsed JSON body or None)``; ``_Retry`` for a fault worth retrying."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.connect_timeout_s)
        try:
            async with self._client().request(method, url, json=body, timeout=timeout) as response:
                status = response.status
                raw = await response.read()
                json_body = "json" in response.headers.get("Content-Type", "")
        except TimeoutError as e:
            raise _Retry("timeout", f"{method} {url} took over {timeout_s:g}s") from e
        except aiohttp.ClientPayloadError as e:
            raise _Retry("truncated", f"{method} {url}: {e}") from e
        except aiohttp.ClientConnectionError as e:  # refused, reset, closed before the answer
            raise _Retry("connection", f"{method} {url}: {type(e).__name__}: {e}") from e
        if status in RETRY_STATUSES:
            raise _Retry(f"http_{status}", f"{method} {url} answered {status}")
        try:
            data = json.loads(raw) if raw.strip() else None
        except ValueError as e:
            if status == 200 and json_body:  # a cut body whose length header was cut with it
                raise _Retry("truncated", f"{method} {url}: the body is not JSON ({e})") from e
            data = None  # a text answer (/flush_cache), or an error page
        return status, data

    async def _call(self, method: str, url: str, body: Any, timeout_s: float, on_retry=None):
        """``_once`` again and again on transient faults, with backoff and jitter, until
        ``retry_deadline_s``; then ``/health`` decides whether the error is transient."""
        start = time.monotonic()
        try:  # the common case, without the retry machinery (a few percent of a call's cost)
            return await self._once(method, url, body, timeout_s)
        except _Retry as e:
            self.stats["retries"][e.cause] += 1
            failed: _Retry | None = e
        attempts = 1
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_Retry),
                wait=wait_random_exponential(multiplier=0.05, max=2.0),
                stop=stop_after_delay(max(self.retry_deadline_s - (time.monotonic() - start), 0.0)),
                reraise=True,
            ):
                with attempt:
                    if failed is not None:  # the first attempt's failure: tenacity backs off, then retries
                        failed, first = None, failed
                        raise first
                    if on_retry is not None:
                        on_retry()
                    attempts += 1
                    try:
                        return await self._once(method, url, body, timeout_s)
                    except _Retry as e:
                        self.stats["retries"][e.cause] += 1
                        raise
        except _Retry as e:
            self.stats["retries"][e.cause] -= 1  # the last failure was not followed by a retry
            healthy = await self.health()
            state = (
                "it answers /health, so the request may succeed later"
                if healthy
                else "it does not answer /health: it is down or unreachable"
            )
            raise EngineError(
                f"SGLang at {self.url}: {e} ({attempts} attempts in {time.monotonic() - start:.1f}s); {state}",
                transient=healthy,
            ) from e
        raise AssertionError("unreachable")  # tenacity returns or raises

    # -- Engine -------------------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        if not input_ids:
            raise EngineError("generate() needs at least one input token")
        rid = uuid.uuid4().hex
        body = generate_request(list(input_ids), params, rid, self.extra_sampling)
        sent = [rid]

        def fresh_rid() -> None:
            # A timed-out attempt may still run on the server: it is aborted, and the next attempt
            # gets a rid of its own (SGLang refuses a rid it is still serving), one that does not
            # start with the old one: SGLang aborts every request whose rid starts with the given one.
            self._abort_later(sent[-1])
            sent.append(uuid.uuid4().hex)
            body["rid"] = sent[-1]

        self.stats["requests"] += 1
        try:
            status, data = await self._call(
                "POST", f"{self.url}/generate", body, self.request_timeout_s, on_retry=fresh_rid
            )
        except asyncio.CancelledError:
            self._abort_later(sent[-1])
            raise
        except EngineError:
            self.stats["failed"] += 1
            raise
        if status != 200:
            self.stats["failed"] += 1
            raise EngineError(
                f"SGLang at {self.url} refused /generate with {status}: {error_message(data, 'no message')}"
            )
        try:
            return parse_generation(data)
        except ContractError as e:
            self.stats["failed"] += 1
            raise EngineError(f"SGLang at {self.url} answered /generate with {e}") from e

    def _abort_later(self, rid: str) -> None:
        """Send ``/abort_request`` for ``rid`` to the workers, in the background (a cancelled caller
        does not wait for it; ``close`` does)."""
        try:
            task = asyncio.get_running_loop().create_task(self.abort(rid))
        except RuntimeError:  # no loop: nothing can be sent
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def workers(self) -> list[str]:
        """The servers behind ``url``: ``abort_urls`` when set, else a router's ``GET /workers``,
        else ``url`` itself."""
        if self.abort_urls is None:
            found: list[str] = []
            try:
                status, data = await self._once("GET", f"{self.url}/workers", None, self.connect_timeout_s)
            except _Retry:
                status, data = 0, None
            if status == 200:
                items = data.get("workers", []) if isinstance(data, dict) else data or []
                for item in items:
                    url = item.get("url") if isinstance(item, dict) else item
                    if isinstance(url, str) and url.startswith("http"):
                        found.append(url.rstrip("/"))
            elif status == 0 or status >= 500:  # no answer yet (a router still starting): ask again next time
                return [self.url]
            self.abort_urls = found or [self.url]
        return self.abort_urls

    async def abort(self, rid: str | None = None) -> None:
        """``/abort_request`` for ``rid`` (None: every request) on every worker; failures are ignored:
        the request ends on its own at its token budget."""
        body = abort_request(rid)
        for url in await self.workers():
            try:
                await self._once("POST", f"{url}/abort_request", body, self.connect_timeout_s)
                self.stats["aborts_sent"] += 1
            except _Retry:
                pass

    async def update_weights(
        self, state_dict: dict[str, Any] | None = None, version: str | None = None, *, path: str | None = None
    ) -> str:
        """Load new weights on every worker through ``/update_weights_from_disk``: from ``path`` (a
        Hugging Face checkpoint directory every worker can read) or from ``state_dict``, written
        first under ``sync_dir``. Returns the new version (default: the current one plus 1)."""
        if (state_dict is None) == (path is None):
            raise ValueError("update_weights takes a state_dict or a path, one of them")
        new = version or _next_version(self.weight_version)
        if state_dict is not None and self.weight_sync == "distributed":
            from agentrl.rollout.sglang_sync import broadcast_update

            await broadcast_update(self, state_dict, new)
            self.weight_version = new
            self.stats["weight_updates"] += 1
            return new
        if state_dict is not None:
            if self.sync_dir is None:
                raise ValueError(
                    "weight sync by disk needs sync_dir (engine.sync_dir): a directory the server reads"
                )
            target = self.sync_dir / f"weights-{new}"
            from agentrl.rollout.sglang_sync import write_checkpoint

            await asyncio.get_running_loop().run_in_executor(
                None, write_checkpoint, state_dict, target, self.model_config
            )
            path = str(target.resolve())
        body = {"model_path": path, "weight_version": new, "flush_cache": True, "abort_all_requests": False}
        for url in await self.workers():
            status, data = await self._call(
                "POST", f"{url}/update_weights_from_disk", body, self.update_timeout_s
            )
            if status != 200 or not (isinstance(data, dict) and data.get("success")):
                raise EngineError(
                    f"{url} could not load weights from {path} ({status}): {error_message(data, 'no message')}"
                )
        self.weight_version = new
        self.stats["weight_updates"] += 1
        if state_dict is not None:
            self._synced.append(Path(path))
            while len(self._synced) > self.keep_synced:  # the servers have moved past these
                shutil.rmtree(self._synced.pop(0), ignore_errors=True)
        return new

    async def post(self, url: str, path: str, body: Any, *, once: bool = False) -> tuple[int, Any]:
        """POST ``body`` to ``url + path`` with the retries of every call: ``(status, JSON or None)``.
        ``once``: a call the server may have acted on before the fault (joining the update group,
        receiving a bucket) is not sent again; its fault is an ``EngineError``."""
        if not once:
            return await self._call("POST", f"{url}{path}", body, self.update_timeout_s)
        try:
            return await self._once("POST", f"{url}{path}", body, self.update_timeout_s)
        except _Retry as e:
            raise EngineError(
                f"SGLang at {url}: {e} (not sent again: the server may have acted on it)"
            ) from e

    async def post_ok(self, url: str, path: str, body: dict[str, Any], *, once: bool = False) -> Any:
        """POST ``body``; ``EngineError`` with the server's message unless it answers 200 (and, where
        the answer has one, ``success: true``)."""
        status, data = await self.post(url, path, body, once=once)
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise EngineError(f"{url}{path} failed ({status}): {error_message(data, 'no message')}")
        return data

    async def post_all(self, path: str, body: dict[str, Any]) -> None:
        """``post_ok`` to every worker at once."""
        await asyncio.gather(*(self.post_ok(url, path, body) for url in await self.workers()))

    async def health(self) -> bool:
        """Whether the server answers ``/health`` with 200. SGLang's generates one token there and
        waits up to ``HEALTH_WAIT_S`` for the scheduler (at least a second): a busy server is slow
        to answer, not down."""
        try:
            status, _ = await self._once(
                "GET", f"{self.url}/health", None, self.connect_timeout_s + HEALTH_WAIT_S
            )
        except _Retry:
            return False
        return status == 200

    @property
    def update_group_name(self) -> str:
        """The name of the update group's latest join: SGLang's usual one first, then one per
        rejoin (SGLang keeps its groups by name; the store may still hold an old group's keys)."""
        from agentrl.rollout.sglang_sync import GROUP_NAME

        return GROUP_NAME if self.update_joins <= 1 else f"{GROUP_NAME}-{self.update_joins - 1}"

    async def leave_update_group(self) -> None:
        """The workers, then the trainer, leave the weight-update group (the next update joins anew)."""
        if self.update_group is None:
            return
        from agentrl.rollout.sglang_sync import leave_update_group

        for url in await self.workers():  # the servers leave first: they wait on the trainer's rank
            with contextlib.suppress(EngineError, _Retry):
                await self._once(
                    "POST",
                    f"{url}/destroy_weights_update_group",
                    {"group_name": self.update_group_name},
                    self.connect_timeout_s,
                )
        leave_update_group(self.update_group)
        self.update_group = None

    async def close(self) -> None:
        await self.leave_update_group()
        await self._close_http()
        if self.launcher is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.launcher.stop)
            self.launcher = None

    async def _close_http(self) -> None:
        """Close this event loop's HTTP session (after the aborts it still sends); the update group stays."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.connect_timeout_s)
        if self._session is not None:
            await self._session.close()
            self._session = None


def _next_version(version: str) -> str:
    """The version after ``version``: its trailing number plus one ("3" → "4", "step-7" → "step-8"),
    else ``-1`` appended (SGLang's default "default" → "default-1"), so names do not grow."""
    head = version.rstrip("0123456789")
    tail = version[len(head) :]
    return f"{head}{int(tail) + 1}" if tail else f"{version}-1"


def server_facts(url: str, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(/model_info, /server_info)`` of the server at ``url``, waiting up to ``timeout_s`` for it
    to answer ``/health`` (a server that is still loading its model); ``EngineError`` otherwise."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    break
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise EngineError(f"no SGLang server answers {url}/health after {timeout_s:g}s ({last})")
        time.sleep(0.5)

    def get(path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=30) as r:
                return json.loads(r.read())
        except (OSError, ValueError) as e:
            raise EngineError(f"{url}{path} did not answer with JSON: {e}") from e

    return get("/model_info"), get("/server_info")


def check_server(url: str, *, model_path: str | None, max_context: int, timeout_s: float) -> dict[str, Any]:
    """Stop with ``ConfigError`` when the server at ``url`` serves another model than ``model_path``
    (None: not checked) or holds fewer tokens than an episode may (``max_context``). Returns its
    ``/model_info``."""
    from agentrl.config import ConfigError

    try:
        info, server = server_facts(url, timeout_s)
    except EngineError as e:
        raise ConfigError(f"engine.url={url}: {e}; start one (agentrl serve local, or SGLang)") from None
    if model_path is not None and info.get("model_path") != model_path:
        raise ConfigError(
            f"engine.model_path={model_path!r}, but {url} serves {info.get('model_path')!r}; "
            "point engine.url at the right server or fix engine.model_path"
        )
    if not info.get("is_generation", True):
        raise ConfigError(
            f"engine.url={url} serves an embedding model ({info.get('model_path')}), not a generator"
        )
    limit = server.get("max_req_input_len")  # SGLang's scheduler reports it; older servers may not
    if not isinstance(limit, int):
        context = server.get("max_context_length") or server.get("context_length")
        limit = context - CONTEXT_RESERVE if isinstance(context, int) and context > 0 else None
    if limit is not None and max_context > limit:
        raise ConfigError(
            f"rollout.max_context={max_context}, but {url} takes inputs of fewer than {limit} tokens "
            f"(its max_req_input_len: the context length less {CONTEXT_RESERVE} it keeps, or less when "
            f"its KV cache is smaller); lower rollout.max_context to {limit} or start the server with "
            "a longer --context-length"
        )
    return info


def from_config(policy, cfg) -> SGLangEngine:
    """``engine.kind: sglang``: the client for ``engine.url``, checked against the run's config, the
    policy's weights pushed to it by disk (``engine.sync_on_start``) so that it serves what the
    trainer trains."""
    from agentrl.config import ConfigError

    e = cfg.engine
    try:
        check_sampling_keys(e.extra_sampling)  # before the server is asked anything
    except ContractError as err:
        raise ConfigError(f"engine.extra_sampling: {err}") from None
    url, abort_urls, launcher = e.url, e.abort_urls or None, None
    if e.launch.server != "none":
        model = e.launch.model
        if model is None:  # `local` serving the run's own policy: its shapes are the trainer's
            from agentrl.rollout.sglang_sync import write_checkpoint

            initial = cfg.run_dir / "engine_weights" / "initial"
            model = str(write_checkpoint(policy.state_dict(), initial, policy.config).resolve())
        launcher, url, workers = _launch(e.launch, model, cfg.run_dir / "engine_logs")
        abort_urls = abort_urls or workers
    try:
        info = check_server(
            url, model_path=e.model_path, max_context=cfg.rollout.max_context, timeout_s=e.startup_timeout_s
        )
    except ConfigError:
        if launcher is not None:
            launcher.stop()
        raise
    engine = SGLangEngine(
        url,
        request_timeout_s=e.request_timeout_s,
        connect_timeout_s=e.connect_timeout_s,
        retry_deadline_s=e.retry_deadline_s,
        extra_sampling=e.extra_sampling,
        abort_urls=abort_urls,
        sync_dir=Path(e.sync_dir) if e.sync_dir else cfg.run_dir / "engine_weights",
        model_config=getattr(policy, "config", None),
        weight_version=str(info.get("weight_version") or "0"),
        weight_sync=e.weight_sync,
        sync_master=e.sync_master,
        sync_backend=e.sync_backend,
        bucket_bytes=int(e.sync_bucket_mb * (1 << 20)),
        ranks_per_worker=e.ranks_per_worker,
    )
    engine.launcher = launcher
    if e.sync_on_start:
        try:
            _push(engine, policy.state_dict())
        except EngineError as err:  # most often a server of another model: other shapes or vocabulary
            if launcher is not None:
                launcher.stop()
            served = f"engine.launch.model={e.launch.model}" if e.launch.model else f"the server at {url}"
            raise ConfigError(
                f"{served} would not load the policy's weights ({' '.join(str(err).split())[:300]}): the server must serve "
                "a model of the policy's architecture and vocabulary; leave engine.launch.model unset "
                "(the run then serves its own policy), or start the server on a checkpoint of it "
                "(RUN/engine_weights/initial of a run with engine.launch.server=local)"
            ) from None
    return engine


def _launch(launch, model: str, default_log_dir: Path):
    """Start ``engine.launch``'s servers; ``(launcher, url, worker urls)``. Stopped by the engine's
    ``close``, or at exit should the run end without it."""
    import atexit

    from agentrl.rollout.sglang_launch import Launcher, local_plan, sglang_plan

    if launch.server == "local":
        plan = local_plan(model, host=launch.host, port=launch.port)
    else:
        plan = sglang_plan(
            model,
            tp=launch.tp,
            dp=launch.dp,
            servers=launch.servers,
            host=launch.host,
            port=launch.port,
        )
    from agentrl.config import ConfigError

    launcher = Launcher(plan, launch.log_dir or default_log_dir)
    atexit.register(launcher.stop)
    try:
        launcher.start(launch.timeout_s)
    except RuntimeError as e:
        launcher.stop()
        raise ConfigError(f"engine.launch.server={launch.server}: {e}") from None
    return launcher, plan[-1].url, [p.url for p in plan if p.name != "router"]


def _push(engine: SGLangEngine, state_dict: dict[str, Any]) -> None:
    """``engine.update_weights(state_dict)`` from synchronous code, in a loop of its own on a thread
    (the caller may be inside a running loop)."""
    import concurrent.futures

    async def push():
        try:
            return await engine.update_weights(state_dict)
        finally:
            await engine._close_http()  # its session belongs to this loop; the update group is kept

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, push()).result()
