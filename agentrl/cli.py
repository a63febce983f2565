"""The ``agentrl`` command.

A bad argument ends a command with one line, ``error: ...``, and exit status 2. SIGINT and SIGTERM
stop a command cleanly: its asyncio work is cancelled, so every ``async with`` (environments,
sandboxes, containers) closes on the way out, then one line says so and the exit status is
128 + the signal's number (130, 143).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import agentrl


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM where there is no waiting asyncio task to cancel."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Stop:
    """SIGINT / SIGTERM handler of a command. The first signal cancels the command's asyncio task
    (``run``) where it waits; elsewhere, ``Interrupted`` is raised where the program is. A second
    signal while it stops ends the process at once, without waiting for the cleanup.

    Installed by ``main`` before any sandbox exists: the sandboxes' last-resort cleanup
    (``agentrl.sandboxes._cleanup``) installs its own handler later and calls this one after its hooks.
    """

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.task: asyncio.Task | None = None
        self.done = False  # main() is finishing: a signal now is no longer the command's
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:  # e.g. SIGINT of a background job: it stays ignored
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        self.done = True
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # a handler chained on top keeps calling ours
                signal.signal(signum, previous)

    def _handle(self, signum: int, frame) -> None:
        if self.done:
            if self.signals:  # the stop is being reported already
                return
            previous = self._previous.get(signum)  # main() has returned: act as before it ran
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.signals.append(signum)
        if len(self.signals) > 1:
            self._exit_now()
        task = self.task
        # Cancelled, the task stops at its next await; while its own synchronous code runs (a model
        # loading, an optimizer step), the exception raised here stops it at once, and its `async
        # with` blocks close all the same as the exception passes through them.
        suspended = task is not None and not task.done() and asyncio.current_task(task.get_loop()) is not task
        if suspended:
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wakes a loop asleep in select()
            return
        raise Interrupted(signum)

    def _exit_now(self) -> None:
        # Raising here would land in whichever task runs, to be logged with a traceback when it is
        # collected. The sandboxes' last-resort hooks have run by now (they come before this handler).
        with contextlib.suppress(Exception):  # stdout may be mid-write in the interrupted code
            sys.stdout.flush()
        os.write(2, (self.message() + "\n").encode())
        os._exit(128 + self.signals[0])

    def run(self, coro):
        """``asyncio.run(coro)``, as the task that the first signal cancels."""

        async def main():
            self.task = asyncio.current_task()
            asyncio.get_running_loop().set_exception_handler(self._loop_exception)
            try:
                return await coro
            finally:
                self.task = None

        return asyncio.run(main())

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # Work that a stop abandons can end in an error nobody awaits any more (a sandbox that the
        # last-resort hooks removed under a running command); asyncio would print each with a traceback.
        if self.signals and context.get("message", "").endswith("exception was never retrieved"):
            return
        loop.default_exception_handler(context)

    def message(self) -> str:
        first, *more = (signal.Signals(s).name for s in self.signals)
        if not more:
            return f"agentrl: interrupted by {first}; stopped."
        return (
            f"agentrl: interrupted by {first}, then by {more[0]}; stopped without waiting for the cleanup "
            "(`agentrl sandbox gc` removes sandbox containers left behind)."
        )


_stop = _Stop()


def _run(coro):
    return _stop.run(coro)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _error(message: object) -> int:
    """One line on stderr, ``error: ...``; exit status 2."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def _quickstart(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.sandbox import NoSandboxError, resolve_kind
    from agentrl.trainer.ppo import train

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    if not recipe.exists():
        return _error(f"{recipe} not found: run the quickstart from a clone of the repository")
    # bubblewrap first: on 2 CPU cores a grade in a fresh Docker container (two container starts an
    # episode) costs about 1 s more than in bubblewrap, and the run about twice the time.
    try:
        sandbox = resolve_kind("auto", prefer="local")
    except NoSandboxError as e:
        return _error(e)
    why = (
        "bubblewrap runs here, and costs about half the time of Docker on this recipe"
        if sandbox == "local"
        else "bubblewrap cannot run here, and a Docker engine with the base image answers"
    )
    # each quickstart replaces the last one's runs/quickstart (run.name=NAME keeps a run apart)
    overrides = [f"sandbox.kind={sandbox}", f"run.seed={args.seed}", "run.overwrite=true", *args.overrides]
    if args.iterations is not None:
        overrides.append(f"run.iterations={args.iterations}")
    try:
        cfg = load_config(TrainConfig, str(recipe), overrides)
    except ConfigError as e:
        return _error(e)
    print(
        "agentrl quickstart: a tiny policy is trained to fix one-function bugs in bugfix-v0 on this CPU\n"
        f"  sandbox: {sandbox} ({why}); recipe: recipes/quickstart.yaml\n"
        "  1. warm start: supervised on the environment's demonstrations (played through the real loop)\n"
        "  2. held-out success of the greedy policy\n"
        "  3. PPO + critic (GAE over the policy's tokens) + IcePop, no KL, on sampled episodes\n"
        f"  4. held-out success again; metrics.jsonl and curve.png in {cfg.run_dir}/",
        flush=True,
    )
    try:
        summary = _run(train(cfg))
    except ConfigError as e:
        return _error(e)
    gain = summary["eval_after"] - summary["eval_before"]
    print(
        f"done: held-out success {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} ({gain:+.3f}) "
        f"in {summary['seconds'] / 60:.1f} min; {summary['run_dir']}/curve.png"
    )
    if "eval_after_sampled" in summary:
        before, after = summary["eval_before_sampled"], summary["eval_after_sampled"]
        print(f"      sampled held-out success {before:.3f} -> {after:.3f} ({after - before:+.3f})")
    return 0


