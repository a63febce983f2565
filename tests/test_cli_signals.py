"""SIGTERM and SIGINT stop a running ``agentrl rollout`` with one line, no traceback, and the exit
status of the signal (128 + its number); a second signal while it stops changes nothing else."""

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Many short episodes (one turn each), so the rollout is still running when the signal comes.
ROLLOUT = [
    "rollout",
    str(ROOT / "recipes/rollout_bugfix_tiny.yaml"),
    "sandbox.kind=local",
    "collect.tasks=200",
    "rollout.n_samples=1",
    "rollout.concurrency=2",
    "rollout.max_turns=1",
    "metrics.progress=false",
]


def _as_in_a_terminal() -> None:
    # A command started in the background by a non-interactive shell (`make test &`, some CI
    # runners) inherits SIGINT ignored, and keeps it so, as it should; the user's Ctrl-C this test
    # plays comes to a command run in the foreground, where SIGINT has its default action.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(store: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", *ROLLOUT, f"collect.store={store}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_in_a_terminal,
    )


def test_signals_stop_a_running_rollout_with_one_line(tmp_path):
    trials = {  # the signals each run gets, 10 ms apart, and the exit status it must end with
        "term": ([signal.SIGTERM], {143}),
        "int": ([signal.SIGINT], {130}),
        # The second comes while the first stops the run (or both are pending at once): the run
        # ends at once, with the status of whichever reached the handler first.
        "twice": ([signal.SIGTERM, signal.SIGINT], {130, 143}),
    }
    # Side by side: most of each run is starting up (imports, the tiny model).
    procs = {name: _start(tmp_path / name) for name in trials}
    try:
        deadline = time.monotonic() + 120
        waiting = set(trials)
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                # The first stored trajectory: episodes are running, sandboxes are open.
                if any((tmp_path / name).glob("*.jsonl.gz")) or procs[name].poll() is not None:
                    for signum in trials[name][0]:
                        procs[name].send_signal(signum)
                        time.sleep(0.01)
                    waiting.discard(name)
            time.sleep(0.05)
        errs = {name: procs[name].communicate(timeout=120)[1] for name in trials}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name, (signals, codes) in trials.items():
        err, code = errs[name], procs[name].returncode
        assert code in codes, (name, code, err)
        for noise in ("Traceback", "Exception ignored", "Task exception was never retrieved"):
            assert noise not in err, (name, err)
        lines = err.splitlines()
        # Other lines are the sandboxes' log warnings; the stop is said once, last.
        assert [line for line in lines if line.startswith("agentrl: ")] == [lines[-1]], (name, err)
        first = signal.Signals(code - 128).name
        if len(signals) == 1:
            assert lines[-1] == f"agentrl: interrupted by {first}; stopped.", (name, err)
        else:
            assert lines[-1].startswith(f"agentrl: interrupted by {first}"), (name, err)


def test_main_gives_the_signal_handlers_back(capsys):
    from agentrl.cli import main

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["envs"]) == 0
    assert "bugfix-v0" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in before} == before


def test_sigterm_leaves_no_docker_container(tmp_path):
    """SIGTERM to `agentrl rollout` on Docker sandboxes, at ten moments of its run (containers being
    created, running, being removed): every run ends with 143 and leaves no container behind."""
    from tests.conftest import require_docker

    require_docker()
    import docker

    client = docker.from_env()

    def containers_of(pid: int) -> list:
        # sparse: the list as the daemon gives it, with no inspect of each container after it (one
        # removed in between would raise NotFound; the runs create and remove them all the time)
        return client.containers.list(
            all=True, sparse=True, filters={"label": ["agentrl.sandbox=1", f"agentrl.pid={pid}"]}
        )

    runs = []
    for i in range(10):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentrl.cli",
                *ROLLOUT,
                "sandbox.kind=docker",
                "rollout.concurrency=6",
                f"collect.store={tmp_path / str(i)}",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        runs.append((proc, 0.15 * i))  # seconds after its first container before the signal
    try:
        pending = dict(enumerate(runs))
        seen: dict[int, float] = {}
        deadline = time.monotonic() + 240
        while pending and time.monotonic() < deadline:
            for i, (proc, delay) in list(pending.items()):
                if i not in seen and (containers_of(proc.pid) or proc.poll() is not None):
                    seen[i] = time.monotonic()
                if i in seen and time.monotonic() >= seen[i] + delay:
                    proc.send_signal(signal.SIGTERM)
                    del pending[i]
            time.sleep(0.02)
        results = [(proc.pid, proc.communicate(timeout=120)[1], proc.returncode) for proc, _ in runs]
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
    time.sleep(1.0)  # a removal the daemon was still finishing
    left = {pid: [c.short_id for c in containers_of(pid)] for pid, _, _ in results}
    assert [code for _, _, code in results] == [143] * 10, [err[-800:] for _, err, _ in results]
    assert all(not ids for ids in left.values()), left
    assert not any("Traceback" in err for _, err, _ in results)
