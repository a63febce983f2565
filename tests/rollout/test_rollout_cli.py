import pytest

from agentrl.cli import main
from agentrl.trajectory import Trajectory


def test_rollout_writes_a_store_datasets_can_load(tmp_path, capsys):
    store = tmp_path / "store"
    code = main(
        [
            "rollout",
            "recipes/rollout_bugfix_tiny.yaml",
            f"collect.store={store}",
            "collect.tasks=3",
            "rollout.n_samples=2",
            "rollout.max_turns=2",
            "sandbox.kind=local",
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
        ("rollout.max_turn=3", "unknown key 'rollout.max_turn'. Did you mean 'rollout.max_turns'?"),
        ("collect.task=3", "unknown key 'collect.task'. Did you mean 'collect.tasks'?"),
        ("collect.tasks=0", "'collect.tasks': Input should be greater than or equal to 1"),
        ("collect.first_task=99999", "collect.first_task=99999 + collect.tasks=8 is past the 100000 tasks"),
        ("collect.split=dev", "collect.split='dev': environment bugfix-v0 has no such split"),
        ("nonsense", "must look like key=value"),
    ],
)
def test_bad_config_stops_with_a_message(override, message, capsys):
    assert main(["rollout", "recipes/rollout_bugfix_tiny.yaml", override]) == 2
    assert message in capsys.readouterr().err
