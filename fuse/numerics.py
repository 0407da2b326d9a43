"""Error measures and the accuracy yardstick that `fuse report`, `fuse bench`, `fuse soak` and the
tests share.

The yardstick is an fp32 eager run of the same weights from the same state (`fp32_reference`).
One step of the model under test (`check_step`) gives, per row, its relative error against that
reference and, as the noise of its dtype, the error of the same model's eager step; `judge`
decides from them, in one place, whether the step computes the model's function:

- the worst row's error must stay within NOISE_FACTOR times the eager step's worst row, and
  within WORST_FLOOR of its dtype (bf16: a discrete MoE routing flip, which a 1e-3 change of a
  gate input can cause, moves that row by up to ~0.2; fp32: exact to summation order, 1e-4);
- with MIN_ROWS rows or more, the median row's error must stay within NOISE_FACTOR times the
  eager step's median row and TYPICAL_FLOOR of its dtype: flips hit a few rows, a wrong kernel
  hits them all.

QAT (the FP8 KV / FP4 indexer rounding simulation) is discontinuous: a 1e-7 change of summation
order now and then lands one value on the other side of a rounding boundary, which moves that
row's logits by up to ~1e-3 in fp32. A bug moves many cache elements a little; a flip moves one
element by one rounding step. So for an fp32 model with QAT, `check_step` also compares the
cache rows the two steps wrote (`rounding_flips`): when a few elements differ, each by one
rounding step, the worst-row bound widens to QAT_FLIP_BOUND; an element that differs by more
than one step fails the check. A flip of a rounded value that no cache keeps (the indexer's FP4
query) moves the top-k selection unseen, so the checks that must be exact at every step, compiled
fp32 against eager fp32 in `fuse bench` and `fuse report`, run with QAT off (`without_qat`).

Checkpoint-native weights (FP8 linears, FP4 experts) quantise every product's activations to
e4m3 in blocks of 128 (the official `linear()`), which QAT's switch does not touch: there too a
1e-7 difference now and then moves one activation by a rounding step, which can flip a routing
decision downstream and move that row like a bf16 flip. So in fp32 a model with quantised
activations gets bf16's worst-row floor (ACT_QUANT_WORST_FLOOR), while its median row must
still be exact to fp32's TYPICAL_FLOOR: a flip hits a row now and then, a wrong kernel every row.
With fewer than MIN_ROWS rows only the worst row is judged: a check of one such row is held to
bf16's floor alone."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from fuse.padding import Inputs, with_padding
from kernels.linear import MAX_ROWS
from model import Decoder, ModelConfig

NOISE_FACTOR = 2.0
# Per dtype: the bound on the median row and on the worst row when the eager step's noise is
# smaller (fp32: none, the reference is the same arithmetic).
TYPICAL_FLOOR = {torch.float32: 1e-4, torch.bfloat16: 8e-3, torch.float16: 1e-3}
WORST_FLOOR = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.25}
MIN_ROWS = 8  # rows (over all checks judged together) for the median to mean something
QAT_FLIP_BOUND = 1e-2  # fp32 worst row when the step's caches show a few one-step rounding flips
ACT_QUANT_WORST_FLOOR = WORST_FLOOR[torch.bfloat16]  # fp32 worst row of a model that quantises activations
FLIPS_PER_ROW = 8  # "a few": at most this many flipped cache elements per batch row


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def row_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row: max |actual - expected| / max |expected| over the row, fp32 [B] on the host."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().amax(-1) / expected.abs().amax(-1)).cpu()


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


def copy_state(source: nn.Module, target: nn.Module) -> None:
    """Every buffer of `source` (caches, compressor states, tables) into `target`'s buffer of the
    same name, converted to its dtype: the next step of `target` starts from `source`'s state."""
    buffers = dict(source.named_buffers())
    with torch.no_grad():
        for name, buf in target.named_buffers():
            buf.copy_(buffers[name])


def padded_batch_size(batch: int) -> int:
    """Rows of the padded step for a batch of `batch`: at least one padding row, and past the
    decode projections' row limit (see `padded_step`)."""
    return max(batch + 1, MAX_ROWS + 1)


def padded_step(model, inputs: Inputs) -> torch.Tensor:
    """The eager step with padding rows appended, its real rows' logits. Enough rows to pass the
    decode projections' row limit: every projection then runs the library GEMM rather than
    `v4::grouped_linear`, whose per-row summation does not depend on the batch, so the result
    differs from the plain step by kernel choice and summation order only (the rounding noise)."""
    batch = len(inputs[0])
    return model.step(*with_padding(model, inputs, padded_batch_size(batch) - batch))[:batch]


