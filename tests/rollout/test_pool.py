"""64 concurrent bugfix-v0 episodes with the tiny model; injected faults stay inside their episodes."""

import asyncio
import shutil

import pytest

from agentrl.env import make
from agentrl.envs.bugfix import BugfixEnv
from agentrl.envs.bugfix.generator import describe
from agentrl.models import tiny_chat_model
from agentrl.rollout.agent_loop import LoopConfig
from agentrl.rollout.local import LocalEngine
from agentrl.store import TrajectoryStore
from agentrl.tools import ToolCall
from tests.conftest import require_docker

ENGINE_FAULTS = {3, 17, 40}
SANDBOX_FAULTS = {5, 22, 51}


class DyingSandboxEnv(BugfixEnv):
    """bugfix-v0 whose sandbox dies right after reset; the next tool call finds it dead."""

    async def reset(self, task):
        obs = await super().reset(task)
        if self.sandbox.__class__.__name__ == "DockerSandbox":
            import docker

            docker.from_env().containers.get(self.sandbox.container_id).kill()
        else:
            shutil.rmtree(self.sandbox.workdir)
        return obs

    async def step(self, tool_calls):
        return await super().step([ToolCall("bash", {"command": "ls"}, id="probe"), *tool_calls])


class FaultyEngine:
    """Fails every request of the episodes whose task text is in ``poisoned``. The first requests wait
    at a gate until ``gather`` of them are in flight (or ``gather_s`` has passed): sandboxes that start
    one after another (Docker on 2 cores) would otherwise hand the engine their first turns one by one,
    and whether any two met in one batch would be down to timing. The gate opens early only if the
    pool really runs that many episodes at once."""

    def __init__(self, inner, tokenizer, poisoned, gather=16, gather_s=60.0):
        self.inner, self.tok, self.poisoned = inner, tokenizer, poisoned
        self.gather, self.gather_s, self.waiting, self.gate = gather, gather_s, 0, None

    async def generate(self, input_ids, params):
        text = self.tok.decode(input_ids[:1500])
        if any(p in text for p in self.poisoned):
            raise RuntimeError("injected engine fault")
        if self.gate is None:
            self.gate = asyncio.Event()
        if not self.gate.is_set():
            self.waiting += 1
            if self.waiting >= self.gather:
                self.gate.set()
            try:
                await asyncio.wait_for(self.gate.wait(), self.gather_s)
            except TimeoutError:
                self.gate.set()
        return await self.inner.generate(input_ids, params)

    async def update_weights(self, *a, **k):
        return await self.inner.update_weights(*a, **k)

    async def health(self):
        return True


# Docker's case runs in the slow suite (make test-slow): a minute, for the pool's code shared by both.
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.slow)])
def test_64_concurrent_episodes_with_faults(backend, tmp_path):
    if backend == "docker":
        require_docker()
    from agentrl.rollout.pool import RolloutPool

    model, tok = tiny_chat_model()
    probe = make("bugfix-v0", sandbox=backend, max_turns=2)
    tasks = probe.tasks("train")[:64]
    specs = {t.id: probe.task_spec(t) for t in tasks}
    poisoned = {describe(specs[tasks[i].id], True) for i in ENGINE_FAULTS}
    engine = FaultyEngine(LocalEngine(model), tok, poisoned)
    counter = iter(range(10_000))
    order = {}

    def factory():
        # Environments are made in task order (the pool creates them as it starts each episode).
        i = next(counter)
        order[i] = True
        cls = DyingSandboxEnv if i in SANDBOX_FAULTS else BugfixEnv
        return cls(sandbox=backend, max_turns=2)

    store = TrajectoryStore(tmp_path / "store")
    pool = RolloutPool(
        factory,
        engine,
        tok,
        LoopConfig(max_turns=2, max_new_tokens=16, max_context=4096, temperature=1.0, seed=0),
        store=store,
        concurrency=64,
        progress=False,
    )
    trajectories = asyncio.run(pool.run(tasks))
    store.close()
    assert len(trajectories) == 64
    by_status = {}
    for i, (task, t) in enumerate(zip(tasks, trajectories, strict=True)):
        assert t.task_id == task.id
        expected = "max_turns"
        if describe(specs[task.id], True) in poisoned:
            expected = "engine_error"
        elif i in SANDBOX_FAULTS:
            expected = "env_error"
        assert t.status == expected, (i, t.status, t.extra)
        by_status.setdefault(t.status, 0)
        by_status[t.status] += 1
    assert by_status["max_turns"] >= 64 - len(ENGINE_FAULTS) - len(SANDBOX_FAULTS)
    stored = list(TrajectoryStore(tmp_path / "store").read())
    assert sorted(t.task_id for t in stored) == sorted(t.id for t in tasks)
    assert engine.inner.stats["max_batch"] > 8  # concurrent episodes were decoded together


