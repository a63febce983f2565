"""Attacks on the sandboxes, run for real: escapes from the timeout and from close(), what the
sandbox's user can reach on the host, writes to Python's import path, and gc under churn."""

import asyncio
import contextlib
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from agentrl.sandbox import SandboxError, make_sandbox
from agentrl.sandboxes.docker import OUTPUT_DIR, RESULT_DIR, RUNNER, RUNNER_PATH
from tests.conftest import require_docker
from tests.sandboxes.test_sandbox import SETTINGS, run, sandbox, still_running

AS_ROOT = os.geteuid() == 0
# Every way a child can leave the command's process group, session or environment.
ESCAPES = (
    "sleep 1301 & "
    "(setsid env -i sleep 1302 &); "
    "(env -u AGENTRL_EXEC setsid sleep 1303 &); "
    "(nohup sh -c 'sleep 1304' > /dev/null 2>&1 &); "
    "(setsid sh -c '(sleep 1305 &)' &); "
)


@pytest.fixture(params=["docker", "local"])
def backend(request):
    if request.param == "docker":
        require_docker()
    return request.param


def host_processes(pattern: str) -> str:
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return "\n".join(line for line in found.splitlines() if "pgrep" not in line)


def test_nothing_escapes_the_timeout_or_close(backend):
    async def go():
        async with sandbox(backend) as sb:
            r = await sb.exec(ESCAPES + "sleep 1300", timeout=2)
            assert r.timed_out and r.duration_s < 2 + 2
            assert await still_running(backend, sb, "sleep 130") == ""
            # Background processes of a command that ends normally: Docker keeps them (a server the
            # agent starts), the local backend does not; either way none outlives the sandbox.
            r = await sb.exec(ESCAPES + "echo started", timeout=10)
            assert r.output == "started\n" and r.duration_s < 5
        assert host_processes("sleep 130") == ""

    run(go())


HOPPERS = (
    "for i in 1 2 3 4 5 6; do python3 -c 'import os\nwhile True:\n    if os.fork(): os._exit(0)' & done; "
    "sleep 100"
)
# Each hop leaves an exited process until the container's init reaps it, and those count against
# the pids limit: on a loaded machine they reached the tests' 128 in 6 of 10 runs, and the runner
# then rightly reports a fork bomb (and kills all of the user's processes), which is another test's
# case. The hoppers' sandbox has room for them.
HOPPERS_PIDS = 4096


def test_processes_that_keep_moving_to_new_pids_do_not_outlive_a_reset():
    """A process that forks and exits again and again (a new pid faster than one pass over /proc)
    does not live on into the next user of a pooled sandbox: the reset kills with kill(-1)."""
    require_docker()

    async def go():
        async with sandbox("docker", pids=HOPPERS_PIDS) as sb:
            await sb.exec(f"({HOPPERS}) > /dev/null 2>&1 &", timeout=10)  # left running by the episode
            assert await sb.reset()
            left = await sb.exec("sleep 1; ps -eo args | grep -c '[p]ython3 -c'", timeout=10)
            assert left.output.strip() == "0", left.output

    run(go())


def test_processes_that_keep_moving_to_new_pids_do_not_outlive_a_timeout():
    """Processes that keep forking, started by a command that times out, are all gone after it (taken
    one pid at a time, some survived 6 of 10 such commands); a process that an earlier command left
    running goes on, neither killed nor left stopped."""
    require_docker()

    async def go():
        async with sandbox("docker", pids=HOPPERS_PIDS) as sb:
            await sb.exec("(sleep 1401 > /dev/null 2>&1 &); echo started", timeout=10)
            for _ in range(3):
                r = await sb.exec(HOPPERS, timeout=2)
                assert r.timed_out
                left = await sb.exec("sleep 0.5; ps -eo args | grep -c '[p]ython3 -c'", timeout=10)
                assert left.output.strip() == "0", left.output
            return await sb.exec("ps -eo stat,args | grep '[s]leep 1401'", timeout=10)

    older = run(go())
    assert older.output.split()[0].startswith("S"), older.output  # sleeping: not stopped ("T")


