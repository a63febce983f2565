"""The embedded engine: a Hugging Face causal LM in this process (CPU or one GPU), batching concurrent requests.

Requests that arrive together (within ``batch_wait_s`` of each other, up to ``max_batch_size``)
are decoded together: left-padded, one forward per step with a KV cache. Requests that arrive
while a batch runs wait for the next one. The model runs on a worker thread, so the event loop
keeps stepping environments meanwhile. Log-probs follow SGLang's definition (see
``agentrl.rollout.engine``); sampling applies top-k and top-p after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from agentrl.rollout.engine import EngineError, Generation, SamplingParams


@dataclass
class _Request:
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k and 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        remove = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # keep the token that crosses top_p
        scaled = scaled.clone()
        scaled[order[remove]] = float("-inf")
    return scaled


class LocalEngine:
    """An ``Engine`` over an in-process ``transformers`` model."""

    def __init__(
        self, model, *, max_batch_size: int = 64, batch_wait_s: float = 0.002, pad_token_id: int | None = None
    ):
        self.model = model.eval()
        # transformers 5 renamed the KV-cache argument (and output field) from past_key_values to cache.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.device = next(model.parameters()).device
        cfg = model.config
        self.pad_token_id = (
            pad_token_id if pad_token_id is not None else (cfg.pad_token_id or cfg.eos_token_id or 0)
        )
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.weight_version = "0"
        self.stats = {"batches": 0, "requests": 0, "tokens": 0, "max_batch": 0}
        self._pending: list[_Request] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-engine")
        self._failed: BaseException | None = None

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._lock = asyncio.Lock()
            self._worker = asyncio.get_running_loop().create_task(self._serve())

    async def generate(self, input_ids: list[int], params: SamplingParams) -> Generation:
        if not input_ids:
            raise EngineError("generate() needs at least one input token")
        self._ensure_worker()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(input_ids), params, future))
        self._wake.set()
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.batch_wait_s)  # let requests that arrive together join the batch
            batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
            del self._pending[: self.max_batch_size]
            if not self._pending:
                self._wake.clear()
            if not batch:
                continue
            try:
                async with self._lock:
                    results = await loop.run_in_executor(self._thread, self._decode, batch)
            except Exception as e:  # the model failed: every request of the batch learns why
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(EngineError(f"local engine failed: {e}"))
                continue
            for r, result in zip(batch, results, strict=True):
                if not r.future.done():
                    r.future.set_result(result)

    @torch.no_grad()
    def _decode(self, batch: list[_Request]) -> list[Generation]:
        n = len(batch)
        self.stats["batches"] += 1
        self.stats["requests"] += n
        self.stats["max_batch"] = max(self.stats["max_batch"], n)
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for b, r in enumerate(batch):
            ids[b, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
            attention[b, width - len(r.input_ids) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        generators = []
        for r in batch:
            g = None
            if r.params.seed is not None:
                g = torch.Generator(device=self.device).manual_seed(r.params.seed)
            generators.append(g)
        outputs: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        reasons: list[str | None] = [None] * n
        cache = None
        step_ids, step_positions = ids, positions
        for _ in range(max(r.params.max_new_tokens for r in batch)):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
            cache = getattr(out, self._cache_arg)
            logits = out.logits[:, -1, :].float()
            next_ids = []
            for b, r in enumerate(batch):
                if reasons[b] is not None:
                    next_ids.append(self.pad_token_id)
                    continue
                p = r.params
                if p.temperature == 0:
                    lp = torch.log_softmax(logits[b], -1)
                    token = int(lp.argmax())
                else:
                    scaled = logits[b] / p.temperature
                    lp = torch.log_softmax(scaled, -1)
                    probs = torch.softmax(_filter(scaled, p.top_k, p.top_p), -1)
                    token = int(torch.multinomial(probs, 1, generator=generators[b]))
                outputs[b].append(token)
                logprobs[b].append(float(lp[token]))
                if token in p.stop_token_ids:
                    reasons[b] = "stop"
                elif len(outputs[b]) >= p.max_new_tokens:
                    reasons[b] = "length"
                next_ids.append(token)
            if all(reason is not None for reason in reasons):
                break
            step_ids = torch.tensor(next_ids, device=self.device)[:, None]
            step_positions = step_positions[:, -1:] + 1
            attention = torch.cat(
                [attention, torch.ones((n, 1), dtype=attention.dtype, device=self.device)], dim=1
            )
        self.stats["tokens"] += sum(len(o) for o in outputs)
        return [
            Generation(o, lp, reason or "length", self.weight_version)
            for o, lp, reason in zip(outputs, logprobs, reasons, strict=True)
        ]

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: str | None = None) -> str:
        """Swap in new weights between batches; returns the new weight version."""
        self._ensure_worker()
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(
                self._thread, self.model.load_state_dict, state_dict
            )
            self.weight_version = version or str(int(self.weight_version) + 1)
        return self.weight_version

    async def health(self) -> bool:
        return self._worker is None or not self._worker.done()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._thread.shutdown(wait=False)
