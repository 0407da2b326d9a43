"""Weights as the checkpoint stores them (FP8 linears, FP4 routed experts, their block scales):
the configuration that asks for them, loading without conversion, memory, random weights
quantised as the checkpoints are, and the decoder against the official linear() semantics."""
from __future__ import annotations

import json
import pathlib
import re
import statistics

import pytest
import torch
from safetensors.torch import save_file

from kernels.blockscale import dequantize_weight, quantize_fp4_weight, quantize_fp8_weight
from model import Decoder, ModelConfig
from model.loading import RESIDUAL_BRANCH_OUTPUTS, residual_branch_scale
from test_model_decode import compare_with_reference, run_schedule
from v4_reference import V4Reference

OFFICIAL = json.loads((pathlib.Path(__file__).parent / "data" / "official_params.json").read_text())
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "int32": 4}


def native_tiny(**changes) -> ModelConfig:
    return ModelConfig.preset("tiny-fp8").replace(**changes)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def test_the_configuration_names_the_storage():
    flash = ModelConfig.preset("flash")
    assert (flash.dtype, flash.expert_dtype, flash.scale_dtype) == ("fp8", "fp4", "fp8")
    assert (flash.linear_format, flash.expert_format) == ("fp8", "fp4")
    assert ModelConfig.preset("bench").linear_format == "dense" and ModelConfig.preset("tiny").expert_format == "dense"
    official = ModelConfig.from_official({"dtype": "fp8", "expert_dtype": "fp4", "scale_dtype": "fp8", "max_seq_len": 10})
    assert (official.dtype, official.expert_dtype) == ("fp8", "fp4")
    with pytest.raises(ValueError, match="dtype must be 'bf16' or 'fp8', got 'int4'"):
        ModelConfig(dtype="int4")
    with pytest.raises(ValueError, match="need multiples of 128: q_lora_rank = 64"):
        ModelConfig.preset("tiny").replace(dtype="fp8")


def test_weights_on_the_device_are_the_checkpoints_bytes():
    """flash, on the meta device: parameter bytes equal the official fp8/fp4 checkpoint's (the
    fused projections hold each weight once)."""
    decoder = Decoder(ModelConfig.preset("flash"), max_batch=1, max_seq_len=65536, device="meta")
    ours = sum(p.numel() * p.element_size() for p in decoder.parameters())
    checkpoint = 0
    for key, (shape, dtype) in OFFICIAL["flash_fp8"].items():
        count = 256 if ".experts.*." in key else 1
        checkpoint += count * DTYPE_BYTES[dtype] * int(torch.tensor(shape).prod())
    assert abs(ours - checkpoint) <= 0.03 * checkpoint, (ours, checkpoint)
    assert ours == checkpoint


def test_random_weights_are_quantised_as_the_checkpoints_are():
    decoder = Decoder(native_tiny(), max_batch=1, max_seq_len=16, dtype=torch.float32).init_random(seed=4)
    state = decoder.state_dict()
    quantised = [k for k in state if k.endswith(".scale") and k[: -len("scale")] + "weight" in state]
    assert len(quantised) > 50
    for key in quantised:
        weight, scale = state[key[: -len("scale")] + "weight"], state[key]
        assert scale.dtype == torch.float8_e8m0fnu
        stored = bits(weight) if weight.dtype == torch.float4_e2m1fn_x2 else weight
        dense = dequantize_weight(stored, scale)
        # quantising the values again finds them on the grid: nothing moves
        again = (quantize_fp8_weight if weight.dtype == torch.float8_e4m3fn else quantize_fp4_weight)(dense)
        assert torch.equal(dequantize_weight(*again), dense), key
        std = dense.std().item() * dense.shape[-1] ** 0.5
        weight_key = re.sub(r"\.experts\.\d+\.", ".experts.", key[: -len("scale")] + "weight")  # stacked name
        expected = residual_branch_scale(decoder.config.n_layers) if weight_key.endswith(RESIDUAL_BRANCH_OUTPUTS) else 1.0
        assert 0.7 < std / expected < 1.4, (key, std)  # N(0, 1/fan_in) before quantisation, the residual outputs smaller


