import pytest

from agentrl.cli import main
from agentrl.trajectory import Trajectory


def test_rollout_writes_a_store_datasets_can_load(tmp_path, capsys):
    store = tmp_path / "store"
    code = main(
        [
            "rollout",
            "recipes/rollout_bugfix_tiny.yaml",
            f"store={store}",
            "num_tasks=3",
            "n_samples=2",
            "loop.max_turns=2",
        ]
    )
    assert code == 0
    assert "rollout: 6 episodes of bugfix-v0" in capsys.readouterr().out
    import datasets

    ds = datasets.load_dataset("json", data_files=str(store / "*.jsonl.gz"), split="train")
    assert len(ds) == 6
    trajectories = [Trajectory.from_record(row) for row in ds]
    assert {t.sample_index for t in trajectories} == {0, 1}
    assert all(t.env_id == "bugfix-v0" and t.num_trainable > 0 for t in trajectories)


@pytest.mark.parametrize(
    "override,message",
    [
        ("loop.max_turn=3", "the loop section has no setting 'max_turn'. Did you mean 'max_turns'"),
        ("concurency=3", "has no setting 'concurency'. Did you mean 'concurrency'"),
        ("num_tasks=0", "num_tasks must be a positive integer; got 0"),
        ("nonsense", "must look like key=value"),
    ],
)
def test_bad_config_stops_with_a_message(override, message, capsys):
    assert main(["rollout", "recipes/rollout_bugfix_tiny.yaml", override]) == 2
    assert message in capsys.readouterr().err
