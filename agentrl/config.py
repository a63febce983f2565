"""Typed configs from YAML plus ``key.sub=value`` overrides.

One YAML file per recipe, validated by the pydantic models below: an unknown key is rejected with
the closest valid key, a bad value names the field and what is allowed. Derived values are computed
once, after loading (``TrainConfig.derived``). ``make_env`` and ``writable_dir`` check, before any
model loads or episode runs, that the environment settings build an environment and that an
output directory can be written.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A bad config file, key or value; the message says which and what is allowed."""


class Section(BaseModel):
    # Each field's docstring is its description: `agentrl config RECIPE` prints it, and a test
    # fails when a field has none.
    # (inf and NaN are no setting's value: a number that is not finite is refused where it is read)
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )


def _registered(value: str, registry: Any) -> str:
    registry.check(value)  # unknown: the closest registered name, and every one
    return value


class RunConfig(Section):
    name: str = "run"
    """Name of the run; outputs go to ``output_dir/name``."""
    output_dir: str = "runs"
    """Directory that holds the runs' directories."""
    seed: int = 0
    """Seed of the model's initial weights, the task order and the rollouts' sampling."""
    iterations: int = Field(20, ge=1)
    """PPO iterations (collect, then update)."""
    resume: bool = False
    """Continue from the last complete checkpoint of this run. The iterations after it are redone:
    their lines of ``metrics.jsonl`` are dropped and their stored episodes moved out of the store,
    to ``trajectories/*.superseded``."""
    overwrite: bool = False
    """Start afresh in a run directory that holds a training run, deleting that run's outputs
    (metrics, checkpoints, episodes, warm start, summary). Without it (and without ``resume``), a
    run that finds another in its directory stops rather than mix with it."""
    checkpoint_every: int = Field(1, ge=1)
    """Save a checkpoint every N iterations (and after the last)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy, critic and embedded engine run: ``cuda`` (a GPU; an error where there is
    none), ``cpu``, or ``auto`` (CUDA when there is one). ``trainer.backend: megatron`` trains on
    the GPU wherever there is one: ``cpu`` there stops the run."""

    @field_validator("name")
    @classmethod
    def _inside_output_dir(cls, name: str) -> str:
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or any(p in (".", "..") for p in parts):
            raise ValueError(
                f"must name a directory inside run.output_dir, with no '..' or '.' and not absolute "
                f"(got {name!r}): the run writes, and run.overwrite deletes, its outputs there"
            )
        return name


class EnvConfig(Section):
    id: str = "bugfix-v0"
    """Registered environment id (``agentrl envs`` lists them)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for ``make(id, ...)``. The sandbox and the turn limit are not among them:
    they come from ``sandbox.kind`` and ``rollout.max_turns``."""
    train_split: str = "train"
    """Split of the environment's tasks that training draws from."""
    eval_split: str = "test"
    """Split of held-out tasks for evaluation."""
    train_tasks: int | None = Field(None, ge=1)
    """Training tasks the data cursor walks through (then wraps, reshuffled): the first N of
    ``train_split``; None: all of them. More than the split holds is an error."""
    eval_tasks: int | None = Field(None, ge=0)
    """Held-out tasks measured before and after training (and every ``metrics.eval_every``): the first
    N of ``eval_split``; None: 32, or all when the split holds fewer. 0: no evaluation."""


class DockerHostsConfig(Section):
    hosts: list[str] = Field(default_factory=list)
    """Docker daemons to spread sandboxes over (``unix:///var/run/docker.sock``, ``ssh://user@host``,
    ``tcp://host:2376``): each sandbox starts on the one with the fewest of this run's sandboxes, and
    a daemon that fails its health check is skipped and tried again later. Empty: the local daemon
    (or ``DOCKER_HOST``)."""

    @field_validator("hosts")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        bad = [h for h in value if "://" not in h]
        if bad:
            raise ValueError(
                f"sandbox.docker.hosts needs daemon URLs like unix:///var/run/docker.sock; got {bad}"
            )
        return value


