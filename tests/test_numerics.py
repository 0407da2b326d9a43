"""The accuracy yardstick (fuse/numerics.py): the fp32 reference, and a criterion that flags a small
error planted in the compiled model, passes the clean run, and tells QAT rounding flips apart
from a bug."""
from __future__ import annotations

import pytest
import torch

from fuse.numerics import (
    ACT_QUANT_WORST_FLOOR, MIN_ROWS, QAT_FLIP_BOUND, WORST_FLOOR, Check, RoundingFlips, check_step, copy_state,
    fp32_reference, judge, quantises_activations, sharing_weights, without_qat,
)
from decoders import TINY_SHAPE
from model import Decoder, ModelConfig


def tiny_inputs(generator: torch.Generator, position: int, slots=(0, 1, 2, 3)) -> tuple[torch.Tensor, ...]:
    slots = torch.tensor(slots)
    tokens = torch.randint(0, 512, (len(slots),), generator=generator)
    return tokens, torch.full((len(slots),), position), slots


@pytest.mark.parametrize("stream", [False, True])
def test_fp32_reference_has_the_weights_and_state_upcast(stream):
    model = Decoder(ModelConfig.preset("tiny"), max_batch=3, max_seq_len=32, dtype=torch.bfloat16).init_random(2)
    generator = torch.Generator().manual_seed(0)
    for position in range(3):
        model(*tiny_inputs(generator, position, slots=(0, 2)))
    reference = fp32_reference(model, stream=stream)
    assert reference.dtype == torch.float32
    if stream:  # the blocks hold no weights between steps
        assert {p.device.type for p in reference.layers.parameters()} == {"meta"}
    for name, buf in model.named_buffers():
        assert torch.equal(dict(reference.named_buffers())[name], buf.float()), name
    full = Decoder(model.config, max_batch=3, max_seq_len=32, dtype=torch.float32)
    full.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    copy_state(model, full)
    inputs = tiny_inputs(generator, 3, slots=(2, 0))
    assert torch.equal(reference.step(*inputs), full.step(*inputs))


def test_without_qat_shares_the_weights_and_runs_the_unrounded_model():
    """The exact checks' model: the same parameter tensors, its own caches copied from the
    model's, and the step of an independently built QAT-off decoder with those weights; its steps
    leave the model's caches alone."""
    model = Decoder(ModelConfig.preset("tiny"), max_batch=3, max_seq_len=32, dtype=torch.float32).init_random(5)
    generator = torch.Generator().manual_seed(1)
    for position in range(3):
        model(*tiny_inputs(generator, position, slots=(0, 2)))
    twin = without_qat(model)
    assert not twin.config.qat and model.config.qat
    params = dict(model.named_parameters())
    assert all(p is params[name] for name, p in twin.named_parameters())
    buffers = dict(model.named_buffers())
    for name, buf in twin.named_buffers():
        assert buf.data_ptr() != buffers[name].data_ptr() and torch.equal(buf, buffers[name]), name
    independent = Decoder(model.config.replace(qat=False), max_batch=3, max_seq_len=32, dtype=torch.float32)
    independent.load_state_dict(model.state_dict())
    copy_state(model, independent)
    before = {name: buf.clone() for name, buf in model.named_buffers()}
    inputs = tiny_inputs(generator, 3, slots=(2, 0))
    unrounded = twin.step(*inputs)
    assert torch.equal(unrounded, independent.step(*inputs))
    assert all(torch.equal(buf, before[name]) for name, buf in model.named_buffers())
    assert not torch.equal(unrounded, model.step(*inputs)), "QAT changed nothing: the twin is not telling"


def test_a_twin_sharing_weights_steps_as_the_model_on_caches_of_its_own():
    """The report's compiled decoder: the model's parameter tensors, its buffers copies; a step of
    the twin gives the model's logits and leaves the model's caches as they were."""
    model = Decoder(ModelConfig.preset("tiny"), max_batch=3, max_seq_len=32, dtype=torch.float32).init_random(6)
    generator = torch.Generator().manual_seed(2)
    for position in range(2):
        model(*tiny_inputs(generator, position, slots=(1, 2)))
    twin = sharing_weights(model)
    params = dict(model.named_parameters())
    assert all(p is params[name] for name, p in twin.named_parameters())
    buffers = dict(model.named_buffers())
    assert all(buf.data_ptr() != buffers[name].data_ptr() for name, buf in twin.named_buffers())
    before = {name: buf.clone() for name, buf in model.named_buffers()}
    inputs = tiny_inputs(generator, 2, slots=(2, 1))
    logits = twin.step(*inputs)
    assert all(torch.equal(buf, before[name]) for name, buf in model.named_buffers())
    assert torch.equal(logits, model.step(*inputs))


