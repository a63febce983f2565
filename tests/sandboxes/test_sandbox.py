"""The sandbox protocol, run on both backends against a real Docker engine and real bubblewrap."""

import asyncio
import time
from pathlib import Path

import pytest

from agentrl.sandbox import ExecResult, SandboxError, SandboxPool, make_sandbox, within
from tests.conftest import require_docker

REPO = Path(__file__).resolve().parents[2]
# Small limits so that the hostile commands below hit them fast.
SETTINGS = {
    "docker": {"memory": "256m", "pids": 128, "tmp_size": "64m", "max_file_size": "100m", "grace": 5.0},
    "local": {"memory": "256m", "processes": 128, "max_file_size": "100m"},
}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["docker", "local"])
def backend(request):
    if request.param == "docker":
        require_docker()
    return request.param


def sandbox(backend, **overrides):
    return make_sandbox(backend, **{**SETTINGS[backend], **overrides})


async def still_running(backend, sb, pattern: str) -> str:
    """Processes matching ``pattern`` that are still alive (inside the container, or on this host)."""
    if backend == "docker":
        out = await sb.exec(f"ps -eo args | grep -F '{pattern}' | grep -v grep || true", timeout=10)
        return out.output.strip()
    proc = await asyncio.create_subprocess_exec("pgrep", "-af", pattern, stdout=asyncio.subprocess.PIPE)
    return (await proc.communicate())[0].decode().strip()