class SandboxConfig(Section):
    kind: str = "auto"
    """Where agent commands run: ``docker``, ``local`` (bubblewrap), or ``auto`` (Docker when an engine
    with the base image answers, else bubblewrap, else an error naming the opt-in for none)."""
    docker: DockerHostsConfig = Field(default_factory=DockerHostsConfig)
    """Settings of the Docker backend for every sandbox of the run."""

    @field_validator("kind")
    @classmethod
    def _known(cls, value: str) -> str:
        from agentrl.sandbox import KINDS

        if value not in KINDS:
            close = difflib.get_close_matches(value, KINDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown sandbox.kind {value!r}.{hint} Known: {', '.join(KINDS)}")
        return value


class ModelConfig(Section):
    name: str = "tiny"
    """``tiny`` | ``smollm2`` | a local Hugging Face model directory."""
    tiny_hidden: int = Field(64, ge=8, multiple_of=8)
    """Hidden size of the tiny random model (``name: tiny``): a multiple of 8, its 4 heads each of
    an even size."""
    tiny_layers: int = Field(2, ge=1)
    """Layers of the tiny random model (``name: tiny``)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    """Compute precision of training (bf16 autocast); ``auto``: bfloat16 on CUDA, float32 on CPU."""
    init: str | None = None
    """Policy weights to start from: a state-dict file (e.g. another run's ``warm_start.pt``) or a run's
    checkpoint directory (``runs/<name>/checkpoints/iter-000006``: its actor)."""


class EngineLaunchConfig(Section):
    server: Literal["none", "sglang", "local"] = "none"
    """``engine.kind: sglang`` only: servers the run starts and stops itself, in place of ``engine.url``:
    ``sglang`` (``python -m sglang.launch_server`` per server, ``sglang_router`` in front of several:
    ``agentrl serve sglang``), ``local`` (``agentrl serve local``, one server), or ``none`` (connect
    to ``engine.url``)."""
    model: str | None = None
    """The model the servers load: a path or id for SGLang; for ``local``, ``tiny``, ``smollm2`` or a
    directory, and None: the run's own policy (written as a checkpoint under ``run_dir/engine_weights``),
    so that its shapes are the trainer's. A named model must be the policy's architecture and
    vocabulary (``tiny`` is not a tiny policy of the run's: its tokenizer is trained on other text);
    a run whose server would not load the policy stops at start with a message."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel GPUs per SGLang server."""
    dp: int = Field(1, ge=1)
    """Data-parallel replicas per SGLang server."""
    servers: int = Field(1, ge=1)
    """SGLang servers; more than one get a router in front of them."""
    host: str = "127.0.0.1"
    """Address the servers (and router) listen on."""
    port: int = Field(30000, ge=1, le=65535)
    """Port of the server, or of the router in front of several (servers take the ports after it)."""
    log_dir: str | None = None
    """One log file per process here; None: ``run_dir/engine_logs``."""
    timeout_s: float = Field(1800.0, gt=0)
    """Seconds to wait for every server to generate (``/health_generate``) before the run stops."""

    @model_validator(mode="after")
    def _complete(self) -> EngineLaunchConfig:
        if self.server == "sglang" and not self.model:
            raise ValueError(
                f"engine.launch.server={self.server} needs engine.launch.model, the model to serve"
            )
        if self.server == "local" and self.servers != 1:
            raise ValueError("engine.launch.server=local starts one server; set engine.launch.servers=1")
        if self.servers > 1 and self.port + self.servers > 65535:
            raise ValueError(
                f"engine.launch.servers={self.servers} take the ports after engine.launch.port={self.port}, "
                f"up to {self.port + self.servers}, past 65535: set a lower engine.launch.port"
            )
        return self


class EngineConfig(Section):
    kind: str = "local"
    """Inference engine that serves the policy to the rollouts: ``local`` (in-process transformers,
    batched) or ``sglang`` (an HTTP client to SGLang, its router, or ``agentrl serve local`` at
    ``engine.url``). Engines are registered in ``agentrl.registry.ENGINES``."""
    url: str | None = None
    """``sglang``: base URL of the server or router (``http://127.0.0.1:30000``); required there unless
    ``engine.launch`` starts the servers."""
    launch: EngineLaunchConfig = Field(default_factory=EngineLaunchConfig)
    """``sglang``: servers the run starts itself (and stops when it ends)."""
    model_path: str | None = None
    """``sglang``: the model path the server must report in ``/model_info`` (None: not checked). The
    run stops at start when they differ."""
    request_timeout_s: float = Field(600.0, gt=0)
    """``sglang``: seconds one ``/generate`` attempt may take before it is retried."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """``sglang``: seconds to open a connection (and to wait for ``/health`` and ``/abort_request``)."""
    retry_deadline_s: float = Field(120.0, gt=0)
    """``sglang``: seconds one call keeps retrying refused or reset connections, timeouts, 502/503/504
    and truncated bodies (exponential backoff with jitter) before the engine is asked ``/health``."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """``sglang``: seconds to wait at start for the server to answer ``/health`` (it may be loading)."""
    extra_sampling: dict[str, Any] = Field(default_factory=dict)
    """``sglang``: more ``sampling_params`` keys sent with every request (e.g. ``min_p``); a key SGLang
    does not know is refused at start, with the valid ones."""
    abort_urls: list[str] = Field(default_factory=list)
    """``sglang``: the workers behind a router, which cancelled requests' ``/abort_request`` and weight
    updates go to (the router forwards neither); empty: the router's ``GET /workers``, else ``url``."""
    sync_dir: str | None = None
    """``sglang``: directory, readable by every server, where the trainer writes each weight update as
    a Hugging Face checkpoint for ``/update_weights_from_disk``; None: ``run_dir/engine_weights``."""
    sync_on_start: bool = True
    """``sglang``: push the policy's weights to the server when the run starts, so that it serves
    exactly what the trainer trains (off: the server keeps the weights it was started with)."""
    weight_sync: Literal["disk", "distributed"] = "disk"
    """``sglang``: how new weights reach the servers: ``disk`` (a checkpoint under ``sync_dir``, loaded
    with ``/update_weights_from_disk``) or ``distributed`` (broadcast over an update group that the
    trainer and every worker rank join: pause, begin, one call per bucket, end, flush, continue)."""
    sync_master: str = "127.0.0.1:29600"
    """``sglang``, ``distributed``: ``address:port`` where the trainer hosts the update group's store;
    every worker must reach it."""
    sync_backend: Literal["nccl", "gloo"] = "nccl"
    """``sglang``, ``distributed``: the update group's backend (``nccl`` between GPUs; ``gloo`` on CPUs)."""
    sync_bucket_mb: float = Field(512.0, gt=0)
    """``sglang``, ``distributed``: megabytes of tensors per ``/update_weights_from_distributed`` call."""
    ranks_per_worker: int = Field(1, ge=1)
    """``sglang``, ``distributed``: ranks one server adds to the update group: its tensor-parallel
    size (SGLang joins each TP rank as ``rank_offset + tp_rank`` and takes no data-parallel replicas
    here). Set from ``engine.launch.tp`` when the run starts its servers."""

    @field_validator("kind")
    @classmethod
    def _known(cls, value: str) -> str:
        from agentrl.registry import ENGINES

        return _registered(value, ENGINES)

    @field_validator("sync_master")
    @classmethod
    def _address_and_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not ADDRESS:PORT (a port from 1 to 65535); e.g. 10.0.0.5:29600")
        return value

    @model_validator(mode="after")
    def _url(self) -> EngineConfig:
        if self.weight_sync == "distributed" and self.launch.server == "sglang":
            if self.launch.dp > 1:
                raise ValueError(
                    f"engine.launch.dp={self.launch.dp} with engine.weight_sync=distributed: SGLang updates "
                    "weights over a group only without data-parallel replicas; use engine.launch.servers="
                    f"{self.launch.dp * self.launch.servers} with dp 1 (a router in front), or weight_sync=disk"
                )
            if "ranks_per_worker" not in self.model_fields_set:
                self.ranks_per_worker = self.launch.tp
            elif self.ranks_per_worker != self.launch.tp:
                raise ValueError(
                    f"engine.ranks_per_worker={self.ranks_per_worker}, but each server the run starts has "
                    f"engine.launch.tp={self.launch.tp} ranks in the update group; leave ranks_per_worker out"
                )
        if self.kind != "sglang" and self.launch.server != "none":
            raise ValueError(f"engine.launch is for engine.kind sglang; engine.kind is {self.kind}")
        if self.kind == "sglang":
            if self.launch.server != "none":
                if self.url:
                    raise ValueError(
                        f"engine.url={self.url} and engine.launch.server={self.launch.server}: the run either "
                        "starts its servers or connects to one; drop one of them"
                    )
                return self
            if not self.url:
                raise ValueError(
                    "engine.kind sglang needs engine.url, the server's base URL (e.g. "
                    "engine.url=http://127.0.0.1:30000; `agentrl serve local --model ...` starts one), "
                    "or engine.launch.server (sglang or local) to start its own"
                )
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"engine.url must start with http:// or https://; got {self.url!r}")
        return self


class MegatronConfig(Section):
    tp: int = Field(1, ge=1)
    """Tensor-parallel size: each layer's weights split over this many ranks (must divide the
    model's key/value heads and MLP width)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size: the layers split into this many stages (must divide the layer count)."""
    dp: int = Field(1, ge=1)
    """Data-parallel size: model replicas, each taking its share of every minibatch's rows.
    ``torchrun`` must start ``tp * pp * dp`` processes (one process alone: all three 1)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation, megatron-core's: ``selective`` recomputes each layer's core
    attention in the backward pass (what attention keeps is not kept: each row's ``[heads, s, s]``
    scores where the kernel stores them, as on CPU; a GPU's flash kernels keep little), ``full``
    recomputes whole layers from their inputs (the least memory, about one more forward pass per
    step). The same gradients either way."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: each data-parallel rank keeps Adam's moments for 1/dp of
    the weights, gradients are reduce-scattered and the updated weights all-gathered (ZeRO-1). The
    same step as the default (torch AdamW on every rank, gradients all-reduced) with less memory a
    rank; a checkpoint resumes only with the setting it was written with."""


class TrainerConfig(Section):
    backend: str = "torch"
    """Training backend: ``torch`` (PyTorch, one device) or ``megatron`` (megatron-core, tensor and
    data parallel under ``torchrun``; ``pip install agentrl[megatron]``). Backends are registered in
    ``agentrl.registry.BACKENDS``."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel sizes of the ``megatron`` backend."""

    @field_validator("backend")
    @classmethod
    def _known(cls, value: str) -> str:
        from agentrl.registry import BACKENDS

        return _registered(value, BACKENDS)


class RolloutConfig(Section):
    tasks_per_iteration: int = Field(16, ge=1)
    """Training tasks collected each iteration."""
    n_samples: int = Field(4, ge=1)
    """Episodes per task (group estimators need > 1)."""
    concurrency: int = Field(32, ge=1)
    """Episodes run at the same time."""
    max_turns: int = Field(8, ge=1)
    """Assistant turns before an episode ends with status ``max_turns`` (given to the environment
    too, when its factory takes ``max_turns``)."""
    max_context: int = Field(4096, ge=64)
    """Tokens one episode may hold (prompt, turns, observations)."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens one assistant turn may generate (clamped to what is left of ``max_context``)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy); log-probs are recomputed at it for training."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample among the likeliest tokens holding this much probability."""
    top_k: int = Field(-1, ge=-1)
    """Sample only among the k likeliest tokens; -1 (or 0) turns it off. Log-probs stay those of the
    temperature-scaled distribution before top-k / top-p (SGLang's definition), so training recomputes them."""
    tool_format: Literal["hermes", "glm"] = "hermes"
    """How the policy writes tool calls: ``hermes`` (Qwen, Hermes) or ``glm`` (GLM-4.5)."""
    deadline_s: float = Field(600.0, gt=0)
    """Wall-clock seconds one episode may take."""


class AlgoConfig(Section):
    estimator: Literal["gae", "grpo", "rloo"] = "gae"
    """Advantages: ``gae`` (learned critic, over the policy's tokens), or a group baseline
    (``grpo``: reward minus the group mean over its std; ``rloo``: leave-one-out mean)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount per trainable token."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    policy_loss: Literal["ppo", "gspo", "gmpo", "sapo"] = "ppo"
    """Policy loss: token-level clipped ``ppo``, sequence-level ``gspo``, geometric-mean ``gmpo``, soft-gated ``sapo``."""
    clip_low: float | None = Field(None, ge=0, lt=1)
    """Lower end of the ratio's clip band, ``1 - clip_low``. Unset: the loss's own, ``ppo`` 0.2,
    ``gspo`` 3e-4 (its ratio is a sequence's geometric mean: a far narrower band). ``gmpo`` clips
    the log-ratio at ±0.4 and ``sapo`` gates softly: they take no band."""
    clip_high: float | None = Field(None, ge=0)
    """Upper end of the band, ``1 + clip_high``. Unset: ``ppo`` 0.28 (clip-higher), ``gspo`` 4e-4."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound c > 1 (typically 3) on the loss of negative-advantage tokens, ``-c A``;
    ``ppo`` only. None: off."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] | None = None
    """How per-token losses are averaged over the batch. Unset: ``token-mean`` for ``ppo`` and
    ``sapo``; ``gspo`` and ``gmpo`` are sequence-level objectives and take only
    ``seq-mean-token-mean`` (a row's mean, then the mean over rows), as their papers define."""
    token_filter: Literal["icepop", "tis", "none"] = "icepop"
    """IcePop (drop tokens outside the band) or TIS (truncate the weight at ``icepop_high``)."""
    icepop_low: float = Field(0.5, ge=0, le=1)
    """IcePop's lower bound on the training/inference probability ratio."""
    icepop_high: float = Field(5.0, ge=1)
    """IcePop's upper bound on the ratio (TIS: the truncation)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL to the initial policy (k3, in the loss); 0 (off) by default, as IcePop bounds the
    mismatch. As with GRPO's, the k3 term's value estimates KL(policy || reference), but its
    gradient in expectation is that of KL(reference || policy)."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the old values (None: unclipped)."""
    normalize_advantages: bool = True
    """Whiten GAE's advantages over the trainable tokens of the batch. Group estimators are already
    normalised within their groups and are not whitened again: a batch-wide shift would give the
    samples of a group that all earned the same reward a nonzero advantage."""
    critic_warmup: int = Field(0, ge=0)
    """Iterations that train only the critic (``gae``; group estimators have no critic)."""

    @model_validator(mode="after")
    def _used_by_the_loss(self) -> AlgoConfig:
        """A setting the chosen policy loss would ignore stops the run, rather than be dropped silently."""
        band = (
            "it clips the log-ratio at ±0.4"
            if self.policy_loss == "gmpo"
            else "its gate is soft, with no band"
        )
        why = {
            "clip_low": band,
            "clip_high": band,
            "dual_clip": "dual-clip bounds ppo's token loss",
            "agg": "it averages each row's tokens, then the rows (seq-mean-token-mean), as its paper defines",
        }
        unused = []
        if self.policy_loss in ("gmpo", "sapo"):
            unused += [f for f in ("clip_low", "clip_high") if getattr(self, f) is not None]
        if self.policy_loss != "ppo" and self.dual_clip is not None:
            unused.append("dual_clip")
        if self.policy_loss in ("gspo", "gmpo") and self.agg not in (None, "seq-mean-token-mean"):
            unused.append("agg")
        if unused:
            raise ValueError(
                f"policy_loss {self.policy_loss} does not use "
                + "; ".join(f"algo.{f}={getattr(self, f)} ({why[f]})" for f in unused)
                + ": remove it, or choose a policy_loss that uses it"
            )
        return self

    @property
    def critic(self) -> bool:
        """Whether the run trains a value model: only GAE reads one."""
        return self.estimator == "gae"


class OptimConfig(Section):
    actor_lr: float = Field(1e-4, gt=0)
    """Learning rate of the policy (AdamW)."""
    critic_lr: float = Field(1e-4, gt=0)
    """Learning rate of the value model (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (actor and critic)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon (actor and critic). Adam moves every weight by about the learning rate
    whatever its gradient's size; a larger epsilon damps the weights whose gradients are smaller
    than it (mostly noise on a small RL batch)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after the warm-up."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    critic_epochs: int | None = Field(None, ge=1)
    """Passes of the critic over each batch (None: ``epochs``). A value model trained from the
    policy's weights needs more steps than the actor before its values carry information."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per epoch."""
    micro_token_budget: int = Field(8192, ge=64)
    """Tokens in one forward/backward (gradient accumulation above it)."""
    packing: Literal["padded", "packed"] = "padded"
    """``packed``: rows concatenated into one sequence, each attending only to itself (see
    ``attention``); ``padded``: length-bucketed rows, each micro-batch padded to its own longest."""
    attention: Literal["auto", "dense", "flex", "varlen"] = "auto"
    """How packed rows keep to themselves: ``flex`` (FlexAttention, a document mask), ``varlen``
    (flash-attn's variable-length kernel; bf16 only), ``dense`` (a ``[T, T]`` mask; the CPU
    reference); ``auto``: varlen on CUDA with flash-attn installed and bf16, else flex on CUDA,
    dense on CPU."""
    logprob_chunk: int = Field(1024, ge=16)
    """Vocabulary rows per chunk of the log-prob computation (the ``[tokens, vocab]`` logits are never whole)."""


class SFTConfig(Section):
    episodes: int = Field(0, ge=0)
    """Demonstration episodes (the environment's ``demonstration(task)``, played through the real
    loop on training tasks past the first ``env.train_tasks``, wrapping round to the split's first
    tasks, the ones RL draws from, when the split holds no more) for a supervised warm start (0: none)."""
    from_store: str | None = None
    """Also warm-start on the solved episodes of a trajectory store (e.g. one ``agentrl rollout`` wrote
    with the same model): those of tasks of this environment's training split, without replay
    branches, duplicates or episodes whose turns this run's tokenizer reads as other text (made with
    another tokenizer); the log counts what was left out. None: none."""
    epochs: int = Field(3, ge=1)
    """Passes over the warm start's episodes."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the warm start (AdamW)."""
    batch_size: int = Field(8, ge=1)
    """Episodes per optimizer step."""


class MetricsConfig(Section):
    tensorboard: bool = True
    """Also write TensorBoard events when ``tensorboard`` is installed."""
    wandb: bool = False
    """Also log to Weights & Biases when ``wandb`` is installed."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode (offline: files only, synced later)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on held-out tasks every N iterations (0: only before and after)."""
    eval_samples: int = Field(0, ge=0)
    """Also sample each held-out task N times at ``rollout.temperature`` and log the mean success
    (``eval_success_sampled``) and pass@N (``eval_pass_at_n``) beside greedy success. Greedy success
    on a few dozen tasks moves by a task whenever one near-tie flips; the sampled mean has far less
    noise, and every evaluation of a run draws the same random numbers, so before/after differences
    are not sampling luck. 0: greedy only."""
    progress: bool = True
    """Print a progress line while rollouts run."""


class DebugConfig(Section):
    token_stats_every: int = Field(0, ge=0)
    """Every N-th iteration, from the first (iterations 0, N, 2N, ...; 0: never), store what the
    trainer computed for each token of the
    iteration's trained episodes beside the trajectories (``RUN/token_stats/``): its log-probs, the
    IcePop / TIS weight, the advantage, the value. ``agentrl replay --id ID --html`` colours tokens by
    them. Costs about 0.2 s and 0.5 MB per 100k tokens on 2 CPU cores, less than storing the
    trajectories themselves (``benchmarks/token_stats.py``; ``debug/token_stats_s`` in the metrics)."""


class CollectConfig(Section):
    split: str | None = None
    """Split the episodes' tasks come from (None: ``env.train_split``)."""
    tasks: int = Field(8, ge=1)
    """Tasks to collect (each ``rollout.n_samples`` times)."""
    first_task: int = Field(0, ge=0)
    """Index of the first task in the split."""
    store: str | None = None
    """Directory of the trajectory store (created, or appended to); None: ``run.output_dir/run.name/trajectories``."""


class TrainConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """The run: name, outputs, seed, iterations, checkpoints, device."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment and its task splits."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where agent commands run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The inference engine."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The training backend."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Collecting episodes: tasks, samples, turn and token budgets, sampling."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The RL algorithm: advantages, policy loss, token filter."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizers and batching of the updates."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """The supervised warm start."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Logging and evaluation."""
    debug: DebugConfig = Field(default_factory=DebugConfig)
    """What a run records only to debug it."""
    collect: CollectConfig = Field(default_factory=CollectConfig)
    """``agentrl rollout`` only: which tasks to collect episodes of, and where to store them."""

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.algo.estimator in ("grpo", "rloo") and self.rollout.n_samples < 2:
            raise ValueError(
                f"estimator {self.algo.estimator} needs rollout.n_samples >= 2 (a group baseline)"
            )
        if self.run.resume and self.run.overwrite:
            raise ValueError(
                "run.resume=true continues the run in the directory and run.overwrite=true deletes it: "
                "set one of them"
            )
        if not self.algo.critic and self.algo.critic_warmup:
            raise ValueError(
                f"algo.critic_warmup={self.algo.critic_warmup} trains only the critic in the first "
                f"iterations, and estimator {self.algo.estimator} has none: set algo.critic_warmup=0"
            )
        if self.algo.policy_loss == "gmpo" and self.algo.critic:
            raise ValueError(
                "policy_loss gmpo clips each row's geometric-mean ratio by the sign of one advantage "
                "per sequence, and estimator gae gives one per token: use estimator grpo or rloo "
                "with gmpo, or policy_loss ppo, gspo or sapo with gae"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def _closest_key_message(error: dict, model: type[BaseModel]) -> str:
    loc = [str(p) for p in error["loc"]]
    where = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        section = model
        for part in loc[:-1]:
            field = section.model_fields.get(part)
            annotation = getattr(field, "annotation", None)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                section = annotation
        valid = sorted(section.model_fields)
        close = difflib.get_close_matches(loc[-1], valid, n=1)
        hint = f" Did you mean '{'.'.join([*loc[:-1], close[0]])}'?" if close else ""
        return f"unknown key '{where}'.{hint} Valid keys here: {', '.join(valid)}."
    if error["type"] == "value_error":  # a check of ours: its message says it all
        message = str(error["msg"]).removeprefix("Value error, ").rstrip(".") + "."
        return message if not loc else f"'{where}': {message}"
    given = error.get("input")
    if error["type"] == "string_type" and not isinstance(given, (dict, list)):
        # a file's unquoted 1.10, 007, yes or null is YAML for a number, a bool or nothing
        return f"'{where}': {error['msg']} (got {given!r}); write the text in quotes."
    return f"'{where}': {error['msg']} (got {given!r})."


def describe(cfg: BaseModel, prefix: str = "") -> list[str]:
    """``agentrl config``: every field of ``cfg`` as ``key = value`` with its description, and its
    default where the value differs from it, section by section."""
    lines = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        key = f"{prefix}{name}"
        text = " ".join((field.description or "").split())
        if isinstance(value, BaseModel):
            lines += ["", f"[{key}]  {text}"] + describe(value, f"{key}.")
            continue
        default = field.get_default(call_default_factory=True)
        changed = f"  (default: {default!r})" if value != default else ""
        lines.append(f"{key} = {value!r}{changed}\n    {text}")
    return lines


def reference() -> str:
    """``docs/config.md`` (``make docs``): every section and field of ``TrainConfig`` with its type,
    default and description, generated from the models so that it cannot drift from them."""

    def type_name(annotation: Any) -> str:
        text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
        text = text or str(annotation).replace("typing.", "")
        return text.replace("NoneType", "None").replace("Literal", "one of ")

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    out = [
        "# Config reference",
        "",
        "Every setting of a recipe (`agentrl train`, `agentrl rollout`, `agentrl eval`), section by",
        "section: its type, its default and what it does. Generated from `agentrl/config.py` by",
        "`make docs`; a test fails when this file is out of date. `agentrl config RECIPE [key=value ...]`",
        "prints a recipe's resolved values with the same descriptions. Override any field on the",
        "command line as `section.field=value` (values are YAML, but a text field keeps the text as",
        "given: `model.name=1.10` is the name 1.10).",
    ]
    for name, section in TrainConfig.model_fields.items():
        model = section.annotation
        out += ["", f"## `{name}`", "", cell(section.description or ""), ""]
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        rows = [(f"{name}.{k}", f) for k, f in model.model_fields.items()]
        while rows:
            key, field = rows.pop(0)
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                # a nested section: its own fields, under its key
                rows[:0] = [(f"{key}.{k}", f) for k, f in field.annotation.model_fields.items()]
                continue
            default = field.get_default(call_default_factory=True)
            out.append(
                f"| `{key}` | `{cell(type_name(field.annotation))}` | `{default!r}` | "
                f"{cell(field.description or '')} |"
            )
    return "\n".join(out) + "\n"


def _annotation(model: type[BaseModel] | None, keys: list[str]) -> Any:
    """The type of the field of ``model`` that ``keys`` name (through its sections), or None."""
    annotation: Any = model
    for name in keys:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(name)
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def read_settings(
    path: str | None, overrides: list[str] | tuple[str, ...] = (), model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """The mapping in a YAML file (optional) with ``key.sub=value`` overrides applied (values parsed as
    YAML). An override of a text field of ``model`` keeps its text where YAML reads another scalar
    (``model.name=1.10``, ``run.name=007``, ``run.name=yes``): the shell has already taken the quotes
    that YAML would need."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {path} does not exist; pass the path of a YAML file")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
            problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
            raise ConfigError(f"{where} is not valid YAML ({problem}); fix the file there") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}; pass a YAML file") from None
        if data is None:  # an empty file would silently train or collect with every default
            raise ConfigError(f"config file {path} holds no settings; write 'key: value' lines in it")
        if not isinstance(data, dict):
            kind = "list" if isinstance(data, list) else "scalar"
            raise ConfigError(
                f"config file {path} must hold a mapping of settings ('key: value' lines); "
                f"it holds a YAML {kind}: {str(data)[:60]}"
            )
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.actor_lr=3e-4)")
        target = data
        *parents, leaf = key.split(".")
        for parent in parents:
            if target.get(parent) is None:  # absent, or an empty section in the file
                target[parent] = {}
            target = target[parent]
            if not isinstance(target, dict):
                raise ConfigError(f"override {item!r}: {parent} is not a section, it holds {target!r}")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: {value!r} is not a YAML value ({getattr(e, 'problem', e)}); quote it"
            ) from None
        kind = _annotation(model, [*parents, leaf])
        # a text field keeps the text, but null still unsets an optional one
        unset = parsed is None and kind == str | None
        if kind in (str, str | None) and not isinstance(parsed, (str, dict, list)) and not unset:
            parsed = value
        target[leaf] = parsed
    return data


def load_config(
    model: type[BaseModel], path: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Any:
    """Load ``model`` from a YAML file and ``key.sub=value`` overrides; ``ConfigError`` on anything wrong."""
    return validate_settings(model, read_settings(path, overrides, model), path, overrides)


def validate_settings(
    model: type[BaseModel], data: Any, path: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Any:
    """``model`` from settings read from ``path`` (a name for messages) and ``overrides``; a
    ``ConfigError`` naming each bad key, its closest valid one, and where its value came from."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        messages = [_closest_key_message(err, model) for err in errors]
        # where the bad values came from: the command line's overrides, when each was set by one
        given = [_override_of(err["loc"], overrides) for err in errors]
        items = list(dict.fromkeys(g for g in given if g))
        named = f"the override{'s' * (len(items) > 1)} {', '.join(items)}"
        if items and all(given):
            where = f" ({named})"
        else:
            where = (f" in {path}" if path else "") + (f" and {named}" if items else "")
        raise ConfigError(f"invalid config{where}: " + " ".join(messages)) from None


def _override_of(loc: tuple, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The last override that set the key at ``loc`` (or a section above or below it), or None."""
    key = ".".join(str(p) for p in loc)
    found = None
    for item in overrides:
        name = item.partition("=")[0]
        if key and (name == key or key.startswith(name + ".") or name.startswith(key + ".")):
            found = item
    return found


def env_factory_params(env_id: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a registered environment's factory ({} when it cannot be read);
    ``ConfigError`` naming the id (and the closest registered one) or what failed to import."""
    from agentrl.env import spec

    try:
        entry = spec(env_id)
    except KeyError as e:  # the registry's message has the closest and the registered ids
        raise ConfigError(e.args[0]) from None
    module, _, attr = entry.entry_point.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"environment {env_id} cannot be loaded from {entry.entry_point} ({e}); install what it needs"
        ) from None
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return {}


def make_env(env_id: str, args: Any, key: str) -> Any:
    """``make(env_id, **args)`` where ``args`` is setting ``key``; ``ConfigError`` naming the id or the
    argument when the environment cannot be built. Called once before any model loads or episode runs."""
    from agentrl.env import make, spec
    from agentrl.sandbox import NoSandboxError

    if not isinstance(args, dict):
        raise ConfigError(f"{key} must be a mapping of keyword arguments for {env_id}; got {args!r}")
    params = env_factory_params(env_id)  # only to name a bad argument; the call is make()'s
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for name, value in args.items():
            if name not in params:
                close = difflib.get_close_matches(name, params, n=1)
                hint = f" Did you mean {key}.{close[0]}?" if close else ""
                raise ConfigError(
                    f"{key}.{name}={value!r}: environment {env_id} takes no argument {name!r}.{hint} "
                    f"It takes: {', '.join(params)}."
                )
    given = {**spec(env_id).defaults, **args}  # what make() passes: the registered defaults, then args
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [n for n, p in params.items() if p.kind in keyword and p.default is p.empty and n not in given]
    if missing:
        many = len(missing) > 1
        raise ConfigError(
            f"environment {env_id} needs the argument{'s' * many} {', '.join(missing)} (its env.args): "
            f"give {'them' if many else 'it'} with {key} '{{{missing[0]}: ...}}'"
        )
    try:
        return make(env_id, **args)
    except NoSandboxError as e:
        raise ConfigError(str(e)) from None
    except (TypeError, ValueError) as e:
        named = [k for k in args if re.search(rf"\b{re.escape(k)}\b", str(e))]
        what = ", ".join(f"{key}.{k}={args[k]!r}" for k in named) or f"{key} {args}"
        raise ConfigError(f"environment {env_id} rejects {what}: {e}; change that setting") from None


def writable_dir(path: str | Path, key: str) -> Path:
    """Create directory ``path`` (setting ``key``) and check that a file can be written in it, so that
    a bad output path stops a command before its work rather than after."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=p).close()
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot create or write in directory {path} ({e.strerror or e}); choose a writable one"
        ) from None
    return p