def test_a_checkpoint_loads_bit_for_bit_and_a_mismatched_one_is_refused(tmp_path):
    cfg = native_tiny()
    source = Decoder(cfg, max_batch=1, max_seq_len=16, dtype=torch.float32).init_random(seed=1)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    target = Decoder(cfg, max_batch=1, max_seq_len=16, dtype=torch.float32).init_random(seed=2)
    target.load_official(str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(bits(target.state_dict()[key]), bits(value)), key

    dense = Decoder(cfg.replace(dtype="bf16", expert_dtype=None), max_batch=1, max_seq_len=16, dtype=torch.float32)
    dense.load_official(str(path))  # a dense model dequantises on load
    key = "layers.2.attn.wq_b.weight"
    expected = dequantize_weight(source.state_dict()[key], source.state_dict()[key[:-6] + "scale"])
    assert torch.equal(dense.state_dict()[key], expected)

    before = {k: bits(v).clone() for k, v in target.state_dict().items()}
    wo_b_scale_shape = tuple(target.state_dict()["layers.0.attn.wo_b.scale"].shape)
    for bad, match in (
        (dense.state_dict(), "missing keys .*layers.0.attn.wkv.scale"),
        ({**source.state_dict(), "layers.0.attn.wo_b.scale": torch.ones(3, 3).to(torch.float8_e8m0fnu)},
         "misshapen keys .*layers.0.attn.wo_b.scale: checkpoint \\[3, 3\\], model \\[%d, %d\\]" % wo_b_scale_shape),
        ({**source.state_dict(), "layers.0.attn.wq_a.scale": source.state_dict()["layers.0.attn.wq_a.scale"].float()},
         "another format than the model's .*layers.0.attn.wq_a.scale: checkpoint torch.float32, model torch.float8_e8m0fnu"),
    ):
        with pytest.raises(ValueError, match=match):
            target.load_official(bad)
        assert all(torch.equal(bits(v), before[k]) for k, v in target.state_dict().items())


def native_schedule(seed: int):
    cfg = native_tiny(qat=False)
    decoder = Decoder(cfg, max_batch=3, max_seq_len=320, dtype=torch.float32).init_random(seed=seed)
    sequences = [dict(slot=2, start=0, length=300), dict(slot=0, start=20, length=60, skip=7)]
    return decoder, sequences


def test_native_decode_reads_the_stored_formats_exactly(monkeypatch):
    """300 steps with the activations' e4m3 rounding taken out of both sides (the decoder's and the
    reference's): what is left is the stored FP8 / FP4 weights, their scales and the fused
    layout, which must agree with the reference's own dequantisation to fp32 rounding."""
    import kernels.blockscale.ref as blockscale_ref
    import kernels.moe.ref as moe_ref
    import v4_reference

    unrounded = lambda x, pow2=True: x.float()  # noqa: E731
    monkeypatch.setattr(blockscale_ref, "act_quant_dequant", unrounded)
    monkeypatch.setattr(moe_ref, "act_quant_dequant", unrounded)
    rounding = v4_reference.fp8_round_trip
    monkeypatch.setattr(v4_reference, "fp8_round_trip", lambda x, block, pow2: x if block == 128 else rounding(x, block, pow2))
    decoder, sequences = native_schedule(seed=11)
    run_schedule(decoder, sequences, steps=310, seed=3)
    compare_with_reference(decoder, sequences, tolerance=1e-4)


def test_native_decode_follows_the_official_linear_semantics():
    """300 steps with the official act_quant on both sides. Two implementations that differ in
    summation order by 1e-7 round some activation to the other neighbouring e4m3 value sooner or
    later; from then on their activations differ by fp8 rounding steps, so they agree to the
    size of that rounding (a few percent), not to fp32 rounding. Before the first such flip they
    agree to fp32 rounding; after it, within fp8 noise, with the same top token almost always."""
    decoder, sequences = native_schedule(seed=11)
    run_schedule(decoder, sequences, steps=310, seed=3)
    reference = V4Reference(decoder.config, decoder.state_dict(), torch.float32)
    errors, agree = [], []
    for s in sequences:
        expected = reference.logits(s["tokens"])
        for position, actual in enumerate(s["logits"]):
            errors.append(((actual - expected[position]).abs().max() / expected[position].abs().max()).item())
            agree.append(bool(actual.argmax() == expected[position].argmax()))
    # A flip moves the logits by 1e-3 or more from then on; summation order alone, by up to
    # about 1e-5 on a step here and there.
    first = next((i for i, e in enumerate(errors) if e > 1e-4), len(errors))
    assert first >= 5 and max(errors[:first]) <= 3e-5, errors[: first + 1]  # exact until the first flip
    # then within fp8 rounding noise: at these widths a median row near 1e-2, rare rows near 0.2
    assert statistics.median(errors) <= 3e-2 and max(errors) <= 0.3, (statistics.median(errors), max(errors))
    assert sum(agree) >= 0.9 * len(agree), sum(agree) / len(agree)
