"""The episode page (agentrl replay --id ID --html) opened in a real headless Chromium: it loads
with no console error, shows every turn, and switching the colour mode recolours the tokens; and
the trainer's per-token stats (debug.token_stats_every) written, found and shown."""

import asyncio
import io
import json

import pytest
import torch

from agentrl import token_stats
from agentrl.cli import main
from agentrl.env import Task
from agentrl.models import tiny_tokenizer
from agentrl.replay.episodes import read
from agentrl.rollout.agent_loop import LoopConfig, run_episode
from agentrl.store import TrajectoryStore
from agentrl.trainer.backend import Batch
from tests.replay.browser import open_page
from tests.replay.test_replay import ToolEnv
from tests.rollout.fakes import FixedEngine


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def run(tmp_path, tok):
    """A run directory: two episodes of three turns from the real loop, iteration 4, the tokenizer,
    and token stats for them (some tokens dropped by IcePop, advantages of both signs)."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.encode(
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
        add_special_tokens=False,
    )

    async def go():
        return [
            await run_episode(
                ToolEnv(3), FixedEngine([*call, eot]), tok, Task("train-7"), LoopConfig(), sample_index=k
            )
            for k in range(2)
        ]

    trajectories = asyncio.run(go())
    run = tmp_path / "run"
    with TrajectoryStore(run / "trajectories") as s:
        for t in trajectories:
            t.extra["iteration"] = 4
            s.append(t)
    tok.save_pretrained(str(run / "tokenizer"))
    batch = Batch.from_trajectories(trajectories)
    g = torch.Generator().manual_seed(0)
    mask = batch.loss_mask
    batch.old_logprobs = batch.rollout_logprobs + 0.3 * torch.randn(mask.shape, generator=g) * mask
    batch.token_weights = (torch.rand(mask.shape, generator=g) > 0.3).float() * mask
    batch.advantages = torch.randn(mask.shape, generator=g) * mask
    batch.old_values = torch.rand(mask.shape, generator=g) * mask
    token_stats.write(run, 4, trajectories, batch)
    return run, trajectories, batch


def test_token_stats_are_found_for_their_episode_and_aligned_with_its_tokens(run):
    path, trajectories, batch = run
    episodes, _ = read(path / "trajectories")
    for row, episode in enumerate(episodes):
        t = episode.trajectory()
        stats = token_stats.lookup(path, t)
        assert set(stats) == {"logprobs", "weights", "advantages", "values"}
        n = len(t)
        assert all(len(v) == n for v in stats.values())
        assert stats["advantages"] == pytest.approx(batch.advantages[row, :n].tolist(), abs=1e-4)
    other = trajectories[0]
    other.extra["iteration"] = 5  # an iteration that recorded nothing
    assert token_stats.lookup(path, other) is None


def write_page(path, capsys, episode="w0-00000:1"):
    out = path / "episode.html"
    assert main(["replay", str(path), "--id", episode, "--html", str(out)]) == 0
    capsys.readouterr()
    return out


@pytest.mark.parametrize("damage", [lambda b: b[:40], lambda b: b"not gzip"], ids=["truncated", "garbage"])
def test_a_damaged_token_stats_file_is_named_and_the_page_written_without_it(run, capsys, damage):
    path, _, _ = run
    stats = token_stats.path_of(path, 4)
    stats.write_bytes(damage(stats.read_bytes()))
    out = path / "episode.html"
    assert main(["replay", str(path), "--id", "w0-00000:1", "--html", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {stats} cannot be read (")
    assert err[0].endswith("); its per-token stats are left out")
    assert 'value="gap" disabled' in out.read_text()


def test_the_page_in_chromium_shows_every_turn_and_recolours_tokens_by_mode(run, capsys):
    path, trajectories, _ = run
    page_file = write_page(path, capsys)
    t = trajectories[0]
    n_turns = sum(s.role == "assistant" for s in t.turns)

    async def check(page):
        colours = (
            "Array.from(document.querySelectorAll('.tok')).map(e => getComputedStyle(e).backgroundColor)"
        )
        seen = {
            "turns": await page.eval("document.querySelectorAll('section.turn[data-role=assistant]').length")
        }
        seen["headings"] = await page.eval(
            "Array.from(document.querySelectorAll('.turn h3')).map(h => h.textContent)"
        )
        seen["tokens"] = await page.eval("document.querySelectorAll('.tok').length")
        seen["title"] = await page.eval(
            f"document.querySelector('.tok[data-i=\"{t.turns[1].start}\"]').title"
        )
        for mode in ("mask", "gap", "weight", "advantage", "value"):
            await page.eval(f"document.querySelector('input[value={mode}]').click()")
            seen[mode] = await page.eval(colours)
            seen[mode + "_struck"] = await page.eval("document.querySelectorAll('.tok.dropped').length")
        seen["mode"] = await page.eval("document.body.dataset.mode")
        seen["png"] = await page.screenshot()
        seen["errors"] = list(page.errors)
        return seen

    seen = asyncio.run(open_page(page_file, check))
    assert seen["errors"] == []
    assert seen["turns"] == n_turns == 3
    heads = [h.split(" · ")[0] for h in seen["headings"]]
    assert heads == ["prompt"] + [
        f"turn {k}: {part}" for k in (1, 2) for part in ("assistant", "observation")
    ] + ["turn 3: assistant"]
    assert seen["tokens"] == len(t)
    # hovering a trained token: its position, id, text and every annotation
    for key in (
        "token ",
        "id ",
        "text ",
        "rollout log-prob",
        "trainer log-prob",
        "gap ",
        "weight ",
        "advantage ",
        "value ",
    ):
        assert key in seen["title"], key
    trained = [i for i, m in enumerate(t.loss_mask) if m and i]
    masked = [i for i, m in enumerate(t.loss_mask) if not m]
    mask = seen["mask"]
    assert len({mask[i] for i in trained}) == 1 and len({mask[i] for i in masked}) == 1
    assert mask[trained[0]] != mask[masked[0]]
    for mode in ("gap", "weight", "advantage", "value"):  # each mode recolours the trained tokens
        assert [seen[mode][i] for i in trained] != [mask[i] for i in trained], mode
        assert len({seen[mode][i] for i in trained}) > 1, mode
        assert {seen[mode][i] for i in masked} == {mask[masked[0]]}, mode  # observations stay grey
    assert seen["weight_struck"] > 0 and seen["advantage_struck"] == 0
    assert seen["mode"] == "value"
    # the screenshot is a page, not a blank
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(seen["png"]), format="png")
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500
    assert (
        pixels[..., :3].std() > 0.05
        and len({tuple(p) for p in pixels[::23, ::23, :3].reshape(-1, 3).tolist()}) > 5
    )


def test_without_stats_the_modes_that_need_them_are_disabled_and_ids_shown(run, capsys):
    path, _, _ = run
    for f in (path / "token_stats").iterdir():
        f.unlink()
    page = write_page(path, capsys).read_text()
    for mode in ("gap", "weight", "advantage", "value"):
        assert f'value="{mode}" disabled' in page
    assert 'value="mask" checked>' in page
    data = json.loads(
        page.split('<script type="application/json" id="episode-data">')[1].split("</script>")[0]
    )
    assert data["stats"] == {} and len(data["texts"]) == len(data["ids"])  # the run's tokenizer: texts
    assert not any(s in page for s in ('src="http', 'href="http', "@import", "<link"))
