"""A run's directory: a new run does not mix with an earlier one there (it stops, or replaces it
with ``run.overwrite``), a failed start leaves the directory as it was, and weights that cannot be
loaded (a damaged checkpoint, a file that is not weights, other shapes) stop with one line."""

import json
import shutil

import torch

from agentrl.cli import main
from agentrl.store import TrajectoryStore
from tests.trainer.test_trainer import ROOT, TOY

RECIPE = str(ROOT / "recipes/quickstart.yaml")
SMALL = [*TOY, "env.args={}", "env.eval_tasks=2", "sft.episodes=0", "algo.critic_warmup=0"]
SMALL += ["rollout.tasks_per_iteration=2", "rollout.n_samples=2", "run.name=run"]


def train(tmp_path, *overrides) -> int:
    return main(["train", RECIPE, *SMALL, f"run.output_dir={tmp_path}", *overrides])


def iterations(run) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_new_run_stops_where_another_is_unless_told_to_resume_or_replace_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tmp_path, "run.iterations=2") == 0
    config = (run / "config.json").read_text()
    capsys.readouterr()
    assert train(tmp_path, "run.iterations=1", "model.tiny_hidden=32") == 2
    err = capsys.readouterr().err
    assert f"{run} holds a training run (2 iterations of metrics, checkpoint iter-000002, a summary)" in err
    assert "set run.resume=true to continue it, run.overwrite=true to replace it" in err
    # nothing of the first run was touched, its config included
    assert iterations(run) == [0, 1] and (run / "config.json").read_text() == config
    # a store inside the run that a replacement would delete is named
    store = f"sft.from_store={run / 'trajectories'}"
    assert train(tmp_path, "run.iterations=1", "run.overwrite=true", store) == 2
    assert "run.overwrite=true would delete sft.from_store=" in capsys.readouterr().err
    init = f"model.init={run / 'checkpoints' / 'iter-000002'}"
    assert train(tmp_path, "run.iterations=1", "run.overwrite=true", init) == 2
    assert f"run.overwrite=true would delete {init}, which is inside {run}" in capsys.readouterr().err
    assert train(tmp_path, f"sft.from_store={tmp_path / 'nowhere'}") == 2
    assert f"sft.from_store={tmp_path / 'nowhere'} is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()
    assert train(tmp_path, "run.iterations=1", "run.overwrite=true", "run.resume=true") == 2
    assert "set one of them" in capsys.readouterr().err
    # replaced: the earlier run's checkpoints, metrics and episodes are gone, not mixed in
    episodes = len(list((run / "trajectories").rglob("*.jsonl*")))
    overwrite = ["run.iterations=1", "run.overwrite=true", "model.tiny_hidden=32", "env.eval_tasks=0"]
    assert train(tmp_path, *overwrite) == 0
    assert iterations(run) == [0]
    # no held-out task: nothing measured, null in a file that stays JSON (which has no NaN)
    text = (run / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["eval_before"] is None
    assert "run: no held-out tasks (env.eval_tasks=0) over 1 iterations" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000001"]
    assert json.loads((run / "config.json").read_text())["model"]["tiny_hidden"] == 32
    assert episodes > 0 and len(list((run / "trajectories").rglob("*.jsonl*"))) <= episodes


def test_weights_that_cannot_be_loaded_stop_with_one_line_naming_them(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(tmp_path, "run.iterations=2") == 0
    config, summary = (run / "config.json").read_text(), (run / "summary.json").read_text()
    capsys.readouterr()
    # resumed with no iteration left to train: said, and the finished run's summary kept
    assert train(tmp_path, "run.iterations=2", "run.resume=true") == 2
    err = capsys.readouterr().err
    assert "holds iteration 2 of run, and run.iterations=2: set run.iterations above 2" in err
    assert (run / "summary.json").read_text() == summary and iterations(run) == [0, 1]
    # resumed with other model settings: the shapes and the run's own settings are named
    assert train(tmp_path, "run.iterations=3", "run.resume=true", "model.tiny_hidden=32") == 2
    err = capsys.readouterr().err
    assert f"run.resume: cannot load checkpoint {run}/checkpoints/iter-000002" in err
    assert "its weights have other shapes than the model's: " in err and "more)" in err
    assert f"resume with those in {run}/config.json" in err and len(err) < 800
    assert (run / "config.json").read_text() == config  # a start that failed rewrote nothing
    # a damaged checkpoint: named, with the way back to the one before it
    backend = run / "checkpoints" / "iter-000002" / "backend.pt"
    backend.write_bytes(backend.read_bytes()[:1000])
    assert train(tmp_path, "run.iterations=3", "run.resume=true") == 2
    err = capsys.readouterr().err
    assert (
        "cannot load checkpoint" in err
        and "delete " in err
        and "iter-000002 to resume from the one before" in err
    )
    # model.init: not weights at all, an empty file, a tensor instead of a state dict
    (tmp_path / "notes.pt").write_text("not weights")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    for name, why in [
        ("notes.pt", "it is not a file of PyTorch weights, or it is cut short (UnpicklingError)"),
        ("empty.pt", "it is not a file of PyTorch weights, or it is cut short (EOFError)"),
        ("tensor.pt", "TypeError: Expected state_dict to be dict-like"),
    ]:
        assert main(["eval", RECIPE, *SMALL, f"model.init={tmp_path / name}"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: model.init: cannot load {tmp_path / name} into the tiny model: {why}"
        ), err
        assert "weights_only" not in err and len(err.splitlines()) == 1


def test_a_kill_between_the_checkpoint_and_its_metrics_line_loses_no_record(tmp_path):
    run = tmp_path / "run"
    assert train(tmp_path, "run.iterations=3", "env.eval_tasks=0") == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # as if killed after iteration 2's checkpoint was renamed into place, before its line was written
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:2]))
    assert train(tmp_path, "run.iterations=4", "env.eval_tasks=0", "run.resume=true") == 0
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert iterations(run) == [0, 1, 2, 3] and after[2] == lines[2]


