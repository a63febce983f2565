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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A bad config file, key or value; the message says which and what is allowed."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "run"
    """Name of the run; outputs go to ``output_dir/name``."""
    output_dir: str = "runs"
    seed: int = 0
    iterations: int = Field(20, ge=1)
    """PPO iterations (collect, then update)."""
    resume: bool = False
    """Continue from the last complete checkpoint of this run."""
    checkpoint_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)


class EnvConfig(Section):
    id: str = "bugfix-v0"
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for ``make(id, ...)``."""
    train_split: str = "train"
    eval_split: str = "test"
    train_tasks: int = Field(512, ge=1)
    """Size of the training task set the data cursor walks through (then wraps, reshuffled)."""
    eval_tasks: int = Field(32, ge=0)
    """Held-out tasks measured before and after training (and every ``eval_every``)."""


class ModelConfig(Section):
    name: str = "tiny"
    """``tiny`` | ``smollm2`` | a local Hugging Face model directory."""
    tiny_hidden: int = Field(64, ge=8)
    tiny_layers: int = Field(2, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"
    init: str | None = None
    """Policy weights to start from: a state-dict file (e.g. another run's ``warm_start.pt``) or a run's
    checkpoint directory (``runs/<name>/checkpoints/iter-000006``: its actor)."""


class RolloutConfig(Section):
    tasks_per_iteration: int = Field(16, ge=1)
    n_samples: int = Field(4, ge=1)
    """Episodes per task (group estimators need > 1)."""
    concurrency: int = Field(32, ge=1)
    max_turns: int = Field(8, ge=1)
    max_context: int = Field(4096, ge=64)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """Sample only among the k likeliest tokens; -1 (or 0) turns it off. Log-probs stay those of the
    temperature-scaled distribution before top-k / top-p (SGLang's definition), so training recomputes them."""
    tool_format: Literal["hermes", "glm"] = "hermes"
    deadline_s: float = Field(600.0, gt=0)


class AlgoConfig(Section):
    estimator: Literal["gae", "grpo", "rloo"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    policy_loss: Literal["ppo", "gspo", "gmpo", "sapo"] = "ppo"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    dual_clip: float | None = None
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    token_filter: Literal["icepop", "tis", "none"] = "icepop"
    """IcePop (drop tokens outside the band) or TIS (truncate the weight at ``icepop_high``)."""
    icepop_low: float = Field(0.5, ge=0, le=1)
    icepop_high: float = Field(5.0, ge=1)
    entropy_top: float | None = Field(None, gt=0, le=1)
    """Train the actor only on this fraction of the trainable tokens, those where the old policy's
    entropy is highest (forking tokens); None: every token. The critic keeps every token."""
    kl_coef: float = Field(0.0, ge=0)
    """KL to the initial policy (k3); 0 (off) by default, as IcePop bounds the mismatch."""
    value_clip: float | None = 0.2
    normalize_advantages: bool = True
    """Whiten advantages over the trainable tokens of the batch."""
    critic_warmup: int = Field(0, ge=0)
    """Iterations that train only the critic."""
    mask_truncated: bool = False
    """Leave episodes that a budget cut off (``max_turns``, ``truncated_context``, ``timeout``) out of
    the actor's loss (overlong filtering); the critic still learns their values. Without it their
    tokens are pushed down like a wrong answer's, the tool-call format's included, in the off-track
    contexts where that format is least sure."""


class OptimConfig(Section):
    actor_lr: float = Field(1e-4, gt=0)
    critic_lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon (actor and critic). Adam moves every weight by about the learning rate
    whatever its gradient's size; a larger epsilon damps the weights whose gradients are smaller
    than it (mostly noise on a small RL batch)."""
    actor_optimizer: Literal["adamw", "sgd"] = "adamw"
    """The actor's optimizer. ``sgd`` (plain, no momentum; ``actor_lr`` then scales the gradient
    itself) moves each weight in proportion to its gradient, where AdamW moves every weight by about
    the learning rate; the critic and the warm start use AdamW either way."""
    actor_frozen: list[str] = Field(default_factory=list)
    """Parts of the policy the actor's updates leave as they are: each entry is a fragment of
    parameter names (e.g. ``embed_tokens``, the embedding that a tied head shares, or ``layers.0.``).
    The supervised warm start and the critic still train them. Empty: the actor trains every weight."""
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
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
    """``packed``: rows concatenated with a block-diagonal mask (for varlen attention kernels);
    ``padded``: length-bucketed rows, each micro-batch padded to its own longest (CPU / SDPA)."""
    logprob_chunk: int = Field(1024, ge=16)


class SFTConfig(Section):
    episodes: int = Field(0, ge=0)
    """Scripted-expert episodes for a supervised warm start of the policy (0: none)."""
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    """Episodes per optimizer step."""
    critic_epochs: int = Field(0, ge=0)
    """Epochs the value model trains on the warm start's expert episodes before RL, against their
    returns as the loop computes them (``algo.gamma``, ``algo.lam``; with both 1, the episode's reward
    at every trainable token), so that its first values can tell a right fix from a slipped one
    (``expert.miss``). 0: the critic starts from the warm-started policy with a zero head. Needs
    ``algo.estimator: gae``."""
    expert: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's scripted expert (bugfix-v0: ``run_tests``, ``recover``,
    ``miss``: the share of episodes whose fix has a slip and fails, imitated all the same)."""


class MetricsConfig(Section):
    tensorboard: bool = True
    """Also write TensorBoard events when ``tensorboard`` is installed."""
    wandb: bool = False
    wandb_mode: Literal["offline", "online"] = "offline"
    eval_every: int = Field(0, ge=0)
    """Evaluate on held-out tasks every N iterations (0: only before and after)."""
    eval_samples: int = Field(0, ge=0)
    """Also sample each held-out task N times at ``rollout.temperature`` and log the mean success
    (``eval_success_sampled``) and pass@N (``eval_pass_at_n``) beside greedy success. Greedy success
    on a few dozen tasks moves by a task whenever one near-tie flips; the sampled mean has far less
    noise, and every evaluation of a run draws the same random numbers, so before/after differences
    are not sampling luck. 0: greedy only."""
    progress: bool = True


class TrainConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.algo.estimator in ("grpo", "rloo") and self.rollout.n_samples < 2:
            raise ValueError(
                f"estimator {self.algo.estimator} needs rollout.n_samples >= 2 (a group baseline)"
            )
        if self.sft.critic_epochs and self.algo.estimator != "gae":
            raise ValueError(
                f"sft.critic_epochs={self.sft.critic_epochs} trains a value model that estimator "
                f"{self.algo.estimator} does not use; set algo.estimator=gae or sft.critic_epochs=0"
            )
        if self.sft.critic_epochs and not self.sft.episodes:
            raise ValueError(
                f"sft.critic_epochs={self.sft.critic_epochs} trains the critic on the warm start's "
                "expert episodes, and sft.episodes is 0; set sft.episodes > 0 or sft.critic_epochs=0"
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
    if not loc and error["type"] == "value_error":  # a check across sections: its message says it all
        return str(error["msg"]).removeprefix("Value error, ").rstrip(".") + "."
    return f"'{where}': {error['msg']} (got {error.get('input')!r})."


def read_settings(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The mapping in a YAML file (optional) with ``key.sub=value`` overrides applied (values parsed as YAML)."""
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
            target[leaf] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: {value!r} is not a YAML value ({getattr(e, 'problem', e)}); quote it"
            ) from None
    return data


def load_config(
    model: type[BaseModel], path: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Any:
    """Load ``model`` from a YAML file and ``key.sub=value`` overrides; ``ConfigError`` on anything wrong."""
    data = read_settings(path, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        messages = [_closest_key_message(err, model) for err in e.errors()]
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}: " + " ".join(messages)) from None


def make_env(env_id: str, args: Any, key: str) -> Any:
    """``make(env_id, **args)`` where ``args`` is setting ``key``; ``ConfigError`` naming the id or the
    argument when the environment cannot be built. Called once before any model loads or episode runs."""
    from agentrl.env import make, spec

    if not isinstance(args, dict):
        raise ConfigError(f"{key} must be a mapping of keyword arguments for {env_id}; got {args!r}")
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
    try:  # only to name an unknown argument and list the known ones; the call is make()'s
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for name, value in args.items():
            if name not in params:
                close = difflib.get_close_matches(name, params, n=1)
                hint = f" Did you mean {key}.{close[0]}?" if close else ""
                raise ConfigError(
                    f"{key}.{name}={value!r}: environment {env_id} takes no argument {name!r}.{hint} "
                    f"It takes: {', '.join(params)}."
                )
    try:
        return make(env_id, **args)
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