def test_the_runner_leaves_the_commands_umask_as_docker_sets_it():
    """The runner makes each output file writable by the sandbox's user, in a subshell of its own: the
    command's umask stays Docker's 0022, and the files it creates are 644 (one version gave it 0077)."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            return await sb.exec("umask; touch made; stat -c %a made", timeout=10)

    assert run(go()).output == "0022\n644\n"


def test_the_runner_ends_its_watchdog_though_its_signal_and_its_wake_up_are_lost():
    """The runner ends its watchdog with a file the watchdog looks for at every tick. Under load (32
    sandboxes on 2 cores) the SIGTERM it sent before was lost about once in 4,000 commands, and a line
    on the pipe the watchdog waits on, tried instead, was lost more often (bash's read -t took it and
    reported a timeout): the runner waited, and the caller gave the sandbox up for dead. Here the
    runner is started with SIGTERM ignored (a bash script cannot trap or undo that) and without its
    wake-up line."""
    require_docker()
    wake_ups = [line for line in RUNNER.split("\n") if line.endswith(">&4")]
    assert len(wake_ups) == 1, wake_ups  # the runner's wake-up line (end_watchdog's)

    async def go():
        async with sandbox("docker") as sb:
            await install_runner(sb, lambda lines: [line for line in lines if line not in wake_ups])
            ignore_term = ("bash", "-c", 'trap "" TERM; exec bash "$@"', "agentrl")
            return await run_runner(sb, COPY, uuid.uuid4().hex, "echo hello", before=ignore_term)

    assert run(go()) == f"hello\n\n{NONCE} 0 0 0 6 0\n".encode()


NONCE = "x"  # the trailer's secret for run_runner


async def run_runner(
    sb,
    runner: str,
    tag: str,
    cmd: str,
    wait_s: float = 15,
    before: tuple[str, ...] = ("bash",),
    cap: int = 1000,
) -> bytes:
    """Run a copy of the Docker runner at ``runner`` in ``sb`` as ``Sandbox.exec`` does (with
    ``before`` the runner's path in the arguments: the bash that runs it), a 20 s timeout, an output
    cap of ``cap`` bytes; its raw output (the trailer's secret is NONCE)."""
    uid, gid = await sb._user_ids(sb.config.user)
    api = sb._client.api
    argv = [*before, runner, "20.000", str(cap), tag, OUTPUT_DIR, uid, gid, RESULT_DIR, "0", cmd]
    exec_id = api.exec_create(sb.container_id, argv, user="root", environment={"AGENTRL_TRAILER": NONCE})
    try:
        return await asyncio.wait_for(asyncio.to_thread(api.exec_start, exec_id["Id"]), wait_s)
    except TimeoutError:
        return b"the runner did not end"


COPY = "/tmp/runner"  # where install_runner puts its copy of the runner

# runners, processes of the agent, output files
LEFT_BEHIND = f'pgrep -af "^bash {COPY}"; pgrep -u "$1" -a; ls {OUTPUT_DIR}; true'


async def install_runner(sb, edit) -> None:
    """A copy of the Docker runner at COPY, its lines changed by ``edit(lines) -> lines``."""
    await sb._call(sb._control, f'printf %s "$1" > {COPY}', "\n".join(edit(RUNNER.split("\n"))))


def insert(lines: list[str], at: str, offset: int, new: str) -> list[str]:
    """``new`` inserted before (offset 0) or after (offset 1) the one line equal to ``at``."""
    assert lines.count(at) == 1, at
    i = lines.index(at) + offset
    return [*lines[:i], new, *lines[i:]]


# after the watchdog's fork; after the command's, before and after the runner has its pid
@pytest.mark.parametrize("where", [("dog=$!", 1), ("pid=$!", 0), ("pid=$!", 1)])
def test_a_cancel_that_lands_while_the_runner_starts_leaves_nothing(where):
    """The caller's cancel (SIGTERM to the runner) can land at any point of the runner, before it waits
    on the command too: under load its first steps take a second. It used to be trapped only then,
    and a cancel that landed before killed the runner and left the command running with no timeout
    (after the command's fork) or the watchdog (after its fork), about once in 100 cancels with 32
    sandboxes on 2 cores. Here the runner cancels itself just after each fork, and its child is slow
    to become the sandbox's user, as under load (a reap by uid cannot find it then)."""
    require_docker()

    def edit(lines):
        fork = '    "${as_user[@]}" bash -c "$cmd" '
        assert sum(line.startswith(fork) for line in lines) == 1
        slow = "    bash -c 'sleep 0.3; exec \"$@\"' slow " + fork.lstrip()
        lines = [slow + line[len(fork) :] if line.startswith(fork) else line for line in lines]
        return insert(lines, where[0], where[1], "kill -TERM $$")

    async def go():
        async with sandbox("docker") as sb:
            await install_runner(sb, edit)
            raw = await run_runner(sb, COPY, uuid.uuid4().hex, "sleep 1411 & sleep 1412")
            await asyncio.sleep(1.0)
            uid, _ = await sb._user_ids(sb.config.user)
            return raw, (await sb._call(sb._control, LEFT_BEHIND, uid))[1]

    raw, left = run(go())
    assert raw == b"", raw  # cancelled: no output, no trailer
    assert left == "", left


def test_a_cancel_that_comes_before_the_runner_starts_stops_it_when_it_does():
    """Under load the daemon can start a command's runner after the caller's cancel has looked for it:
    the cancel leaves a mark, and a runner that finds it runs nothing."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            tag = uuid.uuid4().hex
            await sb._call(sb._cancel_command, tag)
            raw = await run_runner(sb, RUNNER_PATH, tag, "touch /tmp/ran; sleep 1421")
            uid, _ = await sb._user_ids(sb.config.user)
            _, left = await sb._call(
                sb._control, f"ls /tmp/ran {RESULT_DIR}/*.cancel 2>&1 | grep -v 'No such'; {LEFT_BEHIND}", uid
            )
            r = await sb.exec("echo next")  # the mark stops that runner only
            return raw, left, r.output

    raw, left, after = run(go())
    assert raw == b"", raw
    assert left == "", left
    assert after == "next\n"


def test_results_and_cancel_marks_older_than_ten_minutes_are_swept_by_one_command_in_32():
    """The runner keeps each result (for a caller whose stream was lost) and a cancel leaves a mark;
    those older than 10 min are removed by the commands whose random tag starts with 00 to 07."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            make = f"cd {RESULT_DIR} && touch -d '-11 minutes' old.result old.cancel && touch new.result"
            listed = []
            for tag in ("ff" + uuid.uuid4().hex[2:], "07" + uuid.uuid4().hex[2:]):
                await sb._call(sb._control, make)
                await run_runner(sb, RUNNER_PATH, tag, "true")
                listed.append(
                    (await sb._call(sb._control, f"ls {RESULT_DIR} | grep -E '^(old|new)[.]'"))[1].split()
                )
            return listed

    assert run(go()) == [["new.result", "old.cancel", "old.result"], ["new.result"]]


def test_a_command_that_stops_itself_is_waited_for_until_it_ends():
    """The runner waits on the command until it has ended, not when it is stopped (the watchdog
    stops every process before it kills; a command can stop itself): a stop ends bash's wait, and
    the runner waits again."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            return await sb.exec(
                "(sleep 0.5; kill -CONT $$) & kill -STOP $$; echo resumed; exit 3", timeout=20
            )

    r = run(go())
    assert (r.exit_code, r.output, r.timed_out) == (3, "resumed\n", False), r


FILL_TO_THE_LIMIT = (  # as the sandbox's user: fork until refused, then free 20 processes and leave
    "import os, signal, time\n"
    "kids = []\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(1500)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "for pid in kids[:20]:\n"
    "    os.kill(pid, signal.SIGKILL)\n"
    "    os.waitpid(pid, 0)\n"
    "print(len(kids))\n"
)


def test_processes_that_reach_the_pids_limit_between_commands_are_killed_by_the_next():
    """A fork bomb left in the background can reach the pids limit between two commands; its
    processes then sleep in bash's fork retries, and the next quick commands saw no fork refused
    (about one bomb in 30 on 2 busy cores). The next command kills them and reports it, once; after
    a pool's reset, the next user's command reports nothing."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            fill = f"python3 -c '{FILL_TO_THE_LIMIT}'"
            assert not (await sb.exec("true", timeout=10)).pids_exhausted
            code, forked = await sb._call(sb._control, fill, user=sb.config.user)
            assert code == 0 and int(forked) > 50, forked
            first = await sb.exec("ps -e | wc -l", timeout=10)
            second = await sb.exec("ps -e | wc -l", timeout=10)
            await sb._call(sb._control, fill, user=sb.config.user)
            reset = await sb.reset()
            after_reset = await sb.exec("ps -e | wc -l", timeout=10)
            return first, second, reset, after_reset

    first, second, reset, after_reset = run(go())
    assert first.pids_exhausted and "ran out of processes" in "\n".join(first.notes()), first
    assert int(first.output) < 10, first  # killed before the command ran
    assert not second.pids_exhausted and int(second.output) < 10, second
    assert reset and not after_reset.pids_exhausted and int(after_reset.output) < 10, after_reset


def test_a_watchdog_whose_runner_was_killed_ends():
    """A runner killed outright (SIGKILL, the OOM killer) cannot end its watchdog: left alone, at the
    command's deadline it would kill every process started since, later commands' included."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            await install_runner(sb, lambda lines: insert(lines, "pid=$!", 1, "kill -KILL $$"))
            await run_runner(sb, COPY, uuid.uuid4().hex, "sleep 1431")
            await asyncio.sleep(1.0)
            return (await sb._call(sb._control, f'pgrep -af "^bash {COPY}"; true'))[1]

    assert run(go()) == ""


def test_the_runner_returns_the_output_byte_for_byte_with_or_without_cat():
    """The runner prints a result of at most 16 KiB with bash's read and printf (cat's fork and exec
    cost 1 ms), a longer one or one holding a NUL byte (where read stops) with cat. Every byte value
    comes back unchanged on both sides of that line, under a UTF-8 locale too; and a runner whose cat
    is taken away still returns the short ones."""
    require_docker()
    printable = bytes(range(1, 256)) * 65
    outputs = {
        "short": printable[:1020] + "\u00fcnic\u00f6de\n".encode(),
        "at the line": printable[:16384],
        "blank": b"\n\n  \n",
        "empty": b"",
        "a NUL byte": bytes(range(256)) * 4,
        "above the line": printable[:16385],
    }
    utf8 = ("env", "LANG=C.UTF-8", "bash")

    def no_cat(lines):
        return [line.replace('exec cat "$res"', "exit 99") for line in lines]

    async def go():
        async with sandbox("docker") as sb:
            await install_runner(sb, no_cat)
            got = {}
            for name, data in outputs.items():
                await sb.write_file(f"{sb.workdir}/out", data)
                cmd = f"cat {sb.workdir}/out"
                got[name] = [
                    await run_runner(sb, runner, uuid.uuid4().hex, cmd, before=utf8, cap=65536)
                    for runner in (RUNNER_PATH, COPY)
                ]
            return got

    got = run(go())
    for name, data in outputs.items():
        expected = data + f"\n{NONCE} 0 0 0 {len(data)} 0\n".encode()
        assert got[name][0] == expected, name
        assert (got[name][1] == expected) == (name not in ("a NUL byte", "above the line")), name


def test_a_result_with_no_room_to_keep_is_printed_all_the_same():
    """The runner keeps each result in RESULT_DIR for a caller whose stream was lost. Where there is no
    room to keep it (a diff of hundreds of MiB), it prints the output all the same (its head and tail
    when above CAP) and removes what it could not keep. No room, here: the result is /dev/full."""
    require_docker()
    short = "".join(f"{i}\n" for i in range(20))
    long = "".join(f"{i}\n" for i in range(2000))

    async def go():
        async with sandbox("docker") as sb:
            got = []
            for text in (short, long):
                tag = uuid.uuid4().hex
                await sb._call(sb._control, f"ln -s /dev/full {RESULT_DIR}/{tag}.result")
                raw = await run_runner(sb, RUNNER_PATH, tag, f"seq 0 {text.count(chr(10)) - 1}")
                _, left = await sb._call(sb._control, f"ls {RESULT_DIR} {OUTPUT_DIR} | grep {tag}; true")
                got.append((raw, left))
            return got

    (short_raw, short_left), (long_raw, long_left) = run(go())
    assert short_raw == f"{short}\n{NONCE} 0 0 0 {len(short)} 0\n".encode()
    assert long_raw == f"{long[:500]}{long[-500:]}\n{NONCE} 0 0 0 {len(long)} 0\n".encode()
    assert short_left == long_left == ""


@pytest.mark.slow  # fills a 256 MiB tmpfs in a 1 GiB container: hard on a shared Docker daemon
def test_a_background_writer_costs_later_commands_neither_output_nor_exit_code():
    """A background writer that keeps the (deleted) output file of its command full: the next commands
    still get their output and their exit code (the output and the results shared one tmpfs, and the
    result was lost; now the writer's file is emptied at each command, and room kept for the output)."""
    require_docker()

    async def go():
        async with make_sandbox("docker", memory="1g", max_file_size="1g", grace=5.0) as sb:
            await sb.exec("(while :; do cat /dev/zero; sleep 0.5; done &); echo started", timeout=10)
            await asyncio.sleep(6)
            return [await sb.exec(f"echo hello {i}; exit 3", timeout=20) for i in range(3)]

    found = run(go())
    assert [(r.exit_code, r.output) for r in found] == [(3, f"hello {i}\n") for i in range(3)], found
    assert not any(r.timed_out or r.sandbox_died for r in found)


FORGE = (
    "for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do tr '\\0' ' ' < $f; echo; done 2>/dev/null "
    "| grep -oE '[0-9a-f]{32}' | sort -u | while read -r t; do printf '\\n%s 0 0 0 0 0\\n' \"$t\"; done; "
    "exit 3"
)


def test_a_command_cannot_forge_the_runners_trailer():
    """The trailer the caller trusts starts with a secret the command cannot read (the runner's
    arguments it can: a trailer keyed by them was forged). With the real trailer lost, a command that
    printed trailers for every token it could find is not reported as its forged exit 0."""
    require_docker()

    async def go():
        async with sandbox("docker") as sb:
            found = await sb.exec(FORGE.replace("exit 3", "true"), timeout=20)
            assert found.output.count(" 0 0 0 0 0") >= 1, found.output  # it found the runner's tag
            api = sb._client.api
            start = api.exec_start

            def lose_the_trailer(exec_id, *args, **kwargs):  # as a daemon that dropped the last line
                raw = start(exec_id, *args, **kwargs)
                return raw.rstrip(b"\n").rsplit(b"\n", 1)[0] + b"\n"

            api.exec_start = lose_the_trailer
            sb._recover_output = lambda *args: None
            try:
                return await sb.exec(FORGE, timeout=20)
            finally:
                api.exec_start = start

    r = run(go())
    assert r.exit_code == 125 and "its exit code is unknown" in r.output, (r.exit_code, r.output)


def test_isolation_none_must_be_asked_for(monkeypatch):
    from agentrl.sandboxes import local

    monkeypatch.setattr(local, "bwrap_works", lambda: (False, "bwrap is not installed"))

    async def go():
        with pytest.raises(
            SandboxError, match="needs bubblewrap, but bwrap is not installed.*isolation='none'"
        ):
            async with make_sandbox("local"):
                pass
        async with make_sandbox("local", isolation="none") as sb:
            assert (await sb.exec("echo unisolated", timeout=10)).output == "unisolated\n"

    run(go())


def test_a_mount_race_lost_by_bwrap_is_run_again(monkeypatch, tmp_path):
    """bwrap fails before the command runs when a host mount comes or goes under it (a Docker
    container starting beside the sandbox); commands and file writes run again instead of
    failing, and a command's own failure is not mistaken for it."""
    from agentrl.sandboxes import local

    ok, real = local.bwrap_works()
    if not ok:
        pytest.skip(real)
    tries = tmp_path / "tries"
    flaky = tmp_path / "bwrap"
    # fails twice in every three calls with bwrap's message, as the race does, then runs bwrap
    flaky.write_text(
        "#!/bin/sh\n"
        f"echo x >> {tries}; n=$(wc -l < {tries})\n"
        "if [ $((n % 3)) -ne 0 ]; then\n"
        "  echo \"bwrap: Can't bind mount /oldroot/ on /newroot/: Unable to apply mount flags: "
        'remount \\"/newroot/etc/resolv.conf\\": Invalid argument" >&2; exit 1\n'
        "fi\n"
        f'exec {real} "$@"\n'
    )
    flaky.chmod(0o755)
    monkeypatch.setattr(local, "bwrap_works", lambda: (True, str(flaky)))

    async def go():
        async with make_sandbox("local", isolation="bwrap", **SETTINGS["local"]) as sb:
            result = await sb.exec("echo ran", timeout=10)
            assert (result.exit_code, result.output) == (0, "ran\n")
            await sb.write_file("f.txt", "kept")
            assert await sb.read_file("f.txt") == b"kept"
            ran = len(tries.read_text().splitlines())
            assert ran == 12  # workspace setup, exec, write, read: three calls each
            own = await sb.exec("echo 'mount: Unable to apply mount flags' >&2; exit 1", timeout=10)
            assert own.exit_code == 1 and "mount flags" in own.output
            assert len(tries.read_text().splitlines()) == ran + 3  # the command ran once

    run(go())


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_local_sandbox_user_is_not_host_root(isolation, tmp_path):
    """Started as root, the local sandbox's commands run as a host uid of their own: no mode-0600
    host file, no /etc/shadow, no Docker socket, no write to the Python environment, and nothing
    left running after a command or after close()."""
    if not AS_ROOT:
        pytest.skip("the host-uid drop is what a root process does; here commands run as this user")
    secret_dir = Path("/var/tmp") / f"agentrl-secret-{uuid.uuid4().hex[:8]}"
    secret_dir.mkdir(mode=0o755)
    secret = secret_dir / "key"
    secret.write_text("host secret\n")
    secret.chmod(0o600)
    site = Path(__import__("sysconfig").get_paths()["purelib"])

    async def go():
        async with (
            make_sandbox("local", isolation=isolation, **SETTINGS["local"]) as a,
            make_sandbox("local", isolation=isolation, **SETTINGS["local"]) as b,
        ):
            assert a.uid != b.uid and 0 not in (a.uid, b.uid)  # one host uid per sandbox
            r = await a.exec(
                f"cat {secret}; cat /etc/shadow; echo x > {site}/zzz_probe.pth; "
                f"python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect('/run/docker.sock')\"; "
                "id -u",
                timeout=20,
            )
            assert "host secret" not in r.output and "root:" not in r.output
            assert not (site / "zzz_probe.pth").exists()
            assert r.output.split()[-1] != "0"
            assert "Permission denied" in r.output or "No such file" in r.output
            await a.exec("(setsid env -i sleep 1311 &); sleep 1312 & echo bg", timeout=10)
            assert host_processes("sleep 131") == ""  # gone with their command, whatever they did
            if isolation == "none":  # kill -9 -1 as the sandbox's uid reaches only its own processes
                r = await b.exec("kill -9 -1; echo survived", timeout=10)
                assert r.output == "survived\n"
        assert host_processes("sleep 131") == ""

    try:
        run(go())
    finally:
        secret.unlink()
        secret_dir.rmdir()


def test_agent_cannot_write_the_runner_or_the_import_path(backend):
    """The reward hack of a .pth file on Python's path (or an edited runner) has nowhere to go."""

    async def go():
        async with sandbox(backend) as sb:
            listing = await sb.exec(
                "python3 -c 'import sys; print(\"\\n\".join(p for p in sys.path if p))'", timeout=20
            )
            paths = [p for p in listing.output.split() if not p.startswith(sb.workdir)]
            assert paths
            probe = "; ".join(f"test -w {p} && echo WRITABLE {p}" for p in paths) + "; true"
            assert "WRITABLE" not in (await sb.exec(probe, timeout=20)).output
            user_site = await sb.exec("python3 -c 'import site; print(site.ENABLE_USER_SITE)'", timeout=20)
            assert user_site.output.strip() == "False"
            if backend == "docker":
                r = await sb.exec(f"echo 'echo forged' > {RUNNER_PATH}; ls -ld {OUTPUT_DIR}", timeout=10)
                assert "Permission denied" in r.output
                with pytest.raises(PermissionError, match="outside the workspace"):
                    await sb.write_file(RUNNER_PATH, "echo forged\n")
                assert (await sb.exec("echo genuine", timeout=10)).output == "genuine\n"

    run(go())


def test_gc_survives_containers_coming_and_going():
    """`agentrl sandbox gc` while other containers are created and removed under it: 20 of 20 runs."""
    require_docker()
    import docker

    from agentrl.sandboxes.docker import LABEL, gc

    client = docker.from_env()
    run_label = f"churn-{uuid.uuid4().hex[:8]}"
    stop = threading.Event()

    def churn():
        # The low-level calls: the high-level create inspects the container after making it, which
        # the gc under test may have removed by then.
        while not stop.is_set():
            with contextlib.suppress(docker.errors.APIError):  # gc may be removing it already
                made = client.api.create_container(
                    "agentrl/base:bookworm",
                    ["true"],
                    labels={LABEL: "1", "agentrl.run": run_label, "agentrl.pid": "999999999"},
                )
                client.api.remove_container(made["Id"], force=True)

    workers = [threading.Thread(target=churn) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        outcomes = []
        for _ in range(20):
            try:
                gc(run=run_label)
                outcomes.append("ok")
            except Exception as e:  # the failure this test exists to catch
                outcomes.append(repr(e))
    finally:
        stop.set()
        for w in workers:
            w.join()
        gc(run=run_label)
    assert outcomes == ["ok"] * 20


def test_write_file_keeps_the_mode_and_reads_back_large_files(backend):
    async def go():
        async with sandbox(backend) as sb:
            await sb.exec("printf '#!/bin/sh\\necho old\\n' > run.sh && chmod 755 run.sh", timeout=10)
            await sb.write_file("run.sh", "#!/bin/sh\necho new\n")
            r = await sb.exec("./run.sh; stat -c %a run.sh", timeout=10)
            assert r.output.split() == ["new", "755"]
            data = os.urandom(300_000)  # several chunks through the Docker exec path
            await sb.write_file("blob.bin", data)
            assert await sb.read_file("blob.bin") == data
            await sb.write_file("empty.txt", b"")
            assert await sb.read_file("empty.txt") == b""

    run(go())


def test_writing_into_a_fifo_is_refused_at_once(backend):
    # opening a FIFO to write blocks until a reader comes: the editor would wait out its timeout
    async def go():
        async with sandbox(backend) as sb:
            await sb.exec("mkfifo notes.txt && ln -s notes.txt link", timeout=10)
            for path in ("notes.txt", "link"):
                start = time.monotonic()
                with pytest.raises(IsADirectoryError, match=f"{path} is not a regular file"):
                    await sb.write_file(path, "text\n")
                assert time.monotonic() - start < 10, path
            r = await sb.exec("test -p notes.txt && echo fifo", timeout=10)
            assert r.output.strip() == "fifo"

    run(go())


def test_a_file_operation_that_hangs_is_an_error_the_agent_reads(monkeypatch):
    import agentrl.sandboxes.local as local

    monkeypatch.setattr(local, "FILE_OP_TIMEOUT", 1.0)
    monkeypatch.setattr(local, "FILE_OPS", "sleep 30")  # stands in for whatever wedges one

    async def go():
        async with sandbox("local") as sb:
            start = time.monotonic()
            with pytest.raises(PermissionError, match="cannot write a.txt in the sandbox: .* within 1s"):
                await sb.write_file("a.txt", "text\n")
            assert time.monotonic() - start < 10
            assert (await sb.exec("echo alive", timeout=10)).output == "alive\n"

    run(go())


def test_a_file_operation_at_the_pids_limit_kills_the_agents_processes_and_says_so():
    """A fork bomb left in the background holds the pids limit when the editor is called: the file
    operation cannot start, and rather than a misleading error (a fork failure read as a missing
    permission), the agent's processes are killed, as the next command would, and the agent is told."""
    require_docker()
    fill = FILL_TO_THE_LIMIT.replace("for pid in kids[:20]:\n", "for pid in []:\n")  # keep them all

    async def go():
        async with sandbox("docker") as sb:
            await sb.write_file("a.txt", "before\n")
            code, forked = await sb._call(sb._control, f"python3 -c '{fill}'", user=sb.config.user)
            assert code == 0 and int(forked) > 50, forked
            with pytest.raises(PermissionError, match="had run out of processes .* Try again"):
                await sb.write_file("a.txt", "after\n")
            await sb.write_file("a.txt", "after\n")  # and again, now that they are gone
            return await sb.read_file("a.txt"), await sb.exec("ps -e | wc -l", timeout=10)

    data, after = run(go())
    assert data == b"after\n" and int(after.output) < 10, after