def test_criterion_widens_for_rare_qat_flips_only_and_needs_rows_for_the_median():
    row = lambda *values: torch.tensor(values)  # noqa: E731
    clean = Check(error=row(5e-7, 3e-7), noise=row(0.0, 0.0), top1_agree=2)
    assert judge([clean], torch.float32).passed
    flipped = Check(error=row(2e-3, 3e-7), noise=row(0.0, 0.0), top1_agree=2, flips=RoundingFlips(1000, 1, 0))
    verdict = judge([flipped], torch.float32)
    assert verdict.passed and verdict.bound == QAT_FLIP_BOUND and verdict.flips == 1
    # many elements a little apart: a wrong kernel, not a flip
    many = Check(error=row(2e-3, 3e-7), noise=row(0.0, 0.0), top1_agree=2, flips=RoundingFlips(1000, 400, 0))
    assert not judge([many], torch.float32).passed
    beyond = Check(error=row(5e-7, 3e-7), noise=row(0.0, 0.0), top1_agree=2, flips=RoundingFlips(1000, 1, 1))
    assert "more than one rounding step" in judge([beyond], torch.float32).reason
    # bf16: one row off by a routing flip passes; every row off by more than twice the noise fails
    rows = MIN_ROWS
    noise = torch.full((rows,), 1e-2)
    one_flip = noise.clone()
    one_flip[3] = 0.15
    assert judge([Check(error=one_flip, noise=noise, top1_agree=rows)], torch.bfloat16).passed
    assert WORST_FLOOR[torch.bfloat16] > 0.15
    verdict = judge([Check(error=noise * 3, noise=noise, top1_agree=rows)], torch.bfloat16)
    assert not verdict.passed and "median row" in verdict.reason
    # below MIN_ROWS rows the median is not judged
    assert judge([Check(error=noise[:2] * 3, noise=noise[:2], top1_agree=2)], torch.bfloat16).typical_bound is None


def test_quantised_activations_widen_the_fp32_worst_row_but_not_the_median():
    """With FP8/FP4 weights an activation's e4m3 rounding can flip in fp32 too: one row off by a
    routing flip's size passes, every row off by a little fails on the median, and a dense fp32
    model keeps its exact bound."""
    rows = MIN_ROWS
    exact = torch.full((rows,), 3e-7)
    one_flip = exact.clone()
    one_flip[5] = 1.4e-2
    quiet = torch.zeros(rows)
    native = Check(error=one_flip, noise=quiet, top1_agree=rows, quantised_activations=True)
    verdict = judge([native], torch.float32)
    assert verdict.passed and verdict.bound == ACT_QUANT_WORST_FLOOR
    assert not judge([Check(error=one_flip, noise=quiet, top1_agree=rows)], torch.float32).passed
    everywhere = Check(error=torch.full((rows,), 1e-3), noise=quiet, top1_agree=rows, quantised_activations=True)
    verdict = judge([everywhere], torch.float32)
    assert not verdict.passed and "median row" in verdict.reason


def test_check_step_marks_models_that_quantise_activations():
    """FP8 linears or FP4 experts quantise the products' activations; check_step records it."""
    dense, native = ModelConfig.preset("tiny"), ModelConfig.preset("tiny-fp8")
    assert not quantises_activations(dense) and quantises_activations(native)
    assert quantises_activations(native.replace(dtype="bf16")) and quantises_activations(native.replace(expert_dtype=None))
    assert not quantises_activations(native.replace(dtype="bf16", expert_dtype=None))
    generator = torch.Generator().manual_seed(3)
    for config, expected in ((dense, False), (native, True)):
        model = Decoder(config.replace(n_layers=1), **TINY_SHAPE).init_random(3)
        check = check_step(model, model.step, tiny_inputs(generator, 0, slots=(0, 1)))
        assert check.quantised_activations == expected and check.error.max() <= 1e-6