# -- the fp32 reference ---------------------------------------------------------------------------
def fp32_reference(decoder: Decoder, stream: bool | None = None) -> Decoder:
    """An fp32 eager copy of `decoder` on its device: same config and shape, the weights of its
    state_dict upcast, its caches and states copied (`copy_state` brings them level again before
    each comparison). `stream=True` keeps only the block being run in fp32 (upcast from
    `decoder`'s weights as the step reaches it), for models whose fp32 copy does not fit beside
    them (the 43-layer bench preset: 47 GiB of bf16 weights, 92 GiB in fp32); default: stream on
    a GPU whose free memory cannot hold the copy."""
    if stream is None:
        stream = _copy_does_not_fit(decoder)
    if stream:
        reference = StreamedReference(decoder)
    else:
        reference = Decoder(
            decoder.config, decoder.max_batch, decoder.max_seq_len, dtype=torch.float32, device=decoder.device,
            check_device_values=decoder.check_device_values, parallel=getattr(decoder, "parallel", None),
        )
        reference.load_state_dict(decoder.state_dict())
    copy_state(decoder, reference)
    return reference


def _copy_does_not_fit(decoder: Decoder) -> bool:
    if decoder.device.type != "cuda":
        return False
    fp32_bytes = sum(p.numel() * 4 for p in decoder.parameters())
    free, _ = torch.cuda.mem_get_info(decoder.device)
    return fp32_bytes > 0.8 * free


def _own_parameters_on(module: nn.Module, device: torch.device | str) -> None:
    """New (uninitialised) storage on `device` for the module's own parameters, same dtype and shape."""
    for name, param in module._parameters.items():
        if param is not None:
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)


class StreamedReference(Decoder):
    """An fp32 Decoder whose blocks hold no weights between steps: each block's are upcast from
    the source decoder's when the step reaches it, and dropped after. Caches, states, the
    embedding and the head are its own, in fp32 (see `fp32_reference`)."""

    def __init__(self, source: Decoder):
        super().__init__(
            source.config, source.max_batch, source.max_seq_len, dtype=torch.float32, device="meta",
            check_device_values=source.check_device_values, parallel=getattr(source, "parallel", None),
        )
        self._source = (source,)  # a tuple: not a submodule of the reference
        device = source.device
        for name, module in self.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
            if name != "layers" and not name.startswith("layers."):
                _own_parameters_on(module, device)
        outside = {k: v for k, v in source.state_dict().items() if not k.startswith("layers.")}
        missing, unexpected = self.load_state_dict(outside, strict=False)
        if unexpected or not all(k.startswith("layers.") for k in missing):
            raise RuntimeError(f"streamed reference: unexpected {unexpected[:5]}, missing {missing[:5]}")

    def step(self, tokens, positions, slots, layers=None, logits=None):
        if layers is None:
            layers = [self._streamed(i) for i in range(len(self.layers))]
        return super().step(tokens, positions, slots, layers, logits)

    def _streamed(self, i: int) -> Callable:
        block, source = self.layers[i], self._source[0].layers[i]

        def run(streams, step, hadamard):
            modules = list(block.modules())
            for module in modules:
                _own_parameters_on(module, streams.device)
            try:
                block.load_state_dict(source.state_dict())
                return block(streams, step, hadamard)
            finally:
                for module in modules:
                    _own_parameters_on(module, "meta")

        return run


def without_qat(model: Decoder) -> Decoder:
    """`model` with QAT off, for the checks that must be exact (compiled fp32 against eager fp32):
    `sharing_weights` with qat=False. Not every QAT rounding lands in a cache: the indexer's FP4
    query is rounded and dropped, so a flip there moves the top-k selection, and the logits, with
    no trace for `rounding_flips` to see."""
    return sharing_weights(model, model.config.replace(qat=False))


def sharing_weights(model: Decoder, config: ModelConfig | None = None) -> Decoder:
    """A Decoder of `config` (default: `model`'s) that shares `model`'s parameters (no copy) and
    holds its own caches and states, copied from `model`'s: a second decoder at the memory cost of
    its caches."""
    twin = Decoder(
        config or model.config, model.max_batch, model.max_seq_len, dtype=model.dtype, device="meta",
        check_device_values=model.check_device_values, parallel=getattr(model, "parallel", None),
    )
    source = dict(model.named_modules())
    for name, module in twin.named_modules():
        for key in module._parameters:
            module._parameters[key] = source[name]._parameters[key]
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.empty_like(source[name]._buffers[key])
    copy_state(model, twin)
    return twin