def test_exec_merges_output_in_order_and_reports_exit_code(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec("echo one; echo two >&2; echo three; exit 7", timeout=10)
            assert (r.exit_code, r.output, r.timed_out, r.sandbox_died) == (
                7,
                "one\ntwo\nthree\n",
                False,
                False,
            )
            await sb.exec("mkdir -p sub", timeout=10)
            r = await sb.exec('pwd; echo "$GREETING"', timeout=10, cwd="sub", env={"GREETING": "hello"})
            assert r.output == f"{sb.workdir}/sub\nhello\n"

    run(go())


def test_a_command_longer_than_one_argument_can_hold_runs(backend):
    """A command above 128 KiB, what one argument (``bash -c CMD``) can hold: a heredoc writing a
    large file, or a test run naming thousands of test ids, runs as a short command does."""
    body = "\n".join(f"line {i} \u00fcnic\u00f6de" for i in range(20000))  # 0.35 MB

    async def go():
        async with sandbox(backend) as sb:
            cmd = f"cat > big.txt <<'EOF'\n{body}\nEOF\nwc -l < big.txt; ls /proc/self/fd | wc -l; exit 3"
            r = await sb.exec(cmd, timeout=30)
            assert r.exit_code == 3, r.output
            lines, fds = r.output.split()
            assert int(lines) == 20000
            assert (await sb.read_file("big.txt")).decode() == body + "\n"
            # the file the command came in is not handed down to what it starts
            assert fds == (await sb.exec("ls /proc/self/fd | wc -l", timeout=10)).output.strip()

    run(go())


def test_long_output_keeps_head_and_tail_with_marker(backend):
    async def go():
        async with sandbox(backend, output_cap=1000) as sb:
            r = await sb.exec("seq 1 100000", timeout=20)
            assert r.truncated and r.output.startswith("1\n2\n3\n") and r.output.endswith("99999\n100000\n")
            total = sum(len(f"{i}\n") for i in range(1, 100001))
            assert f"bytes of output cut; {total} in all" in r.output

    run(go())


def test_timeout_kills_the_whole_tree_within_a_second(backend):
    async def go():
        async with sandbox(backend) as sb:
            start = time.perf_counter()
            r = await sb.exec("sleep 1231 & (setsid sleep 1232 &) ; sleep 1233", timeout=2)
            elapsed = time.perf_counter() - start
            assert r.timed_out and r.exit_code == 124
            assert elapsed < 2 + 1, elapsed
            assert await still_running(backend, sb, "sleep 123") == ""

    run(go())


def test_background_process_does_not_stall_the_call(backend):
    async def go():
        async with sandbox(backend) as sb:
            start = time.perf_counter()
            r = await sb.exec("sleep 60 & echo started", timeout=30)
            assert r.output == "started\n" and r.exit_code == 0
            assert time.perf_counter() - start < 5

    run(go())


def test_fork_bomb_is_contained_and_never_hangs_the_caller(backend):
    async def go():
        async with sandbox(backend) as sb:
            start = time.perf_counter()
            r = await sb.exec("bomb() { bomb | bomb & wait; }; bomb", timeout=5)
            assert time.perf_counter() - start < 5 + 2  # the limit's kill or the timeout's, never later
            if backend == "docker" or sb._cgroup is not None:
                assert r.pids_exhausted and r.exit_code == 137 and not r.ok
                assert "ran out of processes" in "\n".join(r.notes())
            else:
                assert r.timed_out or r.exit_code != 0
            again = await sb.exec("echo recovered", timeout=10)
            assert again.output == "recovered\n" and not again.pids_exhausted
        async with sandbox(backend) as sb:
            # The classic one backgrounds itself and returns at once; in Docker it is caught when it
            # reaches the limit, and every later call returns at once with the sandbox usable.
            first = await sb.exec(":(){ :|:& };:", timeout=5)
            calls = [first]
            for _ in range(3):
                t = time.perf_counter()
                calls.append(await sb.exec("echo alive; ps -e | wc -l", timeout=5))
                assert time.perf_counter() - t < 5 + 2
            if backend == "docker":  # the local backend kills it with its command, before the limit
                assert any(c.pids_exhausted for c in calls)
            else:  # and waits until it is gone: the next command neither fails to start nor is blamed
                for c in calls[1:]:
                    assert c.output.split()[0] == "alive" and not c.pids_exhausted, c
            last = calls[-1]
            assert last.output.split()[0] == "alive" and not last.sandbox_died
            assert int(last.output.split()[1]) < 20  # the bomb is gone, not just paused

    run(go())


def test_memory_hog_is_killed_and_reported(backend):
    async def go():
        async with sandbox(backend) as sb:
            if backend == "local" and sb._cgroup is None:
                pytest.skip(
                    "no cgroup for the local sandbox here: memory is an rlimit, and oom_killed is not reported"
                )
            r = await sb.exec("python3 -c 'x = bytearray(600 * 2**20); print(len(x))'", timeout=30)
            assert r.oom_killed and r.exit_code == 137 and not r.sandbox_died
            assert (await sb.exec("echo fine", timeout=10)).output == "fine\n"

    run(go())


def test_kill_everything_as_the_agent(backend):
    async def go():
        # The non-root agent kills only its own processes: the sandbox survives, and a command that
        # takes itself down with them is reported as killed.
        async with sandbox(backend) as sb:
            r = await sb.exec("sleep 300 & kill -9 -1; echo survived", timeout=10)
            assert r.output == "survived\n" and not r.sandbox_died and await sb.alive()
            r = await sb.exec("sh -c 'kill -9 -1'; echo unreachable", timeout=10)
            assert (r.exit_code, r.output, r.killed, r.sandbox_died) == (137, "", True, False)
            assert "[the command was killed by SIGKILL]" in r.notes()
            assert (await sb.exec("echo ok", timeout=10)).output == "ok\n"
        if backend == "local":
            return
        # As root it takes the keep-alive down: reported dead, and a fresh sandbox works.
        async with sandbox(backend, user="root") as sb:
            r = await sb.exec("kill -9 -1", timeout=10)
            assert r.sandbox_died and not await sb.alive()
            again = await sb.exec("echo hi", timeout=10)
            assert again.sandbox_died
        async with sandbox(backend) as fresh:
            assert (await fresh.exec("echo fresh", timeout=10)).output == "fresh\n"

    run(go())


def test_disk_filling_is_bounded(backend):
    async def go():
        async with sandbox(backend) as sb:
            # Every file is capped at max_file_size (100m) on every storage driver: SIGXFSZ, exit 153.
            r = await sb.exec(
                "dd if=/dev/zero of=big bs=1M count=300 2>/dev/null; echo $?; stat -c %s big", timeout=60
            )
            status, size = r.output.split()[-2:]  # after bash's "File size limit exceeded" notice
            assert status == "153" and int(size) <= 100 * 2**20
            if backend == "docker":
                # /tmp is a 64m tmpfs.
                r = await sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=90", timeout=60)
                assert r.exit_code != 0 and "No space left on device" in r.output
                # The total of the writable layer is enforced only where the storage driver can;
                # the sandbox says which (overlay2 on ext4 here cannot: see sandboxes/docker.py).
                assert isinstance(sb.disk_limit_enforced, bool)

    run(go())


def test_no_network_no_host_files_not_root(backend):
    async def go():
        async with sandbox(backend) as sb:
            if backend == "docker":
                r = await sb.exec("ls /sys/class/net", timeout=10)
            else:
                r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1", timeout=10)
            assert r.output.split() == ["lo"]
            r = await sb.exec(f"test -e {REPO}/Makefile && echo visible || echo hidden; id -u", timeout=10)
            visible, uid = r.output.split()
            assert visible == "hidden" and uid != "0"

    run(go())


def test_files_and_diff(backend, tmp_path):
    async def go():
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
        async with sandbox(backend) as sb:
            await sb.upload(str(tmp_path / "pkg"), "pkg")
            await sb.write_file("notes/a.txt", "hello\n")
            assert await sb.read_file("notes/a.txt") == b"hello\n"
            assert await sb.read_file(f"{sb.workdir}/pkg/mod.py") == b"x = 1\n"
            r = await sb.exec("cat pkg/mod.py notes/a.txt && echo more >> notes/a.txt", timeout=10)
            assert r.output == "x = 1\nhello\n"
            diff = await sb.diff()
            assert "+++ b/notes/a.txt" in diff and "+more" in diff and "+++ b/pkg/mod.py" in diff
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")

    run(go())


def test_the_diff_keeps_bytes_that_are_not_utf8_and_applies_elsewhere(backend, tmp_path):
    """A Latin-1 line edited beside another one: the diff comes back byte for byte (read as text it
    would hold U+FFFD, and no longer apply) and applies in another sandbox's copy of the tree."""

    async def go():
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "lat.py").write_bytes(b"# caf\xe9\nx = 1  # \xe0\n")
        async with sandbox(backend) as sb:
            await sb.upload(str(tmp_path / "pkg"), "pkg")
            await sb.exec("git add -A && git -c user.email=a@b -c user.name=a commit -qm base", timeout=30)
            base = (await sb.exec("git rev-parse HEAD", timeout=10)).output.strip()
            await sb.exec("printf '# caf\\351\\nx = 2  # \\340\\n' > pkg/lat.py", timeout=10)
            patch = await sb.diff(base)
            assert "\ufffd" not in patch and "-x = 1  # \udce0" in patch and "+x = 2  # \udce0" in patch
            await sb.exec(f"git reset -q --hard {base}", timeout=10)
            await sb.write_file("fix.patch", patch)
            r = await sb.exec("git apply fix.patch && rm fix.patch", timeout=10)
            assert r.exit_code == 0, r.output
            assert await sb.read_file("pkg/lat.py") == b"# caf\xe9\nx = 2  # \xe0\n"

    run(go())


