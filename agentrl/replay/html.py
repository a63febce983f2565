"""One episode as one self-contained HTML page (``agentrl replay --id ID --html OUT.html``).

The page holds the transcript (as the terminal shows it) and the token view: every token of the
episode, turn by turn, coloured by a mode chosen on the page:

- ``mask``: trained (loss mask 1) or not;
- ``gap``: |trainer log-prob − rollout log-prob| of trained tokens (white at 0, red from ``GAP_FULL``);
- ``weight``: the IcePop / TIS weight (green 1, red 0; a dropped token is also struck through);
- ``advantage``: blue below 0, orange above, scaled by the episode's largest |advantage|;
- ``value``: the critic's value, white to purple from the episode's lowest to highest.

The last four need the trainer's per-token stats (``debug.token_stats_every``, read from the run's
``token_stats/``); without them their buttons are disabled and say why. Hovering a token shows its
position, id, text and every annotation. Token texts come from the run's saved tokenizer
(``RUN/tokenizer``); without one the tokens show their ids. Nothing is fetched: the styles, the
data and the script are inline, so the page opens anywhere, offline.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from agentrl.replay.episodes import Episode
from agentrl.replay.transcript import transcript
from agentrl.trajectory import Trajectory

GAP_FULL = 0.5
"""A log-prob gap (nats) drawn at full red in the ``gap`` mode."""
TRAINED_BG, MASKED_BG = "#c6efc6", "#ececec"
MODES = (
    ("mask", "loss mask", None),
    ("gap", "log-prob gap", "logprobs"),
    ("weight", "IcePop weight", "weights"),
    ("advantage", "advantage", "advantages"),
    ("value", "value", "values"),
)

STYLE = """
body{font-family:sans-serif;margin:1em auto;max-width:1200px}
pre.transcript{font-size:12px;background:#fafafa;padding:8px;overflow-x:auto}
.turn{margin:.6em 0;padding:.3em .5em;border-left:4px solid #bbb}
.turn[data-role=assistant]{border-color:#2a2}
.turn h3{font-size:13px;margin:.2em 0;color:#444}
.tokens{font-family:monospace;font-size:12px;line-height:1.7;white-space:pre-wrap;word-break:break-all}
.tok{border-radius:2px;padding:0 1px;margin-right:1px}
.tok.dropped{text-decoration:line-through;outline:1px solid #c00}
#controls{position:sticky;top:0;background:#fff;z-index:1;padding-bottom:2px}
#legend{font-size:12px;color:#333;margin:.3em 0}
fieldset{font-size:13px}
label.off{color:#999}
"""

SCRIPT = """
(function(){
const D = JSON.parse(document.getElementById('episode-data').textContent);
const toks = Array.from(document.querySelectorAll('.tok'));
const GAP_FULL = %(gap_full)s, TRAINED = '%(trained)s', MASKED = '%(masked)s';
function mix(a, b, t){ t = Math.max(0, Math.min(1, t));
  const p = i => parseInt(a.substr(i, 2), 16), q = i => parseInt(b.substr(i, 2), 16);
  return 'rgb(' + [1, 3, 5].map(i => Math.round(p(i) + (q(i) - p(i)) * t)).join(',') + ')'; }
function range(xs){ let lo = Infinity, hi = -Infinity;
  D.mask.forEach((m, i) => { if (m) { lo = Math.min(lo, xs[i]); hi = Math.max(hi, xs[i]); } });
  return [lo, hi]; }
const S = D.stats || {};
const absAdv = S.advantages ? Math.max(1e-9, ...range(S.advantages).map(Math.abs)) : 1;
const vr = S.values ? range(S.values) : [0, 1];
const colour = {
  mask: i => D.mask[i] ? TRAINED : MASKED,
  gap: i => D.mask[i] ? mix('#ffffff', '#e03030', Math.abs(S.logprobs[i] - D.rollout[i]) / GAP_FULL) : MASKED,
  weight: i => D.mask[i] ? mix('#e03030', '#40b040', S.weights[i]) : MASKED,
  advantage: i => !D.mask[i] ? MASKED : S.advantages[i] < 0
      ? mix('#ffffff', '#3060e0', -S.advantages[i] / absAdv) : mix('#ffffff', '#f08020', S.advantages[i] / absAdv),
  value: i => D.mask[i] ? mix('#ffffff', '#8040c0', (S.values[i] - vr[0]) / Math.max(vr[1] - vr[0], 1e-9)) : MASKED,
};
const legend = {
  mask: 'green: trained (loss mask 1); grey: prompt and observations (not trained)',
  gap: 'trained tokens, white (no gap) to red (|trainer - rollout log-prob| >= ' + GAP_FULL + ' nats); grey: not trained',
  weight: 'trained tokens, green (weight 1) to red (0, dropped, struck through); grey: not trained',
  advantage: 'trained tokens, blue (negative) to orange (positive), scaled by the largest |advantage| ' + absAdv.toFixed(4),
  value: 'trained tokens, white (lowest value ' + vr[0].toFixed(4) + ') to purple (highest ' + vr[1].toFixed(4) + ')',
};
function paint(mode){
  toks.forEach(el => { const i = +el.dataset.i; el.style.backgroundColor = colour[mode](i);
    el.classList.toggle('dropped', mode === 'weight' && D.mask[i] && S.weights && S.weights[i] === 0); });
  document.getElementById('legend').textContent = legend[mode];
  document.body.dataset.mode = mode; }
toks.forEach(el => { const i = +el.dataset.i;
  const parts = ['token ' + i, 'id ' + D.ids[i], 'text ' + JSON.stringify(D.texts ? D.texts[i] : ''),
    D.mask[i] ? 'trained' : 'not trained'];
  if (D.mask[i]) { parts.push('rollout log-prob ' + D.rollout[i].toFixed(4));
    if (S.logprobs) parts.push('trainer log-prob ' + S.logprobs[i].toFixed(4),
                               'gap ' + (S.logprobs[i] - D.rollout[i]).toFixed(4));
    if (S.weights) parts.push('weight ' + S.weights[i]);
    if (S.advantages) parts.push('advantage ' + S.advantages[i].toFixed(4));
    if (S.values) parts.push('value ' + S.values[i].toFixed(4)); }
  el.title = parts.join('\\n'); });
document.querySelectorAll('input[name=mode]').forEach(r => r.addEventListener('change', () => paint(r.value)));
paint('mask');
})();
"""


def token_texts(tokenizer_dir: Path | None, ids: list[int]) -> list[str] | None:
    """Each token's text by the run's saved tokenizer; None when there is none or it cannot load."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return [tok.decode([i], skip_special_tokens=False) for i in ids]
    except Exception:  # a tokenizer this transformers cannot read: the page shows ids
        return None


def _transcript_html(episode: Episode) -> str:
    console = Console(record=True, file=io.StringIO(), width=120, highlight=False)
    transcript(console, episode)
    return console.export_html(inline_styles=True, code_format='<pre class="transcript">{code}</pre>')


def page(
    episode: Episode, *, stats: dict[str, list[float]] | None = None, texts: list[str] | None = None
) -> str:
    """The page's HTML: transcript, colour-mode controls, the token view turn by turn, inline data."""
    t: Trajectory = episode.trajectory()
    stats = stats or {}
    data: dict[str, Any] = {
        "ids": t.input_ids,
        "mask": t.loss_mask,
        "rollout": t.rollout_logprobs,
        "texts": texts,
        "stats": stats,
    }
    controls = []
    for mode, label, needs in MODES:
        off = needs is not None and needs not in stats
        why = (
            ' title="not recorded for this episode: train with debug.token_stats_every=N and open an '
            'episode of a recorded iteration"'
            if off
            else ""
        )
        controls.append(
            f'<label{" class=off" if off else ""}{why}><input type="radio" name="mode" value="{mode}"'
            f"{' checked' if mode == 'mask' else ''}{' disabled' if off else ''}> {label}</label>"
        )
    sections = []
    assistant = 0
    for span in t.turns:
        if span.role == "assistant":
            assistant += 1
            head = f"turn {assistant}: assistant"
        else:
            head = "prompt" if span.role == "prompt" else f"turn {assistant}: observation"
        toks = []
        for i in range(span.start, span.end):
            shown = texts[i] if texts is not None else f"{t.input_ids[i]} "
            bg = "#c6efc6" if t.loss_mask[i] else "#ececec"
            toks.append(
                f'<span class="tok" data-i="{i}" style="background-color:{bg}">{html.escape(shown)}</span>'
            )
        trained = sum(t.loss_mask[span.start : span.end])
        sections.append(
            f'<section class="turn" data-role="{html.escape(span.role)}" data-turn="{assistant}">'
            f"<h3>{html.escape(head)} · tokens [{span.start}, {span.end}), {trained} trained</h3>"
            f'<div class="tokens">{"".join(toks)}</div></section>'
        )
    script = SCRIPT % {"gap_full": GAP_FULL, "trained": TRAINED_BG, "masked": MASKED_BG}
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(f"{episode.id} {t.env_id} {t.task_id}")
    recorded = (
        "the trainer's per-token stats of this iteration are shown"
        if stats
        else "no per-token trainer stats for this episode (debug.token_stats_every)"
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head>
<body>
<h1>{title}</h1>
<p>status {html.escape(t.status)} · reward {t.reward:g} · {len(t)} tokens, {t.num_trainable} trained · {recorded}{"" if texts else "; token ids shown (no saved tokenizer)"}</p>
<h2>Transcript</h2>
{_transcript_html(episode)}
<h2>Tokens</h2>
<div id="controls"><fieldset id="modes"><legend>colour by</legend>{" ".join(controls)}</fieldset>
<div id="legend"></div></div>
{"".join(sections)}
<script type="application/json" id="episode-data">{payload}</script>
<script>{script}</script>
</body></html>
"""


def write(episode: Episode, out: str | Path, run_dir: Path | None) -> list[str]:
    """Write ``episode``'s page to ``out``; ``run_dir`` (when the store is a run's) gives the
    trainer's token stats and the tokenizer. Returns the warnings (a damaged token stats file)."""
    from agentrl import token_stats

    t = episode.trajectory()
    stats, damage = token_stats.find(run_dir, t) if run_dir is not None else (None, None)
    texts = token_texts(run_dir / "tokenizer" if run_dir is not None else None, t.input_ids)
    # a lone surrogate (text an env decoded with surrogateescape) is written as its escape, \udcff
    Path(out).write_text(page(episode, stats=stats, texts=texts), encoding="utf-8", errors="backslashreplace")
    return [damage] if damage else []