def _sandbox_build(args: argparse.Namespace) -> int:
    from agentrl.sandboxes.images import BASE_IMAGE, ImageBuildError, build_base_image

    try:
        build_base_image(args.tag or BASE_IMAGE, mirror=args.mirror, force=args.force)
    except ImageBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _sandbox_gc(args: argparse.Namespace) -> int:
    from agentrl.sandbox import SandboxError
    from agentrl.sandboxes.docker import gc

    removed, reached, code = [], 0, 0
    for host in args.host or [None]:
        try:
            here = gc(everything=args.all, run=args.run, docker_host=host)
        except SandboxError as e:  # the daemon cannot be reached: the user starts it or names another
            code = _error(e)
            continue
        reached += 1
        where = f" on {host}" if host else ""
        for short_id, reason in here:
            print(f"removed {short_id}{where} ({reason})")
        removed += here
    if reached:
        print(f"{len(removed)} sandbox container(s) removed")
    if not args.host:  # this machine's local sandboxes: cgroups and workspaces of processes gone
        from agentrl.sandboxes.local import gc as local_gc

        left = local_gc()
        for path, reason in left:
            print(f"removed {path} ({reason})")
        print(f"{len(left)} local sandbox leftover(s) removed")
    return code


def _sandbox_doctor(args: argparse.Namespace) -> int:
    from agentrl.sandboxes.docker import doctor
    from agentrl.sandboxes.local import bwrap_works

    checks = []
    for host in args.host or [None]:
        here = doctor(docker_host=host)
        checks += [(f"{name} ({host})" if host else name, good, text) for name, good, text in here]
    ok, detail = bwrap_works()
    checks.append(("bubblewrap (local backend)", ok, detail if not ok else f"works ({detail})"))
    for name, good, text in checks:
        print(f"[{'ok' if good else '--'}] {name}: {text}")
    docker_ok = all(good for name, good, _ in checks if name.startswith(("docker", "image")))
    local = "usable" if ok else "only unisolated, when asked for (isolation: none)"
    print(f"docker backend: {'usable' if docker_ok else 'not usable here'}; local backend: {local}")
    return 0 if docker_ok or ok else 1  # 1: no backend isolates agent commands here


def _envs_list(args: argparse.Namespace) -> int:
    from agentrl.env import list_envs, spec

    for env_id in list_envs():
        s = spec(env_id)
        defaults = f"  defaults {s.defaults}" if s.defaults else ""
        print(f"{env_id}  {s.entry_point}{defaults}")
    return 0


