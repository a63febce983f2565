import subprocess
import sys

from agentrl import toy
from agentrl.cli import main


def test_toy_ppo_with_critic_and_icepop_learns():
    # Seeded on the CPU; 30 iterations move the greedy score from chance (1/8 per token) to
    # 0.30-0.50 over seeds 0-2, well clear of the +0.1 asserted here.
    result = toy.run(toy.ToyConfig(iterations=30, seed=0), log=lambda _: None)
    assert result["greedy_score_after"] > result["greedy_score_before"] + 0.1, result


def test_cli_help_and_version(capsys):
    assert main([]) == 2
    assert "quickstart" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("agentrl ")
