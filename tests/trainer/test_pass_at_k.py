"""pass@k is the unbiased estimator, and intervals shrink with more tasks."""

import itertools
import math

import pytest

from agentrl.trainer.evaluation import mean_ci95, pass_at_k


def test_pass_at_k_matches_counting_subsets():
    # the share of k-subsets of the n samples that hold at least one success, counted directly
    for n, c, k in itertools.product(range(1, 7), range(7), range(1, 7)):
        if c > n or k > n:
            continue
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        direct = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(direct)


def test_pass_at_k_bounds_and_errors():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 2, 1) == 0.5
    with pytest.raises(ValueError, match="n=2, c=1, k=3"):
        pass_at_k(2, 1, 3)


def test_mean_ci95():
    assert mean_ci95([1.0]) == (1.0, 0.0)
    mean, half = mean_ci95([0.0, 1.0] * 50)
    assert mean == 0.5 and half == pytest.approx(1.96 * math.sqrt(0.25 * 100 / 99 / 100))
    assert mean_ci95([0.0, 1.0] * 200)[1] < half