def _envs_check(args: argparse.Namespace) -> int:
    import yaml

    from agentrl.config import ConfigError, env_factory_params, make_env
    from agentrl.env import EnvCheckError, check_env_async, first_task
    from agentrl.sandbox import NoSandboxError, SandboxError

    example = "--args '{data_path: tasks.jsonl}'"
    try:
        env_args = yaml.safe_load(args.env_args) if args.env_args else {}
    except yaml.YAMLError as e:
        return _error(f"--args {args.env_args!r} is not YAML ({getattr(e, 'problem', e)}); e.g. {example}")
    if not isinstance(env_args, dict):
        return _error(f"--args {args.env_args!r} must be a mapping of the env's arguments, e.g. {example}")
    if "sandbox" in env_args:
        return _error(f"--args sandbox={env_args['sandbox']!r}: give the sandbox with --sandbox instead")
    try:
        # as train and rollout: the sandbox only to a factory that takes it
        if args.sandbox and "sandbox" in env_factory_params(args.id):
            env_args["sandbox"] = args.sandbox
        env = make_env(args.id, env_args, "--args")  # names an unknown or a missing argument
    except ConfigError as e:
        return _error(e)
    try:
        task = first_task(env)
        passed = _run(check_env_async(env, task))
        passed += _run(_episode_checks(args.id, env_args, env, task, args.demos))
    except EnvCheckError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except (SandboxError, NoSandboxError) as e:  # this machine's sandbox backend, not the env
        return _error(e)
    for line in passed:
        print(f"ok  {line}")
    print(f"{args.id}: all checks passed")
    return 0


async def _episode_checks(env_id: str, env_args: dict, probe, task, demos: int = 1) -> list[str]:
    from agentrl.env import checked_demonstration, make
    from agentrl.models import env_corpus, tiny_tokenizer
    from agentrl.rollout.agent_loop import LoopConfig
    from agentrl.rollout.scripted import check_demonstration

    # the first N training tasks' demonstrations (--demos), checked before the tokenizer's corpus
    # asks for them too, so that one that raises is named with its task
    tasks = [task, *probe.tasks("train")[1:demos]]
    checked = [(t, checked_demonstration(probe, t)) for t in tasks]
    tokenizer = tiny_tokenizer(corpus=env_corpus(probe))
    loop = LoopConfig(max_turns=getattr(probe, "max_turns", 8), max_new_tokens=1024, max_context=16384)
    return await check_demonstration(lambda: make(env_id, **env_args), checked, tokenizer, loop)


