"""The metrics logger: JSON lines always; the scalars of each record to TensorBoard and W&B when
they are there (each replaced here by a recording fake of the calls the logger makes)."""

import json
import sys
import types

from agentrl.trainer.metrics import MetricsLogger

RECORD = {"iteration": 3, "eval/success": 0.5, "tokens": 1200, "resumed": True, "status": "ok"}
SCALARS = {"iteration": 3, "eval/success": 0.5, "tokens": 1200}


class FakeWriter:
    def __init__(self, log_dir):
        self.log_dir, self.calls = log_dir, []

    def add_scalar(self, tag, value, step):
        self.calls.append(("add_scalar", tag, value, step))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.calls = kwargs, []

    def log(self, scalars, step):
        self.calls.append(("log", scalars, step))

    def finish(self):
        self.calls.append(("finish",))


def test_records_go_to_json_lines_and_their_numbers_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=FakeRun))
    logger = MetricsLogger(tmp_path / "run", wandb=True, config={"seed": 0})
    assert logger._tb.log_dir == str(tmp_path / "run" / "tensorboard")
    assert logger._wandb.init == {
        "project": "agentrl",
        "name": "run",
        "mode": "offline",
        "config": {"seed": 0},
        "dir": str(tmp_path / "run"),
    }
    logger.log(RECORD)
    logger.close()
    assert [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        RECORD
    ]
    # numbers only (a bool is not a scalar), at the record's iteration
    assert logger._tb.calls == [("add_scalar", k, v, 3) for k, v in SCALARS.items()] + [
        ("flush",),
        ("close",),
    ]
    assert logger._wandb.calls == [("log", SCALARS, 3), ("finish",)]


def test_without_tensorboard_or_wandb_only_json_lines(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = MetricsLogger(tmp_path, wandb=True)
    assert logger._tb is None and logger._wandb is None
    assert "metrics.wandb is on but wandb is not installed" in caplog.text
    logger.log(RECORD)
    logger.close()
    assert logger.read() == [RECORD]


def test_a_resume_drops_the_lines_of_iterations_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for i in range(4):
        logger.log({"iteration": i, "loss": float(i)})
    logger.truncate_after(1)
    assert [r["iteration"] for r in logger.read()] == [0, 1]