def _pool(factory, store=None, **kwargs):
    from agentrl.models import tiny_tokenizer
    from agentrl.rollout.pool import RolloutPool
    from tests.rollout.fakes import FixedEngine

    tok = tiny_tokenizer()
    engine = FixedEngine(
        [*tok.encode("done", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    )
    return RolloutPool(factory, engine, tok, LoopConfig(max_turns=2), store=store, progress=False, **kwargs)


def test_an_environment_that_cannot_be_made_is_an_env_error_episode_and_stored(tmp_path):
    from agentrl.env import Task
    from tests.rollout.fakes import EchoEnv

    made = iter(range(100))

    def factory():
        if next(made) % 3 == 1:
            raise OSError("no space left on device")
        return EchoEnv(2)

    tasks = [Task(f"train-{i}") for i in range(3)]
    with TrajectoryStore(tmp_path / "store") as store:
        out = asyncio.run(_pool(factory, store, n_samples=2).run(tasks, extra={"iteration": 4}))
    assert [(t.task_id, t.sample_index) for t in out] == [(t.id, s) for t in tasks for s in (0, 1)]
    broken = [t for t in out if t.status == "env_error"]
    assert len(broken) == 2 and all(
        t.extra["error"] == "could not create the environment: OSError: no space left on device"
        for t in broken
    )
    stored = list(TrajectoryStore(tmp_path / "store").read())
    assert sorted(t.status for t in stored) == sorted(t.status for t in out) and len(stored) == 6
    assert all(t.extra["iteration"] == 4 for t in stored)


def test_a_cancelled_run_cancels_every_episode_it_started():
    from agentrl.env import Task
    from tests.rollout.fakes import EchoEnv

    envs = []

    def factory():
        envs.append(EchoEnv(50, step_delay=1.0))
        return envs[-1]

    async def main():
        run = asyncio.ensure_future(_pool(factory, concurrency=3).run([Task(f"train-{i}") for i in range(6)]))
        await asyncio.sleep(0.3)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return others

    assert asyncio.run(main()) == []
    assert len(envs) == 3 and all(env.closed >= 1 for env in envs)  # the three started, each closed


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"n_samples": 0}])
def test_concurrency_and_samples_must_be_positive(kwargs):
    with pytest.raises(ValueError, match="concurrency and n_samples must be >= 1; got"):
        _pool(lambda: None, **kwargs)


def test_an_engine_that_returns_a_nan_log_prob_costs_that_episode_not_the_run():
    """A diverged policy (NaN logits) for one episode: it ends as engine_error, the others finish."""
    import math

    from agentrl.env import Task
    from agentrl.models import tiny_tokenizer
    from agentrl.rollout.engine import Generation
    from agentrl.rollout.pool import RolloutPool
    from tests.rollout.fakes import EchoEnv

    tok = tiny_tokenizer()
    ids = [*tok.encode("done", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]

    class NanFor:
        weight_version = "0"

        async def generate(self, input_ids, params):
            bad = "task train-0" in tok.decode(input_ids)
            await asyncio.sleep(0.0 if bad else 0.2)  # the bad episode ends while the others run
            return Generation(list(ids), [math.nan if bad else -0.1] * len(ids), "stop", "0")

    pool = RolloutPool(lambda: EchoEnv(2), NanFor(), tok, LoopConfig(), concurrency=4, progress=False)
    out = asyncio.run(pool.run([Task(f"train-{i}") for i in range(4)]))
    assert [t.status for t in out] == ["engine_error", "completed", "completed", "completed"]
    assert "logprobs[0] = nan" in out[0].extra["error"]


def test_a_run_cancelled_while_its_envs_close_waits_for_the_closes():
    """The sandboxes of a cancelled run are closed before run() gives up: none is left to the
    event loop's shutdown, which would cancel the close halfway."""
    from agentrl.env import Task
    from tests.rollout.fakes import EchoEnv

    class SlowClose(EchoEnv):
        closing = None

        async def close(self):
            self.closing.set()
            await asyncio.sleep(0.5)  # removing a container
            await super().close()

    envs = []

    def factory():
        envs.append(SlowClose(1))
        envs[-1].closing = asyncio.Event()
        return envs[-1]

    async def main():
        run = asyncio.ensure_future(_pool(factory, concurrency=2).run([Task("train-0"), Task("train-1")]))
        while len(envs) < 2 or not all(env.closing.is_set() for env in envs):
            await asyncio.sleep(0.01)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        closed = [env.closed for env in envs]
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return closed, others

    assert asyncio.run(main()) == ([1, 1], [])