def _rollout(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.rollout.run import collect

    try:
        _run(collect(load_config(TrainConfig, args.config, args.overrides)))
    except ConfigError as e:
        return _error(e)
    return 0


def _train(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.trainer.ppo import train

    try:
        _run(train(load_config(TrainConfig, args.config, args.overrides)))
    except ConfigError as e:
        return _error(e)
    return 0


def _config(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError, TrainConfig, describe, load_config

    if args.markdown:
        from agentrl.config import reference

        print(reference(), end="")
        return 0
    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
    except ConfigError as e:
        return _error(e)
    print(f"# {args.config or 'defaults'}{' with ' + ' '.join(args.overrides) if args.overrides else ''}")
    print("\n".join(describe(cfg)).lstrip("\n"))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from agentrl.config import ConfigError, TrainConfig, load_config
    from agentrl.trainer.evaluation import evaluate_weights

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        result = _run(evaluate_weights(cfg, store_dir=args.store))
    except ConfigError as e:
        return _error(e)
    if cfg.model.init is None:
        print(
            "note: model.init is not set: these are the scores of the recipe's model as it starts, before "
            "any training; give model.init=RUN/checkpoints/iter-N (or a warm_start.pt) to score a run",
            file=sys.stderr,
        )
    for key in sorted(result):
        if key.startswith("eval_pass_at_") and not key.endswith("_ci95") and f"{key}_ci95" in result:
            k = key.removeprefix("eval_pass_at_")
            print(f"pass@{k} {result[key]:.3f} ± {result[f'{key}_ci95']:.3f} (95 % interval over tasks)")
    if args.store:
        print(f"episodes stored in {args.store}")
    print(json.dumps({"model.init": cfg.model.init, **result}))
    return 0


def _port_error(port: int) -> str | None:
    if not 1 <= port <= 65535:
        return f"--port {port} is not a TCP port; give one from 1 to 65535 (SGLang's is 30000)"
    return None


def _bind_error(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port``, found before the model loads and the
    address is announced; None when it can (it is free again when this returns)."""
    import errno
    import socket

    from agentrl.rollout.sglang_launch import bind_error

    e = bind_error(host, port)
    if e is None:
        return None
    if isinstance(e, socket.gaierror):
        return f"--host {host}: not an address of this machine ({e.strerror}); give e.g. 127.0.0.1 or 0.0.0.0"
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is in use by another server; stop it or give another --port"
    if e.errno == errno.EACCES:
        return f"--port {port}: listening on it needs privileges here; give a port above 1023"
    return f"--host {host} --port {port}: cannot listen there ({e.strerror}); give e.g. --host 127.0.0.1"


def _serve_local(args: argparse.Namespace) -> int:
    from agentrl.config import ConfigError
    from agentrl.rollout.serve_local import main as serve

    why = _port_error(args.port) or _bind_error(args.host, args.port)
    if why:
        return _error(why)
    try:
        serve(args.model, args.host, args.port, device=args.device, max_context=args.max_context)
    except (ConfigError, ImportError, OSError, ValueError) as e:
        return _error(f"agentrl serve local --model {args.model}: {e}")
    return 0


def _serve_sglang(args: argparse.Namespace) -> int:
    import errno

    from agentrl.rollout.sglang_launch import main as launch
    from agentrl.rollout.sglang_launch import sglang_plan

    why = _port_error(args.port)
    if why:
        return _error(why)
    try:
        plan = sglang_plan(
            args.model, tp=args.tp, dp=args.dp, servers=args.servers, host=args.host, port=args.port
        )
    except ValueError as e:
        return _error(e)
    log_dir = Path(args.log_dir)
    try:
        if log_dir.exists() and not log_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory")
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        return _error(
            f"--log-dir {args.log_dir}: {e.strerror or e}; give a writable directory for the servers' logs"
        )
    try:
        return launch(plan, args.log_dir, args.timeout)
    except RuntimeError as e:
        return _error(e)


def _replay(args: argparse.Namespace) -> int:

    from rich.console import Console

    from agentrl.replay.episodes import ReplayError, find, parse_filter, read, resolve
    from agentrl.replay.transcript import list_view, summary_line, transcript

    try:
        keep = parse_filter(",".join(args.filter)) if args.filter else None
        if args.filter and args.id is not None:
            raise ReplayError("--filter chooses the episodes to list; give it without --id")
        if args.html is not None and args.id is None:
            raise ReplayError(f"--html {args.html} needs --id: the page shows one episode")
        if args.reexec and args.id is None:
            raise ReplayError("--reexec needs --id: which episode to re-execute?")
        if args.from_turn is not None and args.id is None:
            raise ReplayError(f"--from-turn {args.from_turn} needs --id: which episode to branch?")
        if args.set and args.from_turn is None:
            raise ReplayError(f"--set {args.set[0]} is for --from-turn: the settings of the re-run")
        if args.seed is not None and args.from_turn is None:
            raise ReplayError(f"--seed {args.seed} is for --from-turn: the sampling seed of the re-run")
        actions = [
            a
            for a, given in (
                ("--reexec", args.reexec),
                (f"--from-turn {args.from_turn}", args.from_turn is not None),
                (f"--html {args.html}", args.html is not None),
            )
            if given
        ]
        if len(actions) > 1:
            raise ReplayError(
                f"{' and '.join(actions)} cannot be combined: --reexec re-runs the recorded tool calls, "
                "--from-turn lets the policy generate from a turn, --html writes the page; give one"
            )
        view = [
            v
            for v, given in ((f"--turn {args.turn}", args.turn is not None), ("--tokens", args.tokens))
            if given
        ]
        if view and args.id is None:
            raise ReplayError(f"{view[0]} needs --id: which episode to show?")
        if view and actions:
            raise ReplayError(
                f"{' and '.join(view)} chooses what the terminal transcript shows; {actions[0]} prints no "
                "transcript, so give it alone"
            )
        if args.exact and not args.reexec:
            raise ReplayError("--exact is for --reexec: compare durations that tools print too")
        if args.sandbox is not None and not args.reexec:
            raise ReplayError(f"--sandbox {args.sandbox} is for --reexec: the sandbox to re-execute in")
        store = resolve(args.store)
        episodes, damage = read(store)
        for d in damage:
            print(f"warning: {store}/{d}", file=sys.stderr)
        if args.id is not None:
            episode = find(episodes, args.id, store)
            if args.reexec:
                return _reexec(store, episode, args.sandbox, args.exact)
            if args.from_turn is not None:
                return _branch(store, episode, args.from_turn, args.set or [], args.seed)
            if args.html is not None:  # transcript and token view, one file with no links out
                from agentrl.replay.html import write

                for warning in write(
                    episode, args.html, store.parent if store.name == "trajectories" else None
                ):
                    print(f"warning: {warning}", file=sys.stderr)
                print(f"wrote {args.html}")
                return 0
            # soft_wrap: long lines stay whole, so a transcript piped to a file or grep reads as printed
            transcript(Console(highlight=False, soft_wrap=True), episode, turn=args.turn, tokens=args.tokens)
            return 0
    except ReplayError as e:
        return _error(e)
    except BrokenPipeError:  # the reader of the transcript went away: main says nothing
        raise
    except OSError as e:  # the --html file cannot be written, or a file of the store cannot be read
        if args.html is not None and e.filename is not None and Path(e.filename) == Path(args.html):
            return _error(f"--html {args.html}: {e.strerror or e}")
        name = str(e.filename or args.store)
        hint = "; a store reads every *.jsonl.gz in it as a shard: make it readable, or move it out" * (
            name.endswith(".jsonl.gz")
        )
        return _error(f"cannot read {name}: {e.strerror or e}{hint}")
    shown = [e for e in episodes if keep(e)] if keep else episodes
    if not shown and damage and not episodes:
        records = f"{len(damage)} damaged record{'s' if len(damage) != 1 else ''}"
        return _error(
            f"{store}: no intact episode ({records}, each named above); restore its shards from a copy, "
            "or give another store"
        )
    if not shown:
        if keep:
            why = f"no episode of {len(episodes)} matches --filter {','.join(args.filter)}"
        else:
            why = "the store holds no episodes yet"
        print(f"{store}: {why}", file=sys.stderr)
        return 1
    counts = list_view(sys.stdout, shown)
    print(summary_line(counts, damage) + (f" of {len(episodes)}" if keep else ""))
    return 0


def _branch(store, episode, from_turn: int, overrides: list[str], seed: int | None) -> int:
    """``agentrl replay RUN --id ID --from-turn N``: the policy re-runs the episode from turn N."""
    import asyncio

    from agentrl.replay.branch import branch
    from agentrl.replay.episodes import ReplayError

    try:
        new, new_id, weights = asyncio.run(branch(store, episode, from_turn, overrides, seed))
    except ReplayError as e:
        return _error(e)
    t = episode.trajectory()
    print(f"re-ran {episode.id} from turn {from_turn} with {weights}")
    print(f"  original {episode.id}: {t.status}, reward {t.reward:g}, {len(t)} tokens")
    print(f"  branch   {new_id}: {new.status}, reward {new.reward:g}, {len(new)} tokens")
    print(f"stored beside it; `agentrl replay {store} --id {new_id}` shows it")
    return 0


def _reexec(store, episode, sandbox: str | None, exact: bool) -> int:
    """``agentrl replay --reexec``: 0 when the env reproduced the episode, 1 at a divergence."""
    import asyncio

    from agentrl.replay.episodes import ReplayError
    from agentrl.replay.reexec import build_env, describe, find_task, reexec

    t = episode.trajectory()
    try:
        env, splits, source = build_env(store, t, sandbox)
        task = find_task(env, t, splits)
    except ReplayError as e:
        return _error(e)
    print(f"re-executing {episode.id} ({t.env_id}, task {t.task_id}) with {source}")
    result = asyncio.run(reexec(env, t, task, exact=exact))
    print("\n".join(describe(result, t)))
    return 0 if result.divergence is None else 1


def _report(args: argparse.Namespace) -> int:
    from agentrl.replay.episodes import ReplayError
    from agentrl.replay.report import write

    try:
        page, warnings = write(args.run, args.out)
    except ReplayError as e:
        return _error(e)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {page}")
    return 0


_PROG = "_agentrl_prog"  # the namespace attribute naming the command that parsed last


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # On every command too (`agentrl train RECIPE --debug`), not only before it; absent unless given
        self.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the traceback of an unexpected error, not just its line",
        )

    def parse_known_args(self, args=None, namespace=None):
        # The innermost command's parser finishes first: its name is kept, so that arguments left
        # over (which the outermost parser reports) point at that command's own --help.
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, _PROG):
            setattr(namespace, _PROG, self.prog)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        prog = getattr(namespace, _PROG)
        delattr(namespace, _PROG)
        if extras:
            self.exit(
                2, f"error: unrecognized arguments: {' '.join(extras)}; `{prog} --help` shows the usage\n"
            )
        return namespace

    def error(self, message: str):
        # One line like every other input error; subcommands' parsers are of this class too.
        self.exit(2, f"error: {message}; `{self.prog} --help` shows the usage\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agentrl", description="Reinforcement learning for tool-using coding agents.")
    parser.add_argument("--version", action="version", version=f"agentrl {agentrl.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    quick = commands.add_parser(
        "quickstart", help="run the main job on this machine (it replaces the last one's runs/quickstart)"
    )
    quick.add_argument("--iterations", type=int, default=None, help="PPO iterations (default: the recipe's)")
    quick.add_argument("--seed", type=int, default=0)
    quick.add_argument(
        "overrides", nargs="*", default=[], help="key.sub=value overrides of recipes/quickstart.yaml"
    )
    quick.set_defaults(func=_quickstart)

    sandbox = commands.add_parser("sandbox", help="sandbox images, cleanup and checks")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    build = sandbox_commands.add_parser(
        "build", help="build the base image offline (debootstrap + docker import)"
    )
    build.add_argument("--tag", default=None, help="image tag (default agentrl/base:bookworm)")
    build.add_argument("--force", action="store_true", help="rebuild even when present")
    build.add_argument(
        "--mirror",
        default=None,
        help="Debian archive URL for debootstrap (default: $AGENTRL_DEBIAN_MIRROR, else apt's sources)",
    )
    build.set_defaults(func=_sandbox_build)
    gc = sandbox_commands.add_parser(
        "gc",
        help="remove sandbox containers, and local sandboxes' cgroups and workspaces, whose creating process is gone",
    )
    gc.add_argument("--all", action="store_true", help="remove every agentrl sandbox container")
    gc.add_argument("--run", default=None, help="remove every container of this run id")
    gc.add_argument(
        "--host",
        action="append",
        default=None,
        help="a Docker daemon URL; repeat for each host (default: the local one)",
    )
    gc.set_defaults(func=_sandbox_gc)
    doc = sandbox_commands.add_parser(
        "doctor",
        help="which sandbox backends work here, and how to fix those that do not (exit status 1 when none does)",
    )
    doc.add_argument(
        "--host",
        action="append",
        default=None,
        help="a Docker daemon URL; repeat for each host (default: the local one)",
    )
    doc.set_defaults(func=_sandbox_doctor)

    envs = commands.add_parser("envs", help="list registered environments, or check one")
    envs.set_defaults(func=_envs_list)
    envs_commands = envs.add_subparsers(dest="envs_command", metavar="ACTION")
    check = envs_commands.add_parser("check", help="run the conformance checker on an environment")
    check.add_argument("id", help="environment id, e.g. bugfix-v0")
    check.add_argument("--sandbox", choices=["docker", "local"], default=None, help="sandbox backend to use")
    check.add_argument(
        "--args",
        dest="env_args",
        metavar="YAML",
        help="the environment's arguments (env.args in a recipe), a YAML mapping: --args '{data_path: x}'",
    )
    check.add_argument(
        "--demos",
        type=_positive_int,
        default=1,
        metavar="N",
        help="play the demonstrations of the first N training tasks (default 1), where the env has them",
    )
    check.set_defaults(func=_envs_check)

    rollout = commands.add_parser("rollout", help="collect trajectories into a store, without training")
    rollout.add_argument("config", help="YAML file (e.g. recipes/rollout_bugfix_tiny.yaml)")
    rollout.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="key.sub=value overrides (e.g. collect.tasks=32 rollout.max_turns=4)",
    )
    rollout.set_defaults(func=_rollout)

    train = commands.add_parser("train", help="train with PPO (or GRPO, ...) from a recipe")
    train.add_argument("config", help="YAML recipe (e.g. recipes/quickstart.yaml)")
    train.add_argument(
        "overrides", nargs="*", default=[], help="key.sub=value overrides, e.g. run.resume=true"
    )
    train.set_defaults(func=_train)

    evaluate = commands.add_parser(
        "eval", help="held-out success of saved weights (model.init=FILE or a checkpoint directory)"
    )
    evaluate.add_argument("config", help="YAML recipe the weights were trained with")
    evaluate.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="key.sub=value overrides, e.g. model.init=... metrics.eval_samples=4",
    )
    evaluate.add_argument("--store", default=None, help="keep every episode in a trajectory store here")
    evaluate.set_defaults(func=_eval)

    serve = commands.add_parser("serve", help="serve a policy over SGLang's HTTP API")
    serve_commands = serve.add_subparsers(dest="serve_command", metavar="SERVER", required=True)
    local = serve_commands.add_parser(
        "local",
        help="the embedded engine over SGLang's HTTP API (engine.kind=sglang engine.url=http://HOST:PORT)",
    )
    local.add_argument("--model", required=True, help="tiny | smollm2 | a local Hugging Face model directory")
    local.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    local.add_argument("--port", type=int, default=30000, help="port (default 30000, SGLang's)")
    local.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    local.add_argument(
        "--max-context", type=int, default=None, help="tokens a request may hold (default: the model's)"
    )
    local.set_defaults(func=_serve_local)
    sgl = serve_commands.add_parser(
        "sglang",
        help="start SGLang servers (a router in front of several), wait until they generate, stop them on exit",
    )
    sgl.add_argument(
        "--model", required=True, help="the model path SGLang loads (a Hugging Face directory or id)"
    )
    sgl.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per server")
    sgl.add_argument("--dp", type=int, default=1, help="data-parallel replicas per server")
    sgl.add_argument(
        "--servers", type=int, default=1, help="servers; more than one get sglang_router in front"
    )
    sgl.add_argument("--host", default="127.0.0.1")
    sgl.add_argument(
        "--port", type=int, default=30000, help="port of the server (of the router, for several)"
    )
    sgl.add_argument("--log-dir", default="runs/sglang-logs", help="one log file per process here")
    sgl.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds to wait for every server to generate"
    )
    sgl.set_defaults(func=_serve_sglang)

    replay = commands.add_parser(
        "replay", help="list stored episodes, or show one turn by turn (text, tool calls, outcome)"
    )
    replay.add_argument(
        "store", metavar="STORE_OR_RUN", help="a run directory (with trajectories/) or a trajectory store"
    )
    replay.add_argument("--id", default=None, help="the episode to show, as listed (<shard>:<line>)")
    replay.add_argument(
        "--filter",
        action="append",
        default=None,
        help="list only matching episodes: key=value[,key=value]; keys status, reward, iteration, task, env; "
        "alternatives with |, e.g. status=timeout|max_turns,reward=0",
    )
    replay.add_argument("--turn", type=int, default=None, help="with --id: only this assistant turn (from 1)")
    replay.add_argument(
        "--tokens",
        action="store_true",
        help="with --id: print the token ids, trained and masked styled apart",
    )
    replay.add_argument(
        "--html",
        default=None,
        metavar="OUT.html",
        help="with --id: write the transcript and every token, coloured by loss mask, log-prob gap, IcePop weight, "
        "advantage or value (the last four where the run recorded them: debug.token_stats_every), as one "
        "self-contained page",
    )
    replay.add_argument(
        "--reexec",
        action="store_true",
        help="with --id: run the recorded tool calls again in a fresh env of the same id and task and "
        "report the first observation that differs (exit 1), to tell a nondeterministic env from the policy",
    )
    replay.add_argument(
        "--sandbox",
        choices=["auto", "docker", "local"],
        default=None,
        help="with --reexec: the sandbox backend (default: the run's, or auto for a bare store)",
    )
    replay.add_argument(
        "--from-turn",
        type=int,
        default=None,
        metavar="N",
        help="with --id, in a run directory: replay the recorded turns before N, let the policy generate "
        "from turn N on (by default with the weights that sampled the episode) and store the branch beside it",
    )
    replay.add_argument(
        "--set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="with --from-turn: a run setting for the re-run, e.g. --set engine.kind=sglang "
        "--set rollout.temperature=0 --set model.init=runs/x/checkpoints/iter-000006",
    )
    replay.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --from-turn: the sampling seed (default: a fresh one, stored with the branch)",
    )
    replay.add_argument(
        "--exact",
        action="store_true",
        help="with --reexec: compare every byte, the durations tools print (e.g. '5 passed in 0.03s') too",
    )
    replay.set_defaults(func=_replay)

    report = commands.add_parser(
        "report",
        help="a training run on one page: learning curve, diagnostics per iteration, best and worst episodes",
    )
    report.add_argument("run", metavar="RUN", help="the run directory (runs/NAME, holding metrics.jsonl)")
    report.add_argument("--out", default=None, help="write the report here (default: RUN/report)")
    report.set_defaults(func=_report)

    config = commands.add_parser(
        "config", help="print a recipe's resolved config: every field, its value, default and description"
    )
    config.add_argument("config", nargs="?", default=None, help="YAML recipe (none: the defaults)")
    config.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides")
    config.add_argument(
        "--markdown", action="store_true", help="the reference of every field (docs/config.md)"
    )
    config.set_defaults(func=_config)
    _plugin_commands(commands)
    return parser


COMMANDS_GROUP = "agentrl.commands"


def _plugin_commands(commands) -> None:
    """Commands that installed packages add (entry points of the group ``agentrl.commands``: a
    callable that adds its parsers to the subcommands, e.g. ``agentrl swe`` from the swe-v0
    environment). One that fails to load is warned about and left out."""
    import importlib.metadata
    import warnings

    for point in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        try:
            point.load()(commands)
        except Exception as e:
            warnings.warn(
                f"could not load the command plugin {point.name} ({point.value}): {e}", stacklevel=2
            )


def _failure(e: BaseException) -> str:
    """One line for an unexpected exception: what was raised, and where (the innermost frame of
    the code that raised it, naming the component: an environment, a backend, an engine)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        module = next(
            (m for m, mod in sys.modules.items() if getattr(mod, "__file__", None) == last.filename), None
        )
        where = f" in {module or Path(last.filename).name} ({Path(last.filename).name}:{last.lineno})"
    message = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}{where}: {message}; rerun with --debug for the traceback"


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status is the command's (2: bad input), or 128 + n after signal n."""
    global _stop
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _stop = _Stop()
    _stop.install()
    try:
        code = args.func(args)
    except BrokenPipeError:  # the reader went away (`agentrl config ... | head`): nothing more to say
        _stop.done = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # not a signal's: a failure nobody turned into an input error
        _stop.done = True
        if not _stop.signals:
            if getattr(args, "debug", False):
                raise
            print(f"error: {_failure(e)}", file=sys.stderr)
            return 1
    except BaseException:
        _stop.done = True
        if not _stop.signals:
            raise
        # Whatever the cancellation or Interrupted raised on its way out: the signal is the news.
    finally:
        _stop.uninstall()
    if not _stop.signals:
        return code
    print(_stop.message(), file=sys.stderr)
    return 128 + _stop.signals[0]


if __name__ == "__main__":
    sys.exit(main())