def test_a_diff_cut_by_the_output_limit_is_an_error_not_a_shorter_patch():
    from agentrl.sandbox import ExecResult, SandboxError, read_diff

    class Cut:
        workdir = "/w"

        async def exec(self, cmd, timeout=None, output_cap=None):
            return ExecResult(0, "ZGlmZiAtLWdpdCBh[agentrl: 12 bytes of output were lost]Yi9j")

    with pytest.raises(SandboxError, match="the diff of /w was cut: it is over 192 MiB"):
        run(read_diff(Cut(), "HEAD"))


def test_file_operations_stay_inside_the_workspace(backend):
    """The tools' file operations resolve paths in the sandbox, symlinks included, and refuse any
    outside the workspace: an error the agent can read, nothing written."""

    async def go():
        async with sandbox(backend) as sb:
            await sb.exec(
                "ln -s /etc out && ln -s .. up && mkdir -p d && ln -s ../d/f.txt d/self", timeout=10
            )
            for path in (
                "../../etc/passwd",
                "/etc/passwd",
                "out/passwd",
                "up/x",
                "/usr/lib/python3/dist-packages/zzz_probe.pth",
            ):
                with pytest.raises(PermissionError, match="outside the workspace"):
                    await sb.read_file(path)
                with pytest.raises(PermissionError, match="outside the workspace"):
                    await sb.write_file(path, "import probe_hook\n")
            with pytest.raises(PermissionError, match="outside the workspace"):
                await sb.exec("true", timeout=5, cwd="../..")
            await sb.write_file("d/self", "through a link inside\n")  # resolves inside: allowed
            assert await sb.read_file("d/f.txt") == b"through a link inside\n"
            with pytest.raises(IsADirectoryError):
                await sb.read_file("d")
            await sb.exec("mkfifo pipe", timeout=5)
            with pytest.raises(IsADirectoryError, match="not a regular file"):
                await sb.read_file("pipe")  # a FIFO would block a reader forever
            r = await sb.exec(
                "ls /usr/lib/python3/dist-packages/zzz_probe.pth /etc/zzz 2>&1 | wc -l", timeout=5
            )
            assert r.output.strip() == "2"  # two "No such file" lines: nothing was written

    run(go())


