import json
import subprocess
import sys

from agentrl.cli import main
from tests.trainer.test_trainer import SMALL_QUICKSTART


def test_quickstart_command_runs_the_trainer(tmp_path, capsys):
    code = main(["quickstart", "--iterations=1", f"run.output_dir={tmp_path}", *SMALL_QUICKSTART])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "done: held-out success" in out
    assert f"curve.png in {tmp_path / 'quickstart'}/" in out  # the run's own directory, announced
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