# -- QAT rounding flips ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundingFlips:
    """Elements of two tensors that should be equal: how many differ beyond `tolerance` ("far")
    and how many of those by more than one fp8/fp4 rounding step (a ratio outside (0.4, 2.5):
    e4m3 steps are 1/8 relative, e2m1 steps up to 1/2)."""

    elements: int = 0
    far: int = 0
    beyond_one_step: int = 0

    def __add__(self, other: "RoundingFlips") -> "RoundingFlips":
        return RoundingFlips(self.elements + other.elements, self.far + other.far, self.beyond_one_step + other.beyond_one_step)


def rounding_flips(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-4) -> RoundingFlips:
    actual, expected = actual.float(), expected.float()
    far = (actual - expected).abs() > tolerance + tolerance * expected.abs()
    ratio = (actual[far] / expected[far]).abs()
    within = (ratio > 0.4) & (ratio < 2.5)
    return RoundingFlips(expected.numel(), int(far.sum()), int((~within).sum()))


def assert_close_up_to_rounding_flips(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal within 1e-4, except for rare elements (under 1 in 1000) one rounding step apart: with
    QAT on, a 1e-7 difference of arithmetic can land a value on the other side of a boundary."""
    flips = rounding_flips(actual, expected)
    assert flips.far < 1e-3 * flips.elements, f"{name}: {flips.far} of {flips.elements} elements differ"
    assert not flips.beyond_one_step, f"{name}: {flips.beyond_one_step} differences larger than one rounding step"


def slot_rows(model, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of every per-slot buffer of `model` (caches, compressor states) at `slots`."""
    return {name: buf[slots] for name, buf in model.named_buffers() if buf.dim() >= 2 and buf.shape[0] == model.max_batch + 1}


def cache_flips(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> RoundingFlips:
    """`rounding_flips` summed over the buffers of two `slot_rows`."""
    total = RoundingFlips()
    for name, rows in actual.items():
        total = total + rounding_flips(rows, expected[name])
    return total


# -- the criterion --------------------------------------------------------------------------------
@dataclass
class Check:
    """One step from one state, against the fp32 reference: per-row relative errors of the step
    under test and of the model's eager step in its own dtype (zeros for an fp32 model), how many
    rows' top token agrees with the reference's, and (fp32 models with QAT) the cache elements
    the step rounded differently from the reference."""

    error: torch.Tensor
    noise: torch.Tensor
    top1_agree: int
    flips: RoundingFlips | None = None
    non_finite: bool = False
    quantised_activations: bool = False  # the model's products quantise their activations (native weights)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # "" when passed, else what failed
    error: float  # the worst row's relative error against the fp32 reference
    noise: float  # the worst row's of the eager step in the model's dtype (0 for fp32 models)
    bound: float  # what `error` must stay within
    typical_error: float  # the median row's
    typical_noise: float
    typical_bound: float | None  # None: fewer than MIN_ROWS rows
    rows: int
    top1_agreement: float
    flips: int = 0  # cache elements one rounding step apart (fp32 with QAT)
    checks: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        typical = "" if self.typical_bound is None else (
            f", median row {self.typical_error:.2e} (bound {self.typical_bound:.2e})")
        flips = f", {self.flips} QAT rounding flips" if self.flips else ""
        verdict = "pass" if self.passed else f"FAIL ({self.reason})"
        return (f"{verdict}: worst row {self.error:.2e} against fp32 (bound {self.bound:.2e}, eager's own "
                f"{self.noise:.2e}){typical}, top-1 {self.top1_agreement:.2f} over {self.rows} rows{flips}")


def judge(checks: Sequence[Check], dtype: torch.dtype, noise_from: Sequence[Check] | None = None) -> Verdict:
    """The yardstick's criterion (module docstring), over the rows of all `checks` together.
    `noise_from`: the checks whose eager rows give the median row's noise (default: `checks`). A
    series of steps passes all its checks so far: the median of one step's few rows is itself
    noisy (steps of ~20 rows of the bench preset in bf16 gave eager medians 2.5x apart)."""
    if not checks:
        raise ValueError("judge needs at least one check")
    error, noise = torch.cat([c.error for c in checks]), torch.cat([c.noise for c in checks])
    rows = error.numel()
    worst, worst_noise = error.max().item(), noise.max().item()
    typical = error.median().item()
    typical_noise = torch.cat([c.noise for c in noise_from]).median().item() if noise_from else noise.median().item()
    bound = max(NOISE_FACTOR * worst_noise, WORST_FLOOR[dtype])
    with_flips = [c for c in checks if c.flips is not None]
    flipped = sum(c.flips.far for c in with_flips)
    beyond = sum(c.flips.beyond_one_step for c in with_flips)
    if flipped and not beyond and all(c.flips.far <= FLIPS_PER_ROW * len(c.error) for c in with_flips):
        bound = max(bound, QAT_FLIP_BOUND)
    if dtype == torch.float32 and any(c.quantised_activations for c in checks):
        bound = max(bound, ACT_QUANT_WORST_FLOOR)
    typical_bound = max(NOISE_FACTOR * typical_noise, TYPICAL_FLOOR[dtype]) if rows >= MIN_ROWS else None
    problems = []
    if any(c.non_finite for c in checks):
        problems.append("non-finite logits")
    if not worst <= bound:
        problems.append(f"worst row {worst:.2e} > {bound:.2e}")
    if typical_bound is not None and not typical <= typical_bound:
        problems.append(f"median row {typical:.2e} > {typical_bound:.2e}")
    if beyond:
        problems.append(f"{beyond} cache elements more than one rounding step from the reference")
    return Verdict(
        passed=not problems, reason="; ".join(problems), error=worst, noise=worst_noise, bound=bound,
        typical_error=typical, typical_noise=typical_noise, typical_bound=typical_bound, rows=rows,
        top1_agreement=sum(c.top1_agree for c in checks) / rows, flips=flipped,
        checks=len(checks),
    )


@torch.no_grad()
def check_step(model, run: Callable[..., torch.Tensor], inputs: Inputs, reference=None, eager=None) -> Check:
    """One step of `run` (which advances `model`, e.g. a runner's `run_checked`) from `model`'s
    current state, against the fp32 `reference` from the same state (copied into it first; for
    an fp32 model, None: its own eager step, repeated from the same state). The noise of the
    dtype is the eager step of `eager` (default: `model`'s own, repeated from the same state)
    against the reference. Leaves `model` as `run` left it."""
    fp32 = model.dtype == torch.float32
    if reference is None and not fp32:
        raise ValueError(f"check_step: a {model.dtype} model needs an fp32 reference (fp32_reference)")
    slots = inputs[2]
    if reference is not None:
        copy_state(model, reference)
    noisy = None
    if not fp32:  # an fp32 model's eager step is the reference's arithmetic
        if eager is None:
            restore = restore_point(model)
            noisy = model.step(*inputs)
            restore()
        else:
            copy_state(model, eager)
            noisy = eager.step(*inputs)
    if reference is None:
        restore = restore_point(model)
        expected = model.step(*inputs)
        expected_rows = slot_rows(model, slots)
        restore()
        actual = run(*inputs)
    else:
        actual = run(*inputs)
        expected = reference.step(*inputs)
        expected_rows = slot_rows(reference, slots)
    flips = cache_flips(slot_rows(model, slots), expected_rows) if fp32 and model.config.qat else None
    return Check(
        error=row_errors(actual, expected),
        noise=torch.zeros(len(actual)) if noisy is None else row_errors(noisy, expected),
        top1_agree=int((actual.argmax(-1) == expected.argmax(-1)).sum()),
        flips=flips,
        non_finite=not bool(torch.isfinite(actual).all()),
        quantised_activations=quantises_activations(model.config),
    )


def quantises_activations(config: ModelConfig) -> bool:
    """Whether the model's products quantise their activations: FP8 linears or FP4 experts."""
    return config.linear_format != "dense" or config.expert_format != "dense"


@torch.no_grad()
def one_step_errors(eager, compiled_model, run: Callable, inputs: Inputs) -> dict[str, float]:
    """One step from identical state (the compiled model's buffers copied from the eager one's):
    `run` (the compiled model's step) against eager, and eager against the padded eager step
    (kernel choice and summation order only)."""
    copy_state(eager, compiled_model)
    restore = restore_point(eager)
    expected = eager.step(*inputs)
    restore()
    padded = padded_step(eager, inputs)
    restore()
    compiled = run(*inputs)
    return {"compiled_vs_eager": relative_error(compiled, expected), "eager_padding_noise": relative_error(padded, expected)}
