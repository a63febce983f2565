import json
import subprocess
import sys

from agentrl.cli import main


def test_quickstart_command_runs_the_trainer(tmp_path, capsys):
    # The quickstart recipe, cut down to one iteration; the full run's figures are in the README.
    code = main(
        [
            "quickstart",
            "--iterations=1",
            f"run.output_dir={tmp_path}",
            "sft.episodes=4",
            "sft.epochs=1",
            "env.eval_tasks=2",
            "rollout.tasks_per_iteration=2",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=24",
            "metrics.progress=false",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "done: held-out success" in out
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["iterations"] == 1
    assert (tmp_path / "quickstart" / "curve.png").stat().st_size > 0
    assert main(["quickstart", "optim.actor_lrr=1"]) == 2
    assert "Did you mean 'optim.actor_lr'?" in capsys.readouterr().err


def test_cli_help_and_version(capsys):
    assert main([]) == 2
    assert "quickstart" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("agentrl ")
