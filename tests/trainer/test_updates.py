"""The pieces of an update both training backends share (``agentrl/trainer/updates.py``): how rows
are grouped into micro-batches, the learning-rate schedule, minibatches and each micro-batch's share."""

import random
from itertools import pairwise

import pytest
import torch

from agentrl.trainer.backend import Batch
from agentrl.trainer.updates import Updates, bucket, live_rows, lr_schedule, pack, scatter


def lengths_and_rows(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(40)]
    return lengths, rng.sample(range(40), 25)


@pytest.mark.parametrize("seed", range(5))
def test_pack_puts_each_row_once_under_the_budget_and_a_longer_row_alone(seed):
    lengths, rows = lengths_and_rows(seed)
    lengths[rows[0]] = 700  # above the budget: alone
    groups = pack(lengths, rows, 512)
    assert sorted(r for g in groups for r in g) == sorted(rows)
    for g in groups:
        assert sum(lengths[r] for r in g) <= 512 or len(g) == 1
    assert [rows[0]] in groups
    # first fit, longest first: the row that opened a group fitted in no earlier one
    for i, g in enumerate(groups):
        for later in groups[i + 1 :]:
            assert sum(lengths[r] for r in g) + max(lengths[r] for r in later) > 512


@pytest.mark.parametrize("seed", range(5))
def test_bucket_pads_each_group_to_its_longest_row_within_the_budget(seed):
    lengths, rows = lengths_and_rows(seed)
    groups = bucket(lengths, rows, 512)
    assert sorted(r for g in groups for r in g) == sorted(rows)
    for g in groups:
        longest = max(lengths[r] for r in g)
        assert lengths[g[0]] == longest  # the group's first row sets its width
        assert len(g) * longest <= 512 or len(g) == 1
    widths = [lengths[g[0]] for g in groups]
    assert widths == sorted(widths, reverse=True)  # rows of similar length together


def test_lr_schedule_warms_up_linearly_then_holds_or_decays_to_zero_at_the_end():
    def factors(kind: str) -> list[float]:
        param = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([param], lr=1.0)
        sched = lr_schedule(opt, 4, kind, 20)
        out = []
        for _ in range(21):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    constant, cosine = factors("constant"), factors("cosine")
    assert constant[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and set(constant[4:]) == {1.0}
    assert cosine[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert all(a >= b for a, b in pairwise(cosine[3:]))
    assert cosine[12] == pytest.approx(0.5) and cosine[20] == pytest.approx(0.0, abs=1e-12)


def small_batch() -> Batch:
    lengths = torch.tensor([5, 3, 4, 2])
    ids = torch.zeros((4, 5), dtype=torch.long)
    mask = torch.zeros((4, 5), dtype=torch.bool)
    mask[0, 2:5] = True  # 3 trainable tokens
    mask[2, 1:2] = True  # 1
    mask[3, 1:2] = True  # 1; row 1 has none
    zeros = torch.zeros(4)
    return Batch(ids, lengths, mask, torch.zeros((4, 5)), zeros, torch.arange(4))


def test_a_micro_batch_shares_by_tokens_or_by_rows_and_rows_with_nothing_to_train_are_not_run():
    batch = small_batch()
    assert live_rows(batch) == [0, 2, 3]
    tokens, rows = Updates._share(batch, "token-mean"), Updates._share(batch, "seq-mean-token-mean")
    assert tokens([0, 1]) == 3 and tokens([2, 3]) == 2 and tokens([1]) == 0
    assert rows([0, 1]) == 1 and rows([0, 2, 3]) == 3


def test_minibatches_split_the_batch_at_random_into_near_equal_parts():
    updates = Updates()
    assert updates._set_update_order(2, 6, 1, seed=0, total_steps=10) == 30  # the critic's steps
    batch = small_batch()
    for n, sizes in ((1, [4]), (3, [2, 1, 1]), (9, [1, 1, 1, 1])):
        parts = updates._minibatches(batch, n)
        assert sorted(len(p) for p in parts) == sorted(sizes)
        assert sorted(r for p in parts for r in p) == [0, 1, 2, 3]
    orders = {tuple(updates._minibatches(batch, 1)[0]) for _ in range(20)}
    assert len(orders) > 1  # drawn again each time, from the backend's generator


def test_scatter_puts_each_rows_tokens_back_from_column_one():
    batch = small_batch()
    flat = torch.arange(1.0, 1 + (5 - 1) + (4 - 1))  # rows 0 and 2: 4 + 3 per-token values
    out = scatter(flat, batch, [0, 2])
    assert out.tolist() == [[0, 1, 2, 3, 4], [0, 5, 6, 7, 0]]