def test_the_median_rows_noise_can_come_from_a_series_of_checks():
    """A step whose own eager rows came out quiet is judged against the noise of the series (so
    it passes at the series' typical error), while every row 3x the series' noise still fails."""
    generator = torch.Generator().manual_seed(7)
    rows = 2 * MIN_ROWS

    def check(scale):
        noise = scale * (0.5 + torch.rand(rows, generator=generator))
        return Check(error=noise.flip(0) * 1.1, noise=noise, top1_agree=rows)

    series = [check(3e-2) for _ in range(5)]
    quiet = Check(error=series[0].error, noise=series[0].noise / 3, top1_agree=rows)  # the series' error, a quiet eager step
    assert not judge([quiet], torch.bfloat16).passed
    assert judge([quiet], torch.bfloat16, noise_from=[*series, quiet]).passed
    planted = Check(error=3 * series[1].noise, noise=series[1].noise, top1_agree=rows)
    verdict = judge([planted], torch.bfloat16, noise_from=[*series, planted])
    assert not verdict.passed and "median row" in verdict.reason


def test_yardstick_flags_an_error_planted_in_the_compiled_model(tiny_nested):
    """fp32, QAT on: the compiled runner passes against the fp32 reference of the eager model;
    one norm weight 1% off in the compiled model's layer 3 fails, by far."""
    eager, runner, _, _ = tiny_nested
    model = runner.decoder
    reference = fp32_reference(eager)
    saved = {name: buf.clone() for name, buf in model.named_buffers()}
    weight = model.layers[3].attn.kv_norm.weight
    try:
        for planted in (False, True):
            copy_state(eager, model)
            if planted:
                with torch.no_grad():
                    weight.mul_(1.01)
            generator = torch.Generator().manual_seed(0)
            checks = [check_step(model, runner.run_checked, tiny_inputs(generator, p), reference) for p in range(3)]
            verdict = judge(checks, torch.float32)
            print(f"planted={planted}: {verdict.summary()}")
            if planted:
                assert not verdict.passed and verdict.typical_error > 10 * verdict.typical_bound, verdict
            else:
                assert verdict.passed, verdict
                assert runner.stats.recompiles == 0
    finally:
        with torch.no_grad():
            weight.copy_(eager.layers[3].attn.kv_norm.weight)
            for name, buf in model.named_buffers():
                buf.copy_(saved[name])


def test_yardstick_flags_a_planted_error_in_bf16():
    """bf16: the eager step's own rounding is ~1e-2 per row, so a 1% error hides in it; a 10% one
    (an MoE norm weight of one layer) shows in every row and fails, while the clean run passes.
    The run judged is an eager copy of the model: the yardstick sees only its output, so a
    compiled run is judged the same way (the fp32 test above judges the compiled runner)."""
    cfg = ModelConfig.preset("tiny")
    shape = {**TINY_SHAPE, "dtype": torch.bfloat16}
    eager = Decoder(cfg, **shape).init_random(21)
    model = Decoder(cfg, **shape)
    model.load_state_dict(eager.state_dict())
    reference = fp32_reference(eager)
    weight = model.layers[3].ffn_norm.weight
    for planted in (False, True):
        copy_state(eager, model)
        if planted:
            with torch.no_grad():
                weight.mul_(1.1)
        generator = torch.Generator().manual_seed(0)
        checks = [check_step(model, model.step, tiny_inputs(generator, p), reference, eager=eager) for p in range(4)]
        verdict = judge(checks, torch.bfloat16)
        print(f"planted={planted}: {verdict.summary()}")
        if planted:
            assert not verdict.passed and verdict.typical_error > 2 * verdict.typical_bound, verdict
        else:
            assert verdict.passed, verdict


def test_qat_rounding_flips_pass_and_are_counted():
    """fp32 with QAT: one sequence at a time against the batch (the reference) moves values by
    ~1e-7, which now and then flips one fp8/fp4 rounding of a cache element. The yardstick sees
    those flips in the caches and passes them; a planted error fails (above)."""
    model = Decoder(ModelConfig.preset("tiny"), **TINY_SHAPE).init_random(21)
    reference = fp32_reference(model)

    def one_at_a_time(tokens, positions, slots):
        return torch.cat([model.step(tokens[i : i + 1], positions[i : i + 1], slots[i : i + 1]) for i in range(len(tokens))])

    generator = torch.Generator().manual_seed(21)
    checks = [check_step(model, one_at_a_time, tiny_inputs(generator, p), reference) for p in range(14)]
    assert sum(c.flips.far for c in checks) > 0, "no rounding flip in these steps: pick steps that have one"
    for check in checks:
        verdict = judge([check], torch.float32)
        assert verdict.passed, verdict
