"""Error measures and the accuracy yardstick that `fuse report` and `fuse bench` share."""
from __future__ import annotations

from typing import Callable

import torch

from fuse.padding import Inputs, with_padding
from kernels.linear import MAX_ROWS


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def accuracy(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Max relative error and the share of rows whose top token agrees."""
    return {
        "max_relative_error": relative_error(actual, expected),
        "top1_agreement": (actual.argmax(-1) == expected.argmax(-1)).float().mean().item(),
    }


def restore_point(model) -> Callable[..., None]:
    """Copies of `model.recurrent_state()`; the returned function writes them back into `model`
    or into another model of the same shape, so that the next step there starts from this state
    (cache rows a repeated step rewrites need no copy)."""
    saved = {name: buf.clone() for name, buf in model.recurrent_state().items()}

    def restore(target=model) -> None:
        for name, buf in target.recurrent_state().items():
            buf.copy_(saved[name])

    return restore


def padded_batch_size(batch: int) -> int:
    """Rows of the yardstick's padded step for a batch of `batch`: at least one padding row, and
    past the decode projections' row limit (see `padded_step`)."""
    return max(batch + 1, MAX_ROWS + 1)


def padded_step(model, inputs: Inputs) -> torch.Tensor:
    """The eager step with padding rows appended, its real rows' logits. Enough rows to pass the
    decode projections' row limit: every projection then runs the library GEMM rather than
    `v4::grouped_linear`, whose per-row summation does not depend on the batch, so the result
    differs from the plain step by kernel choice and summation order only (the rounding noise)."""
    batch = len(inputs[0])
    return model.step(*with_padding(model, inputs, padded_batch_size(batch) - batch))[:batch]


@torch.no_grad()
def one_step_errors(eager, compiled_model, run: Callable, inputs: Inputs) -> dict[str, float]:
    """One step from identical state (the compiled model's buffers copied from the eager one's):
    `run` (the compiled model's step) against eager, and, as the yardstick, eager against the
    padded eager step. In bf16 a deep random-weight model amplifies rounding differences, so the
    first number means something only next to the second."""
    buffers = dict(compiled_model.named_buffers())
    for name, buf in eager.named_buffers():
        buffers[name].copy_(buf)
    restore = restore_point(eager)
    expected = eager.step(*inputs)
    restore()
    padded = padded_step(eager, inputs)
    restore()
    compiled = run(*inputs)
    return {"compiled_vs_eager": relative_error(compiled, expected), "eager_padding_noise": relative_error(padded, expected)}
