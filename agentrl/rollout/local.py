"""The embedded engine: a Hugging Face causal LM in this process (CPU or one GPU), batching concurrent requests.

Requests that arrive together (within ``batch_wait_s`` of each other, up to ``max_batch_size``)
are decoded together: left-padded, one forward per step with a KV cache preallocated for the
batch's longest answer (written in place, not concatenated at every step). A request that
finishes leaves the batch (its rows of the cache dropped) once an eighth of the rows have
finished, so the rest decode as a smaller batch. A request whose caller stops waiting (a cancelled
task: an abort) finishes at the next step and leaves the batch like a finished one; a batch whose
requests are all cancelled stops there. Requests that arrive while a batch runs wait
for the next one. The model runs on a worker thread, so the event loop
keeps stepping environments meanwhile. Log-probs follow SGLang's definition (see
``agentrl.rollout.engine``); sampling applies top-k and top-p after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from agentrl.rollout.engine import EngineError, Generation, SamplingParams


@dataclass
class _Request:
    input_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    cancelled: threading.Event
    """Set (on the event loop) when ``future`` is cancelled; read by the decoding thread between steps."""


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


def _sample(
    scaled: torch.Tensor, lps: torch.Tensor, params: list[SamplingParams], generators
) -> torch.Tensor:
    """One token per row: the argmax for temperature 0, else a draw from the top-k / top-p filtered
    distribution with the row's own generator (the exponential race ``argmax(p / q)``, q ~ Exp(1),
    that ``torch.multinomial`` runs for one sample), batched over the rows."""
    tokens = lps.argmax(-1)
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if rows:
        logits = scaled[rows]
        for k, i in enumerate(rows):
            if params[i].top_k or params[i].top_p < 1.0:
                logits[k] = _filter(logits[k], params[i].top_k, params[i].top_p)
        probs = torch.softmax(logits, -1)
        race = torch.empty_like(probs)
        for k, i in enumerate(rows):
            race[k].exponential_(generator=generators[i])
        tokens[rows] = (probs / race).argmax(-1)
    return tokens


class _PreallocatedLayer:
    """A layer's KV cache in one buffer with room for ``reserve`` more tokens after the prompt: each
    decode step writes its token in place and attends over a view, where the default cache copies
    the whole cache (``torch.cat``) at every step."""

    def __init__(self, reserve: int):
        self.reserve, self.length = reserve, 0
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[-2]
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            grown = []
            for new, old in zip((keys, values), self.buffers or (None, None), strict=True):
                shape = (*new.shape[:2], end + self.reserve, new.shape[-1])
                buffer = new.new_empty(shape)
                if old is not None:
                    buffer[:, :, : self.length] = old[:, :, : self.length]
                grown.append(buffer)
            self.buffers = (grown[0], grown[1])
        for buffer, new in zip(self.buffers, (keys, values), strict=True):
            buffer[:, :, self.length : end] = new
        self.length = end
        return self.buffers[0][:, :, :end], self.buffers[1][:, :, :end]

    def select(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.buffers = (self.buffers[0][index], self.buffers[1][index])
        return self.buffers[0][:, :, : self.length], self.buffers[1][:, :, : self.length]


def _preallocated_cache(config, reserve: int):
    """A ``transformers`` cache whose full-attention layers write into preallocated buffers, or None
    (the model's default cache) where this ``transformers`` has no per-layer cache objects."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None

    class Layer(DynamicLayer):
        def __init__(self):
            super().__init__()
            self.store = _PreallocatedLayer(reserve)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = self.store(key_states, value_states)
            return self.keys, self.values

        def batch_select_indices(self, indices):
            if self.store.buffers is not None:
                self.keys, self.values = self.store.select(indices)

    try:
        cache = DynamicCache(config=config)
    except TypeError:
        return None
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:  # sliding-window and other layer kinds keep their own
            layers[i] = Layer()
    return cache


class LocalEngine:
    """An ``Engine`` over an in-process ``transformers`` model."""

    def __init__(
        self,
        model,
        *,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.002,
        pad_token_id: int | None = None,
        preallocate_cache: bool = True,
        drop_finished: bool = True,
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
        self.preallocate_cache, self.drop_finished = preallocate_cache, drop_finished
        self.weight_version = "0"
        self.stats = {"batches": 0, "requests": 0, "tokens": 0, "max_batch": 0, "row_steps": 0}
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
        cancelled = threading.Event()
        future.add_done_callback(lambda f: cancelled.set() if f.cancelled() else None)
        self._pending.append(_Request(list(input_ids), params, future, cancelled))
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
                    batch = [r for r in batch if not r.future.done()]  # cancelled while the lock was held
                    if not batch:
                        continue
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
        steps = max(r.params.max_new_tokens for r in batch)
        temperature = torch.tensor([r.params.temperature or 1.0 for r in batch], device=self.device)
        generators = [
            None if r.params.seed is None else torch.Generator(device=self.device).manual_seed(r.params.seed)
            for r in batch
        ]
        outputs: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        reasons: list[str | None] = [None] * n
        live = list(range(n))  # the batch's requests that the model's rows stand for, in order
        cache = _preallocated_cache(self.model.config, steps) if self.preallocate_cache else None
        step_ids = ids
        for _ in range(steps):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
            cache = getattr(out, self._cache_arg)
            self.stats["row_steps"] += len(live)  # rows the model ran this step
            scaled = out.logits[:, -1, :].float() / temperature[live][:, None]
            lps = torch.log_softmax(scaled, -1)
            tokens = _sample(scaled, lps, [batch[b].params for b in live], [generators[b] for b in live])
            chosen = lps.gather(1, tokens[:, None]).squeeze(1).tolist()
            next_ids = tokens.tolist()
            for row, b in enumerate(live):
                if reasons[b] is not None:  # finished, its row not yet dropped: its token is ignored
                    continue
                p, token = batch[b].params, next_ids[row]
                outputs[b].append(token)
                logprobs[b].append(chosen[row])
                if token in p.stop_token_ids:
                    reasons[b] = "stop"
                elif len(outputs[b]) >= p.max_new_tokens:
                    reasons[b] = "length"
                elif batch[b].cancelled.is_set():  # nobody waits for it: its row stops here
                    reasons[b] = "abort"
            keep = [row for row, b in enumerate(live) if reasons[b] is None]
            if not keep:
                break
            step_ids = tokens[:, None]
            positions = positions[:, -1:] + 1
            attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
            # Finished rows leave the batch once they are an eighth of it: a copy of the cache then
            # buys every later step a smaller batch.
            if self.drop_finished and len(live) - len(keep) >= max(1, len(live) // 8):
                index = torch.tensor(keep, device=self.device)
                live = [live[row] for row in keep]
                step_ids, positions, attention = step_ids[index], positions[index], attention[index]
                cache.batch_select_indices(index)
        self.stats["tokens"] += sum(len(o) for o in outputs)
        return [
            Generation(o, lp, reason or "length", self.weight_version)
            for o, lp, reason in zip(outputs, logprobs, reasons, strict=True)
        ]

    async def update_weights(
        self,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: str | None = None,
        *,
        path: str | None = None,
    ) -> str:
        """Swap in new weights between batches, from ``state_dict`` or from ``path`` (a state-dict
        file, or a Hugging Face model directory's safetensors); returns the new weight version."""
        if (state_dict is None) == (path is None):
            raise ValueError("update_weights takes a state_dict or a path, one of them")
        if path is not None:
            state_dict = _read_weights(path)
        self._ensure_worker()
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._load, state_dict)
            self.weight_version = version or str(int(self.weight_version) + 1)
        return self.weight_version

    async def assign(self, tensors: dict[str, torch.Tensor], version: str | None = None) -> str:
        """Copy ``tensors`` (some of the model's parameters or buffers, by name) into the served model
        between batches, as a bucket of a weight update by broadcast arrives; ``version``, when given,
        names the weights from then on. Returns the version served."""
        self._ensure_worker()
        async with self._lock:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._assign, tensors)
            if version is not None:
                self.weight_version = version
        return self.weight_version

    @torch.no_grad()
    def _assign(self, tensors: dict[str, torch.Tensor]) -> None:
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        unknown = [k for k in tensors if k not in named]
        if unknown:
            raise KeyError(f"the served model has no tensors named {unknown[:5]}")
        wrong = [
            f"{k} {list(v.shape)} (served: {list(named[k].shape)})"
            for k, v in tensors.items()
            if v.shape != named[k].shape
        ]
        if wrong:  # checked before any is copied: the bucket lands whole or not at all
            raise ValueError(f"tensors of another shape than the served model's: {', '.join(wrong[:5])}")
        for name, value in tensors.items():
            named[name].copy_(value)

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        # Checked whole before a tensor is copied: torch's load_state_dict copies every tensor that
        # fits before it reports those that do not, which would leave the served model half replaced.
        # A saved model with tied weights holds one of each tied group (safetensors drops the
        # others, e.g. an output head tied to the embedding): loading it sets the whole group.
        served = self.model.state_dict()
        groups: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        tied = {n for names in groups.values() if any(m in state_dict for m in names) for n in names}
        absent = [k for k in served if k not in state_dict and k not in tied]
        unexpected = [k for k in state_dict if k not in served]
        if absent or unexpected:
            raise RuntimeError(
                f"the weights do not fit the served model: missing {absent[:5]}, unexpected {unexpected[:5]}"
            )
        for name, value in state_dict.items():
            if value.shape != served[name].shape:
                raise RuntimeError(
                    f"the weights do not fit the served model: {name} is {list(value.shape)} where the "
                    f"served model's is {list(served[name].shape)}"
                )
        self.model.load_state_dict(state_dict, strict=False)

    async def health(self) -> bool:
        return self._worker is None or not self._worker.done()

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._thread.shutdown(wait=False)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        from safetensors.torch import load_file

        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors weights")
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    return torch.load(p, map_location="cpu", weights_only=True)


def from_config(policy, cfg) -> LocalEngine:
    """``engine.kind: local``: the embedded engine over its own copy of the policy's weights (synced
    from the trainer after every update), held in bf16 where the trainer computes in bf16
    (``model.dtype``; ``auto`` on CUDA), as an inference server holds them."""
    import copy

    from agentrl.device import resolve_dtype

    served = copy.deepcopy(policy).eval()
    if resolve_dtype(cfg.model.dtype, next(policy.parameters()).device) == "bfloat16":
        served.to(torch.bfloat16)  # weight updates from the trainer's fp32 copy are cast on load
    if hasattr(served, "set_attn_implementation"):
        served.set_attn_implementation("sdpa")  # decoding with a KV cache: whatever the trainer packs with
    return LocalEngine(served)
