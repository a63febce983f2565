"""What a run reports: one line per iteration, and at the end the held-out success before and after,
``summary.json`` and the learning curve (``curve.png``, with matplotlib)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from agentrl.trainer.build import Run
from agentrl.trainer.evaluation import evaluate
from agentrl.trajectory import STATUSES

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
        "eval_tasks": len(run.splits.held_out),
    }
    for key, name in (("eval_success_sampled", "sampled"), ("eval_pass_at_n", "pass_at_n")):
        if key in evals_after:  # with metrics.eval_samples > 0
            summary[f"eval_before_{name}"] = evals_before.get(key, float("nan"))
            summary[f"eval_after_{name}"] = evals_after[key]
    summary["seconds"] = time.monotonic() - run.started_at
    # JSON has no NaN (no held-out task, or none measured before a resume): null in the file
    nulls = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}
    (cfg.run_dir / "summary.json").write_text(json.dumps(nulls, indent=2, allow_nan=False))
    curve = plot_curve(
        run.metrics.read(), cfg.run_dir / "curve.png", before, after, n_eval=len(run.splits.held_out)
    )
    run.store.close()
    run.metrics.close()
    await run.engine.close()
    measured = (
        f"held-out success {before:.3f} -> {after:.3f}"
        if run.splits.held_out
        else "no held-out tasks (env.eval_tasks=0)"
    )
    run.log(
        f"{cfg.run.name}: {measured} over {cfg.run.iterations} iterations "
        f"in {summary['seconds']:.0f}s; curve {curve or '(matplotlib not installed)'}"
    )
    return summary


def plot_curve(
    records: list[dict[str, Any]], path, before: float, after: float, n_eval: int = 0
) -> str | None:
    """Two panels over the policy updates done. Top: training success (the share of the iteration's
    sampled episodes that succeed) and held-out success before RL, at every evaluation and after RL, with a band of
    ±1 standard error from the number of held-out tasks (``n_eval``; none when 0). Bottom: how the
    training episodes ended, as stacked shares of each iteration's episodes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    its = [r["iteration"] for r in records]
    done = its[-1] + 1 if its else 0  # policy updates done by the end of the run
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8.4, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    top.plot(its, [r.get("success_rate", float("nan")) for r in records], ".-", label="training success")
    # iteration i samples the policy after i updates; an evaluation in its record follows update i + 1
    evals = {r["iteration"] + 1: r["eval_success"] for r in records if "eval_success" in r}
    points = sorted({0: before, **evals, done: after}.items())
    xs, ps = [x for x, _ in points], [p for _, p in points]
    top.plot(
        xs,
        ps,
        "o--",
        color="C3",
        label=f"held-out success ({n_eval} tasks, greedy)" if n_eval else "held-out success",
    )
    if n_eval:
        se = [math.sqrt(max(p * (1 - p), 0.0) / n_eval) if p == p else float("nan") for p in ps]
        top.fill_between(
            xs,
            [p - e for p, e in zip(ps, se, strict=True)],
            [p + e for p, e in zip(ps, se, strict=True)],
            color="C3",
            alpha=0.18,
            label="±1 s.e.",
        )
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("success")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    top.grid(alpha=0.3)
    shares = {status: [] for status in STATUSES}
    for r in records:
        counts = r.get("statuses") or {}
        total = sum(counts.values()) or 1
        for status in STATUSES:
            shares[status].append(counts.get(status, 0) / total)
    base = [0.0] * len(its)
    for i, status in enumerate(STATUSES):
        if any(shares[status]):
            bottom.bar(its, shares[status], bottom=base, width=0.8, color=f"C{i}", label=status)
            base = [b + v for b, v in zip(base, shares[status], strict=True)]
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("episodes")
    bottom.set_xlabel("policy updates done (0: after the warm start)")
    if any(any(v) for v in shares.values()):  # a record without statuses draws no bar
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