def test_unisolated_local_sandboxes_get_their_own_tmpdir():
    """Without bubblewrap /tmp is the host's: each sandbox's TMPDIR is its own, emptied by reset, gone at close."""

    async def go():
        async with sandbox("local", isolation="none") as a, sandbox("local", isolation="none") as b:
            dirs = [(await sb.exec('echo "$TMPDIR"', timeout=5)).output.strip() for sb in (a, b)]
            assert dirs[0] != dirs[1] and all(Path(d).is_dir() for d in dirs)
            for sb, d in zip((a, b), dirs, strict=True):
                assert not d.startswith(sb.workdir)  # scratch files stay out of the workspace's diff
                await sb.exec('echo mine > "$TMPDIR/f"', timeout=5)
            assert (Path(dirs[0]) / "f").read_text() == "mine\n"
            assert await a.reset() and list(Path(dirs[0]).iterdir()) == []  # a reused sandbox's is empty
        return dirs

    assert not any(Path(d).exists() for d in run(go()))


def test_cancellation_cleans_up(backend):
    async def go():
        async with sandbox(backend) as sb:
            task = asyncio.ensure_future(sb.exec("sleep 1240", timeout=60))
            await asyncio.sleep(1.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            assert await still_running(backend, sb, "sleep 1240") == ""

        async def episode():
            async with sandbox(backend) as sb:
                await sb.exec("sleep 1241", timeout=60)

        task = asyncio.ensure_future(episode())
        await asyncio.sleep(1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The no_leaked_containers fixture checks the container is gone when the suite ends.

    run(go())


def assert_nothing_left(backend, sb, delay) -> None:
    """No container (docker) or workspace (local) of ``sb`` is left."""
    if backend == "docker" and sb.container_id is not None:
        import docker

        with pytest.raises(docker.errors.NotFound):
            docker.from_env().containers.get(sb.container_id)
    if backend == "local" and sb.workdir:
        assert not Path(sb.workdir).exists(), (delay, sb.workdir)


def test_cancelled_start_leaves_nothing_behind(backend):
    """An episode cancelled while its sandbox is still starting (a deadline, a shutdown) leaves no
    container or workspace behind, whichever step of the start the cancellation lands in."""

    async def episode(sb):
        async with sb:
            await asyncio.sleep(60)

    async def go():
        for delay in (0.0, 0.05, 0.2, 0.6, 1.5):
            sb = sandbox(backend)
            task = asyncio.ensure_future(episode(sb))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(2.0)  # a create still running in a worker thread would finish by now
            assert_nothing_left(backend, sb, delay)

    run(go())


def test_a_cancel_that_lands_as_the_awaited_command_ends_is_not_lost():
    """The sandboxes bound their waits with ``within``: Python 3.11's ``asyncio.wait_for`` returns
    the result when a cancel lands in the same loop step as the awaited thing ends, and the
    cancelled episode ran on (a start cancelled as its workspace setup ended slept its 60 s)."""

    async def race(wait):
        done = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(wait(done, 10))
        await asyncio.sleep(0)  # the waiter awaits `done`
        done.set_result("finished")
        waiter.cancel()  # in the same step
        try:
            return await waiter
        except asyncio.CancelledError:
            return "cancelled"

    async def go():
        assert await race(within) == "cancelled"
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.05)
        assert await within(asyncio.sleep(0, "value"), 1) == "value"

    run(go())


def test_cancelled_bare_start_leaves_nothing_behind(backend):
    """The same for a caller that awaits start() itself, with no ``async with`` to clean up after it."""

    async def go():
        for delay in (0.0, 0.05, 0.2, 0.6):
            sb = sandbox(backend)
            task = asyncio.ensure_future(sb.start())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:  # it finished before the cancel landed: an ordinary close removes what it made
                await sb.close()
            await asyncio.sleep(2.0)
            assert_nothing_left(backend, sb, delay)

    run(go())


def test_bad_input_gets_clear_errors(backend):
    async def go():
        async with sandbox(backend) as sb:
            with pytest.raises(TypeError, match="must be a str .* got list"):
                await sb.exec(["ls", "-l"])
            with pytest.raises(ValueError, match="timeout must be a positive number"):
                await sb.exec("true", timeout=-1)

    run(go())
    with pytest.raises(ValueError, match="memory must be a positive size like '512m'.* got 'lots'"):
        make_sandbox(backend, memory="lots")
    with pytest.raises(ValueError, match="has no setting 'memroy'. Did you mean 'memory'"):
        make_sandbox(backend, memroy="1g")


def test_unknown_backend_and_missing_image():
    with pytest.raises(
        ValueError,
        match="unknown sandbox backend 'dokcer'; known backends: docker, local. Did you mean 'docker'",
    ):
        make_sandbox("dokcer")
    require_docker()

    async def go():
        with pytest.raises(SandboxError, match="image 'agentrl/no-such-image:1' does not exist"):
            async with make_sandbox("docker", image="agentrl/no-such-image:1"):
                pass

    run(go())
    with pytest.raises(ValueError, match="pids must be a positive integer; got 0"):
        make_sandbox("docker", pids=0)


def test_auto_picks_docker_then_bubblewrap_then_stops_naming_the_opt_in(monkeypatch):
    """``sandbox.kind: auto`` asks each backend class whether it can run here: Docker first (the other
    order with ``prefer="local"``), and with neither it names what each lacks and the explicit opt-in
    for commands without isolation."""
    from agentrl.sandbox import NoSandboxError, resolve_kind
    from agentrl.sandboxes import docker, local

    def machine(engine: bool, bwrap: bool):
        monkeypatch.setattr(docker, "_engine_ready", lambda: engine)
        monkeypatch.setattr(local, "bwrap_works", lambda: (bwrap, "/usr/bin/bwrap" if bwrap else "no bwrap"))

    picks = {}
    for engine, bwrap in ((True, True), (True, False), (False, True)):
        machine(engine, bwrap)
        picks[engine, bwrap] = resolve_kind("auto"), resolve_kind("auto", prefer="local")
    assert picks == {
        (True, True): ("docker", "local"),
        (True, False): ("docker", "docker"),
        (False, True): ("local", "local"),
    }
    machine(False, False)
    assert resolve_kind("docker") == "docker" and resolve_kind("local") == "local"  # as asked
    with pytest.raises(NoSandboxError) as stopped:
        resolve_kind("auto")
    assert "no Docker engine with the base image answers" in str(stopped.value)
    assert "bubblewrap cannot run (no bwrap)" in str(stopped.value)
    assert "sandbox.kind=local with the local backend's isolation: none" in str(stopped.value)
    with pytest.raises(ValueError, match="got 'dokcer'. Did you mean 'docker'"):
        resolve_kind("dokcer")


async def reused(pool, n: int, within: float = 120.0) -> None:
    """Wait until the pool has put ``n`` released sandboxes back after their reset."""
    deadline = asyncio.get_running_loop().time() + within
    while pool.stats["reused"] < n:
        assert asyncio.get_running_loop().time() < deadline, f"no reset finished: {pool.stats}"
        await asyncio.sleep(0.05)


def test_pool_hands_out_reset_sandboxes(backend):
    async def go():
        async with SandboxPool(backend, size=2, **SETTINGS[backend]) as pool:
            sb = await pool.acquire()
            await sb.write_file("junk.txt", "dirty")
            await sb.exec(
                "echo change >> .git/description; mkdir -p d && touch d/x /tmp/leftover", timeout=10
            )
            pool.release(sb)
            for i in range(2):
                await reused(pool, i + 1)  # the background reset is done (slow on a loaded machine)
                async with pool.sandbox() as again:
                    assert await again.diff() == ""
                    r = await again.exec("ls -A; ls -A /tmp", timeout=10)
                    assert "junk.txt" not in r.output and "leftover" not in r.output
            assert pool.stats["cold"] == 0

    run(go())


def test_pool_replaces_a_sandbox_whose_git_was_tampered_with():
    require_docker()

    async def go():
        async with SandboxPool("docker", size=1, **SETTINGS["docker"]) as pool:
            sb = await pool.acquire()
            await sb.exec("git config core.pager 'sh -c evil'", timeout=10)
            pool.release(sb)
            while pool._tasks:
                await asyncio.sleep(0.05)
            fresh = await pool.acquire()
            assert fresh is not sb and pool.stats["replaced"] == 1
            pool.release(fresh)

    run(go())


FSMONITOR_HOOK = r"""cp .git/config .git/orig-config
cat > .git/fsm <<'X'
#!/bin/sh
cp "$PWD/.git/orig-config" "$PWD/.git/config"
setsid sh -c 'while :; do date +%s > "$HOME/planted"; sleep 1; done' > /dev/null 2>&1 < /dev/null &
exit 1
X
chmod +x .git/fsm && git config core.fsmonitor "$PWD/.git/fsm" && echo armed"""


@pytest.mark.parametrize("attack", ["fsmonitor", "fifo", "replace"])
def test_a_reset_runs_none_of_the_agents_git_and_cannot_be_stalled(backend, attack):
    """The agent's git config or hooks never run during the reset (an fsmonitor hook that restores
    the config and leaves a process behind), a FIFO among the hooks cannot stall it, and a replace
    ref cannot stand in for the start commit: the next user gets a clean sandbox, or a new one."""

    async def go():
        async with SandboxPool(backend, size=1, **SETTINGS[backend]) as pool:
            sb = await pool.acquire()
            setup = {
                "fsmonitor": FSMONITOR_HOOK,
                "fifo": "mkfifo .git/hooks/zz && echo armed",
                "replace": "echo planted > planted.py && git add planted.py && "
                "t=$(git write-tree) && c=$(git -c user.name=a -c user.email=a@b commit-tree $t -p HEAD -m x) && "
                "git replace HEAD $c && git reset -q --hard && echo armed",
            }[attack]
            assert "armed" in (await sb.exec(setup, timeout=30)).output
            pool.release(sb)
            deadline = asyncio.get_running_loop().time() + 150
            while pool._tasks:
                assert asyncio.get_running_loop().time() < deadline, "the reset hangs"
                await asyncio.sleep(0.05)
            async with pool.sandbox() as nxt:
                await asyncio.sleep(1.5)  # a planted process would have written by now
                r = await nxt.exec(
                    'ls -A; cat "$HOME/planted" 2>/dev/null; git status --porcelain', timeout=30
                )
                assert "planted" not in r.output, (attack, r.output, pool.stats)
                assert await nxt.diff() == ""

    run(go())


def test_dead_container_is_detected():
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            import docker

            docker.from_env().containers.get(sb.container_id).kill()
            r = await sb.exec("echo hi", timeout=10)
            assert r.sandbox_died and not await sb.alive()
            assert isinstance(r, ExecResult)

    run(go())


def test_task_image_layer_built_offline(tmp_path):
    require_docker()
    from agentrl.sandboxes.images import build_task_image

    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM agentrl/base:bookworm\n"
        "COPY --chown=agent:agent calc.py /testbed/calc.py\n"
        "RUN cd /testbed && git init -q && git add -A && git commit -qm task && chown -R agent:agent /testbed\n"
    )
    tag = "agentrl-test/calc:1"
    build_task_image(tmp_path, tag)

    async def go():
        async with sandbox("docker", image=tag) as sb:
            r = await sb.exec(
                "git log --oneline | wc -l; python3 -c 'import calc; print(calc.add(2, 2))'", timeout=30
            )
            assert r.output.split() == ["1", "0"]
            await sb.exec("sed -i 's/a - b/a + b/' calc.py", timeout=10)
            assert "-    return a - b\n+    return a + b" in await sb.diff()

    try:
        run(go())
    finally:
        import docker

        docker.from_env().images.remove(tag, force=True)


