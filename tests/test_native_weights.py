"""Weights as the checkpoint stores them (FP8 linears, FP4 routed experts, their block scales):
the configuration that asks for them, loading without conversion, memory, random weights
quantised as the checkpoints are, and the decoder against the official linear() semantics."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from kernels.blockscale import dequantize_weight, quantize_fp4_weight, quantize_fp8_weight
from model import Decoder, ModelConfig
from test_model_decode import compare_with_reference, run_schedule

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
        assert 0.7 < std < 1.4, (key, std)  # N(0, 1/fan_in) before quantisation


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
    for bad, match in (
        (dense.state_dict(), "missing keys .*layers.0.attn.wkv.scale"),
        ({**source.state_dict(), "layers.0.attn.wo_b.scale": torch.ones(2, 2).to(torch.float8_e8m0fnu)},
         "misshapen keys .*layers.0.attn.wo_b.scale: checkpoint \\[2, 2\\], model \\[1, 1\\]"),
        ({**source.state_dict(), "layers.0.attn.wq_a.scale": source.state_dict()["layers.0.attn.wq_a.scale"].float()},
         "another format than the model's .*layers.0.attn.wq_a.scale: checkpoint torch.float32, model torch.float8_e8m0fnu"),
    ):
        with pytest.raises(ValueError, match=match):
            target.load_official(bad)
        assert all(torch.equal(bits(v), before[k]) for k, v in target.state_dict().items())


def test_native_decode_matches_the_official_linear_semantics():
    """fp32 activations, QAT off, 300 steps: every product on an FP8 / FP4 weight quantises its
    input as the official linear() does, against the from-scratch reference's own act_quant and
    dequantisation."""
    cfg = native_tiny(qat=False)
    decoder = Decoder(cfg, max_batch=3, max_seq_len=320, dtype=torch.float32).init_random(seed=11)
    sequences = [dict(slot=2, start=0, length=300), dict(slot=0, start=20, length=60, skip=7)]
    run_schedule(decoder, sequences, steps=300, seed=3)
    compare_with_reference(decoder, sequences, tolerance=1e-3)