def stored(run) -> dict[int, list[str]]:
    """Each iteration's episodes in the run's store: the weight version of each one's first turn."""
    by_iteration: dict[int, list[str]] = {}
    for t in TrajectoryStore(run / "trajectories").read():
        by_iteration.setdefault(t.extra["iteration"], []).append(t.weight_versions[0])
    return dict(sorted(by_iteration.items()))


def test_a_run_resumed_after_a_kill_mid_run_keeps_one_record_and_one_set_of_episodes_per_iteration(
    tmp_path,
):
    run = tmp_path / "run"
    assert train(tmp_path, "run.iterations=3", "env.eval_tasks=0") == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    whole = stored(run)
    assert list(whole) == [0, 1, 2] and all(v == [str(i)] * 4 for i, v in whole.items())
    # as if killed while writing iteration 2's metrics line, its checkpoint not yet in place: the
    # resumed run redoes iteration 2, whose episodes are already in the store
    shutil.rmtree(run / "checkpoints" / "iter-000003")
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:2]) + lines[2][:25])
    assert train(tmp_path, "run.iterations=3", "env.eval_tasks=0", "run.resume=true") == 0
    assert iterations(run) == [0, 1, 2]
    # the same weight versions as the run that was not stopped, each iteration's episodes once
    assert stored(run) == whole
    superseded = list((run / "trajectories").glob("*.superseded"))
    assert len(superseded) == 1
    assert not superseded[0].match("*.jsonl.gz")  # out of the store, and of datasets' glob
    copy = tmp_path / "superseded" / "w0-00000.jsonl.gz"
    copy.parent.mkdir()
    copy.write_bytes(superseded[0].read_bytes())
    assert {t.extra["iteration"] for t in TrajectoryStore(copy.parent).read()} == {2}