@pytest.mark.parametrize(
    ("backend", "setting", "value", "expected"),
    [
        ("local", "hidden_paths", "/data", "a list of strings"),  # would be hidden letter by letter
        ("docker", "hosts", "tcp://a:2375", "a list of strings"),
        ("docker", "env", "A=1", "a mapping of strings to strings"),
        ("local", "env", {"A": 1}, "a mapping of strings to strings"),
        ("local", "cgroup", "no", "true or false"),  # a non-empty string is truthy
        ("docker", "network", "false", "true or false"),
    ],
)
def test_make_sandbox_names_a_misshapen_setting(backend, setting, value, expected):
    with pytest.raises(ValueError, match=f"backend '{backend}': setting '{setting}' must be {expected}; got"):
        make_sandbox(backend, **{setting: value})


def test_sandbox_kind_and_backend_that_are_not_strings_are_one_clear_error():
    from agentrl.sandbox import resolve_kind

    with pytest.raises(ValueError, match="sandbox kind must be one of auto, docker, local; got None"):
        resolve_kind(None)
    with pytest.raises(ValueError, match="prefer must be 'docker' or 'local'; got 'locl'"):
        resolve_kind("auto", prefer="locl")
    with pytest.raises(
        ValueError, match="sandbox backend is named by a string, one of docker, local; got None"
    ):
        make_sandbox(None)
