"""Every input error of the CLI is one line, ``error: ...`` naming the value, exit status 2, and
comes before the model loads or an episode runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.cli import build_parser, main
from agentrl.rollout.agent_loop import LoopConfig

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = str(ROOT / "recipes/rollout_bugfix_tiny.yaml")
QUICKSTART = str(ROOT / "recipes/quickstart.yaml")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    """A bad setting must be reported before the model loads (the first expensive step)."""
    import agentrl.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the bad setting was reported")

    monkeypatch.setattr(agentrl.models, "load_model", refuse)
    monkeypatch.setattr(agentrl.models, "tiny_chat_model", refuse)


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.max_turns=abc", "error: invalid config (the override rollout.max_turns=abc): "),
        ("rollout.max_turns=abc", "'rollout.max_turns': Input should be a valid integer"),
        ("rollout.temperature=-1", "'rollout.temperature': Input should be greater than or equal to 0"),
        ("rollout.top_p=1.5", "'rollout.top_p': Input should be less than or equal to 1"),
        ("rollout.tool_format=xml", "'rollout.tool_format': Input should be 'hermes' or 'glm' (got 'xml')"),
        ("rollout=3", "'rollout': Input should be a valid dictionary or instance of RolloutConfig"),
        (
            "engine.kind=sglnag",
            "'engine.kind': unknown engine.kind 'sglnag'. Did you mean 'sglang'? Registered: local, sglang.",
        ),
        ("engine.kind=locl", "unknown engine.kind 'locl'. Did you mean 'local'?"),
        ("trainer.backend=torc", "unknown trainer.backend 'torc'. Did you mean 'torch'?"),
        ("env.id=bugfx-v0", "error: no environment 'bugfx-v0'. Did you mean 'bugfix-v0'? Registered: "),
        (
            "env.args.max_turns=2",
            "error: env.args.max_turns=2: the run sets it from rollout.max_turns; set that instead",
        ),
        ("env.args.sandbox=local", "error: env.args.sandbox='local': the run sets it from sandbox.kind"),
        ("env.args.n_module=2", "takes no argument 'n_module'. Did you mean env.args.n_modules?"),
        ("env.args.n_modules=0", "error: environment bugfix-v0 rejects env.args.n_modules=0"),
        ("env.args=[1]", "'env.args': Input should be a valid dictionary"),
        ("sandbox.kind=vm", "'sandbox.kind': unknown sandbox.kind 'vm'. Known: auto, docker, local."),
        (
            "sandbox.kind=dokcer",
            "unknown sandbox.kind 'dokcer'. Did you mean 'docker'? Known: auto, docker, local.",
        ),
        ("collect.split=dev", "error: collect.split='dev': environment bugfix-v0 has no such split"),
        (
            "collect.store=/proc/agentrl-store",
            "collect.store: cannot create or write in directory /proc/agentrl-store",
        ),
        ("run.seed=[", "error: override 'run.seed=[': '[' is not a YAML value"),
        ("run.device=tpu", "'run.device': Input should be 'auto', 'cpu' or 'cuda' (got 'tpu')"),
        ("algo.value_clip=-0.5", "'algo.value_clip': Input should be greater than 0 (got -0.5)"),
        ("model.tiny_hidden=12", "'model.tiny_hidden': Input should be a multiple of 8 (got 12)"),
        (
            "engine.sync_master=10.0.0.5",
            "'engine.sync_master': '10.0.0.5' is not ADDRESS:PORT (a port from 1 to 65535)",
        ),
    ],
)
def test_rollout_input_errors(override, message, no_model_loads, capsys):
    assert main(["rollout", ROLLOUT, "collect.tasks=1", "sandbox.kind=local", override]) == 2
    assert message in one_error_line(capsys)


def test_launched_servers_whose_ports_run_past_65535_stop_with_one_line(no_model_loads, capsys):
    launch = ["engine.kind=sglang", "engine.launch.server=sglang", "engine.launch.model=m"]
    launch += ["engine.launch.servers=4", "engine.launch.port=65533"]
    assert main(["rollout", ROLLOUT, "sandbox.kind=local", *launch]) == 2
    assert "engine.launch.servers=4 take the ports after engine.launch.port=65533, up to 65537" in (
        one_error_line(capsys)
    )


def test_rollout_store_under_a_file_stops_before_any_episode(tmp_path, no_model_loads, capsys):
    (tmp_path / "file").write_text("")
    assert main(["rollout", ROLLOUT, "sandbox.kind=local", f"collect.store={tmp_path}/file/store"]) == 2
    line = one_error_line(capsys)
    assert (
        f"collect.store: cannot create or write in directory {tmp_path}/file/store (Not a directory)" in line
    )
    assert "choose a writable one" in line


def test_rollout_missing_model(tmp_path, capsys):
    assert (
        main(
            ["rollout", ROLLOUT, "sandbox.kind=local", f"collect.store={tmp_path}", "model.name=/nonexistent"]
        )
        == 2
    )
    assert "error: model.name=/nonexistent: unknown model '/nonexistent': use 'tiny'" in one_error_line(
        capsys
    )


@pytest.mark.parametrize("command", ["rollout", "train", "eval"])
@pytest.mark.parametrize(
    "text,message",
    [
        ("", "holds no settings; write 'key: value' lines in it"),
        ("# only a comment\n", "holds no settings"),
        ("- a\n- b\n", "must hold a mapping of settings ('key: value' lines); it holds a YAML list"),
        ("5\n", "must hold a mapping of settings ('key: value' lines); it holds a YAML scalar: 5"),
        ("a: 1\nb c\nd: 2\n", "line 3, column 1 is not valid YAML (could not find expected ':')"),
    ],
)
def test_config_file_that_is_not_a_mapping(command, text, message, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert main([command, str(path)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and message in line


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize(
    "override,message",
    [
        # sft.episodes > 0 in the recipe: the env is checked before any demonstration is played
        ("env.id=bugfx-v0", "error: no environment 'bugfx-v0'. Did you mean 'bugfix-v0'?"),
        ("rollout.max_turns=0", "'rollout.max_turns': Input should be greater than or equal to 1"),
        ("env.args.n_modules=0", "error: environment bugfix-v0 rejects env.args.n_modules=0"),
        ("env.args.bogus=1", "error: env.args.bogus=1: environment bugfix-v0 takes no argument 'bogus'"),
    ],
)
def test_train_and_eval_env_errors(command, override, message, tmp_path, no_model_loads, capsys):
    assert main([command, QUICKSTART, f"run.output_dir={tmp_path}", override]) == 2
    assert message in one_error_line(capsys)


def test_train_unwritable_output_dir(tmp_path, no_model_loads, capsys):
    (tmp_path / "file").write_text("")
    assert main(["train", QUICKSTART, f"run.output_dir={tmp_path}/file"]) == 2
    line = one_error_line(capsys)
    assert f"error: run.output_dir: cannot create or write in directory {tmp_path}/file/quickstart" in line


def test_flex_attention_stops_a_run_on_the_cpu_before_it_collects(tmp_path, capsys):
    overrides = ["optim.packing=packed", "optim.attention=flex", "sft.episodes=0", "run.device=cpu"]
    assert main(["train", QUICKSTART, f"run.output_dir={tmp_path}", *overrides]) == 2
    line = one_error_line(capsys)
    assert (
        line.startswith("error: optim.attention=flex trains on CUDA only") and "optim.attention=auto" in line
    )
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", ["train", "eval"])
def test_train_and_eval_missing_model(command, tmp_path, capsys):
    assert main([command, QUICKSTART, f"run.output_dir={tmp_path}", "model.name=/nonexistent"]) == 2
    assert "error: model.name=/nonexistent: unknown model '/nonexistent'" in one_error_line(capsys)


def test_the_installed_command_prints_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", ROLLOUT, "rollout.max_turns=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: invalid config (the override rollout.max_turns=0): 'rollout.max_turns': Input should be "
        "greater than or equal "
        "to 1 (got 0)."
    ]


@pytest.mark.parametrize(
    "values,message",
    [
        ({"max_turns": 0}, "loop.max_turns must be an integer >= 1; got 0"),
        ({"max_turns": True}, "loop.max_turns must be an integer >= 1; got True"),
        ({"max_new_tokens": 1.5}, "loop.max_new_tokens must be an integer >= 1; got 1.5"),
        ({"deadline_s": 0}, "loop.deadline_s must be a number of seconds > 0; got 0"),
        ({"temperature": float("nan")}, "loop.temperature must be a number >= 0 (0: greedy); got nan"),
        ({"top_p": 0}, "loop.top_p must be a number in (0, 1]; got 0"),
        ({"top_k": -2}, "loop.top_k must be an integer >= 1, or -1 or 0 for no top-k; got -2"),
        ({"engine_retries": 0}, "loop.engine_retries must be an integer >= 1; got 0"),
        ({"grade_on_truncation": "yes"}, "loop.grade_on_truncation must be true or false; got 'yes'"),
        ({"seed": "1"}, "loop.seed must be an integer or null; got '1'"),
    ],
)
def test_loop_config_checks_each_field(values, message):
    with pytest.raises(ValueError) as e:
        LoopConfig(**values)
    assert str(e.value) == message
    LoopConfig(temperature=0, top_p=1, top_k=0, seed=None, deadline_s=0.5)  # the edges that are allowed


@pytest.mark.parametrize(
    "argv,message",
    [
        # overrides are optional: only the config is named
        (["rollout"], "error: the following arguments are required: config;"),
        (["train"], "error: the following arguments are required: config;"),
        (["eval"], "error: the following arguments are required: config;"),
        (["quickstart", "--iterations", "x"], "error: argument --iterations: invalid int value: 'x'"),
        (["bogus"], "error: argument COMMAND: invalid choice: 'bogus'"),
    ],
)
def test_bad_arguments_are_one_line_too(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith(message) and line.endswith("--help` shows the usage")


@pytest.mark.parametrize(
    "argv,left,command",
    [
        (["train", "recipe.yaml", "--set", "x=1"], "--set x=1", "agentrl train"),
        (["sandbox", "gc", "--bogus"], "--bogus", "agentrl sandbox gc"),
        (["--bogus"], "--bogus", "agentrl"),
    ],
)
def test_arguments_left_over_point_at_their_commands_help(argv, left, command, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: unrecognized arguments: {left};")
    assert line.endswith(f"`{command} --help` shows the usage")


def test_the_parsed_arguments_carry_no_bookkeeping():
    args = build_parser().parse_args(["train", "recipe.yaml", "a.b=1"])
    assert vars(args).keys() >= {"config", "overrides"} and not any(k.startswith("_") for k in vars(args))


@pytest.mark.parametrize(
    "path,message",
    [
        (
            "no-such-recipe.yaml",
            "error: config file no-such-recipe.yaml does not exist; pass the path of a YAML file",
        ),
        (str(ROOT / "recipes"), "Is a directory"),
    ],
)
def test_config_file_that_cannot_be_read(path, message, capsys):
    assert main(["rollout", path]) == 2
    assert message in one_error_line(capsys)


def test_an_unexpected_failure_is_one_line_naming_where_and_debug_shows_the_traceback(monkeypatch, capsys):
    import agentrl.rollout.run

    async def broken(cfg, log=print):
        raise RuntimeError("the backend fell over\n  on two lines")

    monkeypatch.setattr(agentrl.rollout.run, "collect", broken)
    assert main(["rollout", ROLLOUT]) == 1
    line = one_error_line(capsys)
    assert line.startswith("error: RuntimeError in tests.test_cli_errors (test_cli_errors.py:")
    assert line.endswith("the backend fell over on two lines; rerun with --debug for the traceback")
    with pytest.raises(RuntimeError, match="the backend fell over"):
        main(["--debug", "rollout", ROLLOUT])
    with pytest.raises(RuntimeError, match="the backend fell over"):  # where users put it: at the end
        main(["rollout", ROLLOUT, "--debug"])
    assert main(["sandbox", "gc", "--debug", "--host", "unix:///nonexistent/docker.sock"]) == 2  # nested too


def test_config_prints_every_field_with_its_value_default_and_description(capsys):
    assert main(["config", QUICKSTART, "optim.actor_lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert "optim.actor_lr = 0.0003  (default: 0.0001)\n    Learning rate of the policy (AdamW)." in out
    assert "[sandbox]  Where agent commands run." in out and "sandbox.kind = 'auto'\n" in out
    assert out.count(" = ") >= 70
    assert main(["config", QUICKSTART, "optim.actor_lrr=1"]) == 2
    assert "Did you mean 'optim.actor_lr'?" in one_error_line(capsys)


def test_a_bad_value_is_placed_in_the_file_or_the_override_that_set_it(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("optim:\n  actor_lr: -1\n")
    assert main(["config", str(recipe)]) == 2
    assert capsys.readouterr().err.startswith(f"error: invalid config in {recipe}: 'optim.actor_lr'")
    assert main(["config", str(recipe), "optim.actor_lr=2", "algo.clip_low=5"]) == 2
    assert capsys.readouterr().err.startswith("error: invalid config (the override algo.clip_low=5): ")
    assert main(["config", str(recipe), "algo.clip_low=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid config in {recipe} and the override algo.clip_low=5: ")


@pytest.mark.parametrize(
    "override,line",
    [
        # YAML would read these as 1.1, 7, True, a date and None; the shell took any quotes off
        ("model.name=1.10", "model.name = '1.10'"),
        ("run.name=007", "run.name = '007'"),
        ("run.name=yes", "run.name = 'yes'"),
        ("run.name=2026-01-01", "run.name = '2026-01-01'"),
        ("run.name=null", "run.name = 'null'"),
        ("model.init=123", "model.init = '123'"),
        ("model.init=null", "model.init = None\n"),  # null still unsets an optional text field
        ("run.seed=007", "run.seed = 7"),  # a number field reads YAML as ever
        ("env.args.version=1.10", "'version': 1.1"),  # a free-form dict too: no field type to go by
    ],
)
def test_an_override_of_a_text_field_keeps_its_text(override, line, capsys):
    assert main(["config", QUICKSTART, override]) == 0
    assert line in capsys.readouterr().out


def test_a_text_field_that_yaml_reads_as_a_number_in_a_file_says_to_quote_it(tmp_path, capsys):
    recipe = tmp_path / "version.yaml"
    recipe.write_text("model:\n  name: 1.10\n")
    assert main(["config", str(recipe)]) == 2
    assert one_error_line(capsys).endswith(
        "'model.name': Input should be a valid string (got 1.1); write the text in quotes."
    )


def test_rollout_past_the_held_out_tasks_a_layout_holds(monkeypatch, no_model_loads, capsys):
    """A layout too narrow for the held-out tasks asked for stops before the model loads, with the
    number it holds."""
    from agentrl.envs.bugfix import generator

    monkeypatch.setattr(generator, "HELD_OUT_PATIENCE", 2_000)
    narrow = [
        "env.args.n_modules=1",
        "env.args.n_distractors=0",
        "env.args.templates=[safe_divide, discount]",
    ]
    argv = ["rollout", ROLLOUT, "sandbox.kind=local", "collect.split=test", "collect.tasks=50", *narrow]
    assert main([*argv, "env.args.single_bug=false"]) == 2
    line = one_error_line(capsys)
    assert (
        "error: collect.tasks=50: the 'test' split of bugfix-v0: the held-out split holds 1 distinct" in line
    )


@pytest.fixture
def no_server_starts(monkeypatch):
    """A bad address or log directory must be reported before any model loads or server starts."""
    import agentrl.rollout.serve_local
    import agentrl.rollout.sglang_launch

    def refuse(*args, **kwargs):
        raise AssertionError("a server started despite the bad input")

    monkeypatch.setattr(agentrl.rollout.serve_local, "main", refuse)
    monkeypatch.setattr(agentrl.rollout.sglang_launch, "main", refuse)


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_serve_port_out_of_range(port, no_server_starts, capsys):
    for command in (["serve", "local", "--model", "tiny"], ["serve", "sglang", "--model", "m"]):
        assert main([*command, "--port", port]) == 2
        assert one_error_line(capsys) == (
            f"error: --port {port} is not a TCP port; give one from 1 to 65535 (SGLang's is 30000)"
        )


def test_serve_local_on_a_port_in_use_says_so_before_announcing_it(no_server_starts, capsys):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "local", "--model", "tiny", "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: --port {port}: 127.0.0.1:{port} is in use by another server; stop it or give another --port\n"
    )


def test_serve_sglang_log_dir_that_is_a_file(tmp_path, no_server_starts, capsys):
    (tmp_path / "logs").write_text("")
    assert main(["serve", "sglang", "--model", "m", "--log-dir", str(tmp_path / "logs")]) == 2
    assert one_error_line(capsys) == (
        f"error: --log-dir {tmp_path / 'logs'}: a file, not a directory; give a writable directory for the "
        "servers' logs"
    )
