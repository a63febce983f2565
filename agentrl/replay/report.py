"""``agentrl report RUN``: a training run on one page.

Reads what a run directory holds (``metrics.jsonl``, one record per iteration; ``summary.json``
once the run has ended; ``config.json``; the trajectory store) and writes, into ``RUN/report/``
(or ``--out``):

- ``curve.png``: held-out success before, at each evaluation and after RL with its ±1 standard
  error band, training success, and how the episodes ended (the run's own learning curve);
- ``diagnostics.png``: reward, the IcePop masked fraction, the actor's clip fraction and
  approximate KL, the critic's explained variance, and throughput, per iteration;
- ``episodes.png``: histograms of the stored training episodes' rewards, turns and tokens;
- ``episodes/<id>.html``: the replay page (``agentrl replay --id ID --html``) of every episode the
  page links: the last iteration's (up to ``LIST_MAX``), its best and worst, and the episodes with
  the largest mean |trainer − rollout log-prob| where the run recorded per-token stats;
- ``index.html``: the page: held-out success before and after with its noise, the figures (inline,
  so the page is one file that reads anywhere), a table per iteration (reward, success, statuses,
  IcePop, clip, KL, explained variance, tokens/s), the links to the episode pages, the config.

A run still going (no ``summary.json``) is reported as far as it has got. What is damaged or of
the wrong type in its files is left out (``agentrl.replay.run_files`` reads them), counted on the
page and named in the warnings ``write`` returns, with damaged token stats files.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from agentrl.replay import run_files
from agentrl.replay.episodes import Episode, ReplayError
from agentrl.replay.run_files import RunData
from agentrl.trajectory import STATUSES, succeeded

EPISODES_EACH = 3
"""Best and worst episodes linked from the page, each."""
LIST_MAX = 64
"""Episodes of the last iteration listed (each with its replay page)."""
COLUMNS = (  # (header, metrics key, format)
    ("reward", "reward_mean", "{:.3f}"),
    ("success", "success_rate", "{:.3f}"),
    ("held-out", "eval_success", "{:.3f}"),
    ("IcePop masked", "icepop_masked_frac", "{:.4f}"),
    ("clip", "actor/clip_frac", "{:.4f}"),
    ("approx KL", "actor/approx_kl", "{:.5f}"),
    ("explained var", "critic/explained_var_before", "{:.3f}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"),
    ("train tok/s", "train_tokens_per_s", "{:.0f}"),
)
PANELS = (  # (title, [(metrics key, label)])
    ("reward", [("reward_mean", "mean reward"), ("success_rate", "training success")]),
    ("IcePop", [("icepop_masked_frac", "masked fraction of trained tokens")]),
    ("actor", [("actor/clip_frac", "clip fraction"), ("actor/approx_kl", "approx KL")]),
    ("critic", [("critic/explained_var_before", "explained variance (before its update)")]),
    ("throughput", [("rollout_tokens_per_s", "rollout tokens/s"), ("train_tokens_per_s", "train tokens/s")]),
)
NUMBERS = tuple(dict.fromkeys([k for _, k, _ in COLUMNS] + [k for _, series in PANELS for k, _ in series]))
"""The metrics the page shows or draws: a number each, where a record holds it."""


def load(run: str | Path) -> RunData:
    """The run's records, summary, config and stored episodes (``run_files.load``), the metrics the
    page shows read as numbers; ``ReplayError`` when it is no run."""
    return run_files.load(run, NUMBERS)


def chosen_episodes(episodes: list[Episode], n: int = EPISODES_EACH) -> tuple[list[Episode], list[Episode]]:
    """The best (highest reward, then fewest tokens) and the worst (lowest reward, an episode that
    did not complete first, then most tokens) of the last iteration with stored episodes."""
    its = [e.iteration for e in episodes if e.iteration is not None]
    last = [e for e in episodes if e.iteration == max(its)] if its else list(episodes)
    best = sorted(last, key=lambda e: (-e.reward, e.tokens))[:n]
    rest = [e for e in last if e not in best]
    worst = sorted(rest, key=lambda e: (e.reward, e.status == "completed", -e.tokens))[:n]
    return best, worst


def _noise(p: float, n: int) -> str:
    if not n or not isinstance(p, int | float) or math.isnan(p):
        return ""
    return f" ± {math.sqrt(max(p * (1 - p), 0.0) / n):.3f}"


def diagnostics_png(records: list[dict[str, Any]], path: Path) -> bool:
    """One panel per ``PANELS`` entry over the iterations; a metric the run did not record is said so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.2 * len(PANELS), 2.8))
    its = [r["iteration"] for r in records]
    for ax, (title, series) in zip(axes, PANELS, strict=True):
        drawn = False
        for key, label in series:
            values = [r.get(key, float("nan")) for r in records]
            if any(isinstance(v, int | float) and v == v for v in values):
                ax.plot(its, values, ".-", label=label)
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def episodes_png(episodes: list[Episode], path: Path) -> bool:
    """Histograms of the stored training episodes: reward, assistant turns, tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 2.6))
    for ax, (title, values) in zip(
        axes,
        (
            ("reward", [e.reward for e in episodes]),
            ("assistant turns", [e.turns for e in episodes]),
            ("tokens", [e.tokens for e in episodes]),
        ),
        strict=True,
    ):
        if values:
            ax.hist(values, bins=min(20, max(1, len(set(values)))), color="C0")
        else:
            ax.text(0.5, 0.5, "no episodes", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} ({len(values)} episodes)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def logprob_gap(run_dir: Path, episode: Episode) -> tuple[float | None, str | None]:
    """Mean |trainer − rollout log-prob| over the episode's trained tokens, where the run recorded
    its token stats (``debug.token_stats_every``); None elsewhere. Second: a warning naming a
    damaged token stats file."""
    from agentrl import token_stats

    if episode.iteration is None or not token_stats.path_of(run_dir, episode.iteration).is_file():
        return None, None
    t = episode.trajectory()
    stats, damage = token_stats.find(run_dir, t)
    if not stats or "logprobs" not in stats:
        return None, damage
    gaps = [
        abs(a - b) for a, b, m in zip(stats["logprobs"], t.rollout_logprobs, t.loss_mask, strict=False) if m
    ]
    return (sum(gaps) / len(gaps) if gaps else None), None


def _img(path: Path, alt: str) -> str:
    if not path.is_file():
        return f"<p><em>{html.escape(alt)}: not drawn (matplotlib is not installed)</em></p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}" style="max-width:100%"></p>'


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    return fmt.format(value) if isinstance(value, int | float) and value == value else ""


def _statuses(record: dict[str, Any]) -> str:
    counts = record.get("statuses") or {}
    return ", ".join(f"{s} {counts[s]}" for s in STATUSES if counts.get(s))


def episode_page(episode: Episode, path: Path, run_dir: Path) -> list[str]:
    """The replay page of one episode (as ``agentrl replay --id ID --html`` writes it); its warnings."""
    from agentrl.replay.html import write

    return write(episode, path, run_dir)


def write(run: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the report of ``run`` into ``out`` (default ``RUN/report``); the page's path and the
    warnings, one line per damaged thing skipped."""
    from agentrl.trainer.report import plot_curve

    data = load(run)
    out = Path(out) if out is not None else data.path / "report"
    try:
        (out / "episodes").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReplayError(
            f"cannot write the report to {out}: {e.strerror or e}; give --out a writable directory"
        ) from None
    s, records = data.summary, data.records
    # null in summary.json: not measured (no held-out task)
    before, after = (float("nan") if s.get(k) is None else s[k] for k in ("eval_before", "eval_after"))
    if not s:  # the run goes on: the last evaluation so far stands for "after"
        evals = [r["eval_success"] for r in records if "eval_success" in r]
        after = evals[-1] if evals else float("nan")
    plot_curve(records, out / "curve.png", before, after, n_eval=data.n_eval)
    diagnostics_png(records, out / "diagnostics.png")

    training = [e for e in data.episodes if e.iteration is not None]
    episodes_png(training, out / "episodes.png")
    pages: dict[str, str] = {}
    warnings = data.warnings

    def link(e: Episode) -> str:
        if e.id not in pages:
            pages[e.id] = e.id.replace(":", "-") + ".html"
            warnings.extend(episode_page(e, out / "episodes" / pages[e.id], data.path))
        return f'<a href="episodes/{html.escape(pages[e.id])}">{html.escape(e.id)}</a>'

    def item(e: Episode, gap: float | None = None) -> str:
        more = f", mean |log-prob gap| {gap:.4f}" if gap is not None else ""
        return (
            f"<li>{link(e)} task {html.escape(e.task)}: {html.escape(e.status)}, reward {e.reward:g}, "
            f"{e.turns} turns, {e.tokens} tokens{more}</li>"
        )

    best, worst = chosen_episodes(data.episodes)
    links = {
        "best": "\n".join(item(e) for e in best) or "<li>no stored episodes</li>",
        "worst": "\n".join(item(e) for e in worst) or "<li>no stored episodes</li>",
    }
    its = [e.iteration for e in training]
    last = [e for e in training if e.iteration == max(its)] if its else []
    shown = last[:LIST_MAX]
    listed = "\n".join(
        f"<tr><td>{link(e)}</td><td>{html.escape(e.task)}</td><td>{html.escape(e.status)}</td>"
        f"<td>{e.reward:g}</td><td>{e.turns}</td><td>{e.tokens}</td><td>{e.trained}</td></tr>"
        for e in shown
    )
    if len(last) > len(shown):
        listed += f"<tr><td colspan=7>… {len(last) - len(shown)} more (agentrl replay lists them)</td></tr>"
    gaps = []
    for e in training:
        gap, damage = logprob_gap(data.path, e)
        if gap is not None:
            gaps.append((gap, e))
        if damage:
            warnings.append(damage)
    gaps.sort(key=lambda x: -x[0])
    by_gap = "\n".join(item(e, g) for g, e in gaps[:EPISODES_EACH]) or (
        "<li>no per-token stats recorded (train with debug.token_stats_every=N)</li>"
    )

    name = html.escape(data.name)
    n = data.n_eval
    gain = after - before if all(isinstance(v, int | float) for v in (before, after)) else float("nan")
    state = "ended" if s else "still going, or stopped before its end (no summary.json)"
    head = (
        f"<p>{len(records)} iterations recorded; the run {state}"
        + (f"; {data.damaged} damaged lines of metrics.jsonl skipped" if data.damaged else "")
        + ".</p>"
    )
    held = (
        f"<p><b>held-out success</b> ({n or 'an unknown number of'} tasks, greedy): "
        f"{before:.3f}{_noise(before, n)} before RL &rarr; {after:.3f}{_noise(after, n)} "
        f"{'after' if s else 'at the last evaluation'} (gain {gain:+.3f}); ± is one standard error.</p>"
    )
    if s.get("seconds") is not None:
        held += f"<p>{s['seconds'] / 60:.1f} minutes in all.</p>"
    rows = [
        "<tr><th>iteration</th>"
        + "".join(f"<th>{h}</th>" for h, _, _ in COLUMNS)
        + "<th>episodes ended</th></tr>"
    ]
    for r in records:
        rows.append(
            f"<tr><td>{r['iteration']}</td>"
            + "".join(f"<td>{_cell(r, k, f)}</td>" for _, k, f in COLUMNS)
            + f"<td>{html.escape(_statuses(r))}</td></tr>"
        )
    config = html.escape(json.dumps(data.config, indent=2)) if data.config else "(no config.json)"
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>agentrl run {name}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:1em auto}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}pre{{font-size:12px;background:#f6f6f6;padding:8px}}</style>
</head><body>
<h1>Run {name}</h1>
{head}
{held}
<h2>Learning curve</h2>
{_img(out / "curve.png", "learning curve")}
<h2>Diagnostics</h2>
{_img(out / "diagnostics.png", "diagnostics")}
<h2>Per iteration</h2>
<table>
{chr(10).join(rows)}
</table>
<h2>Episodes</h2>
{_img(out / "episodes.png", "episodes")}
<h3>best of the last iteration</h3><ul>
{links["best"]}
</ul><h3>worst of the last iteration</h3><ul>
{links["worst"]}
</ul><h3>largest gap between the trainer's and the rollout's log-probs</h3><ul>
{by_gap}
</ul>
<h3>the last iteration's episodes</h3>
<table><tr><th>episode</th><th>task</th><th>status</th><th>reward</th><th>turns</th><th>tokens</th><th>trained</th></tr>
{listed or "<tr><td colspan=7>no stored episodes</td></tr>"}
</table>
<p>Successful episodes (reward {1.0:g}) in the store: {sum(succeeded(e.reward) for e in data.episodes)} of {len(data.episodes)}.</p>
<h2>Config</h2>
<details><summary>config.json</summary><pre>{config}</pre></details>
</body></html>
"""
    (out / "index.html").write_text(page, encoding="utf-8", errors="backslashreplace")
    return out / "index.html", list(dict.fromkeys(warnings))  # one line per damaged file
