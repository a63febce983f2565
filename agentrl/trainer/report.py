"""What a run reports: one line per iteration, and at the end the held-out success before and after,
``summary.json`` and the learning curve (``curve.png``, with matplotlib)."""

from __future__ import annotations

import json
import time
from typing import Any

from agentrl.trainer.build import Run
from agentrl.trainer.evaluation import evaluate

LINE_KEYS = (
    ("reward", "reward_mean"),
    ("success", "success_rate"),
    ("icepop", "icepop_masked_frac"),
    ("clip", "actor/clip_frac"),
    ("kl", "actor/approx_kl"),
    ("ent", "actor/entropy"),
    ("ev", "critic/explained_var_before"),
    ("trunc", "truncation_rate"),
)


def line(record: dict[str, Any]) -> str:
    parts = [f"iter {record['iteration']:3d}"]
    parts += [f"{name} {record[key]:.3f}" for name, key in LINE_KEYS if key in record]
    return "  ".join(parts)


async def finish(run: Run) -> dict[str, Any]:
    cfg = run.cfg
    evals_after = await evaluate(run)
    evals_before = run.state.get("eval_before", {})
    if not isinstance(evals_before, dict):  # a checkpoint written before evaluate() returned a dict
        evals_before = {"eval_success": evals_before}
    before = evals_before.get("eval_success", float("nan"))
    after = evals_after["eval_success"]
    summary = {
        "run_dir": str(cfg.run_dir),
        "iterations": cfg.run.iterations,
        "eval_before": before,
        "eval_after": after,
    }
    for key, name in (("eval_success_sampled", "sampled"), ("eval_pass_at_n", "pass_at_n")):
        if key in evals_after:  # with metrics.eval_samples > 0
            summary[f"eval_before_{name}"] = evals_before.get(key, float("nan"))
            summary[f"eval_after_{name}"] = evals_after[key]
    summary["seconds"] = time.monotonic() - run.started_at
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    curve = plot_curve(run.metrics.read(), cfg.run_dir / "curve.png", before, after)
    run.store.close()
    run.metrics.close()
    await run.engine.close()
    run.log(
        f"{cfg.run.name}: held-out success {before:.3f} -> {after:.3f} over {cfg.run.iterations} iterations "
        f"in {summary['seconds']:.0f}s; curve {curve or '(matplotlib not installed)'}"
    )
    return summary


def plot_curve(records: list[dict[str, Any]], path, before: float, after: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [r["iteration"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(its, [r.get("reward_mean", 0) for r in records], label="train reward")
    ax.plot(its, [r.get("success_rate", 0) for r in records], label="train success")
    evals = [(r["iteration"], r["eval_success"]) for r in records if "eval_success" in r]
    points = [(-1, before), *evals, (its[-1] if its else 0, after)]
    ax.plot([p[0] for p in points], [p[1] for p in points], "o--", label="held-out success")
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
