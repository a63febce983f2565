"""Input checks shared by the RL maths: shapes, masks and non-finite values, with errors that name the argument."""

from __future__ import annotations

import torch
from torch import Tensor


def check_finite(name: str, x: Tensor) -> None:
    """Raise if ``x`` holds NaN or Inf: training on it silently would poison the run."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()
        first = tuple(int(i) for i in bad[0])
        value = float(x[first])
        raise ValueError(
            f"{name} holds {len(bad)} non-finite value(s) (first {value} at index {first}); "
            f"check the step that produced {name} (a log of 0, an overflow, a division by a zero count)."
        )


def check_same_shape(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    for name, x in others.items():
        if x is not None and x.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must match ([B, T] with one entry per token)."
            )


def as_bool_mask(mask: Tensor, name: str = "mask") -> Tensor:
    """A 0/1 (or bool) mask as bool; any other value is an error rather than a silent weight."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        check_finite(name, mask)
    ok = (mask == 0) | (mask == 1)
    if not bool(ok.all()):
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        raise ValueError(
            f"{name} must hold only 0 and 1 (1 = token the policy generated and is trained on); "
            f"found {float(mask[first])} at index {first}. Pass per-token weights as token_weights instead."
        )
    return mask.to(torch.bool)


def check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T] (batch, tokens); got shape {tuple(x.shape)}.")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true; 0 when there are none."""
    count = mask.sum()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / count.clamp(min=1)


def masked_float(x: Tensor, mask: Tensor, reduce: str, empty: float) -> float:
    """A detached scalar (min/max/mean) of ``x`` over ``mask``; ``empty`` when nothing is selected."""
    selected = x.detach()[mask]
    if selected.numel() == 0:
        return empty
    return float(getattr(selected, reduce)())
