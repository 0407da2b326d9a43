"""Padding rows: token 0 at position 0 in the model's scratch slot (`pad_slot`), so that a padded
row never reads or writes a real sequence's cache."""
from __future__ import annotations

import torch

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, positions, slots


def _pad_values(model) -> tuple[int, int, int]:
    return 0, 0, model.pad_slot


def padding_rows(model, rows: int) -> Inputs:
    """`rows` padding rows on the model's device."""
    return tuple(
        torch.full((rows,), value, dtype=torch.int64, device=model.device) for value in _pad_values(model)
    )


def with_padding(model, inputs: Inputs, rows: int) -> Inputs:
    """`inputs` with `rows` padding rows appended."""
    return tuple(torch.cat([t, pad]) for t, pad in zip(inputs, padding_rows(model, rows)))


def fill_padded(model, static: Inputs, inputs: Inputs) -> None:
    """Copy `inputs` into the first rows of the preallocated `static` inputs and padding into the
    rest (rows a larger batch left behind must not touch its slots)."""
    n = inputs[0].shape[0]
    for buffer, value, pad in zip(static, inputs, _pad_values(model)):
        buffer[:n].copy_(value)
        buffer[n:].fill_(pad)
