"""Parameter names and shapes against the official table, official weight loading (bf16/fp32,
fp8 and fp4 block-scaled, shards), and reproducible random init."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from model import Decoder, ModelConfig
from kernels.blockscale.ref import E2M1_VALUES

OFFICIAL = json.loads((pathlib.Path(__file__).parent / "data" / "official_params.json").read_text())
# The official tiny ModelArgs (its head and indexer widths are too narrow for the fp8/fp4 blocks).
OFFICIAL_TINY_ARGS = dict(
    max_batch_size=2, max_seq_len=300, dtype="bf16", scale_fmt="ue8m0", expert_dtype=None, scale_dtype="fp8",
    vocab_size=256, dim=64, moe_inter_dim=32, n_layers=9, n_hash_layers=3, n_mtp_layers=1, n_heads=4,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, q_lora_rank=16, head_dim=32, rope_head_dim=16, norm_eps=1e-6, o_groups=2, o_lora_rank=16,
    window_size=8, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128, 4, 0], compress_rope_theta=160000.0,
    original_seq_len=64, rope_theta=10000.0, rope_factor=16, beta_fast=32, beta_slow=1, index_n_heads=2,
    index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
)


def described(decoder: Decoder) -> dict[str, list]:
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in decoder.state_dict().items()}


def expanded(table: dict, experts: int) -> dict:
    """A table whose "experts.*." keys stand for every expert."""
    out = {}
    for key, value in table.items():
        for e in range(experts) if ".experts.*." in key else [None]:
            out[key if e is None else key.replace(".experts.*.", f".experts.{e}.")] = value
    return out


@pytest.mark.parametrize("build", ["fp8", "bf16"])
def test_flash_state_dict_equals_official_table(build):
    """The preset stores weights as the official checkpoint does (fp8 linears, fp4 experts, their
    scales); with dtype bf16 and no expert dtype, as the official bf16 build."""
    cfg = ModelConfig.preset("flash")
    if build == "bf16":
        cfg = cfg.replace(dtype="bf16", expert_dtype=None)
    decoder = Decoder(cfg, max_batch=1, max_seq_len=65536, device="meta")
    official = OFFICIAL["flash"] if build == "bf16" else expanded(OFFICIAL["flash_fp8"], cfg.n_routed_experts)
    ours = described(decoder)
    assert sorted(set(official) - set(ours)) == []
    assert sorted(set(ours) - set(official)) == []
    assert {k: v for k, v in ours.items() if official[k] != v} == {}


def test_official_tiny_config_state_dict_equals_official_table():
    cfg = ModelConfig.from_official({**OFFICIAL_TINY_ARGS, "qat": False})
    ours = described(Decoder(cfg, max_batch=2, max_seq_len=300, device="meta"))
    assert ours == OFFICIAL["official_tiny"]


def test_from_official_reads_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**OFFICIAL_TINY_ARGS, "qat": False}))
    cfg = ModelConfig.from_official(path)
    assert (cfg.dim, cfg.n_layers, cfg.compress_ratios[:9], cfg.index_topk) == (64, 9, (0, 0, 4, 128, 4, 128, 4, 128, 4), 4)
    with pytest.raises(ValueError, match="unknown keys.*no_such_field"):
        ModelConfig.from_official({**OFFICIAL_TINY_ARGS, "no_such_field": 1})
    with pytest.raises(ValueError, match="qat needs"):
        ModelConfig.from_official(OFFICIAL_TINY_ARGS)  # qat on by default: the 16-wide blocks do not fit


def test_presets():
    bench = ModelConfig.preset("bench")
    assert (bench.dim, bench.n_layers, bench.n_routed_experts, bench.n_activated_experts) == (4096, 43, 16, 6)
    tiny = ModelConfig.preset("tiny")
    assert set(tiny.layer_ratios) == {0, 4, 128} and tiny.n_layers >= 6
    assert (tiny.head_dim - tiny.rope_head_dim) % 64 == 0 and tiny.index_head_dim % 32 == 0 and tiny.index_n_heads >= 8
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = ModelConfig.preset("tiny")
    source = Decoder(cfg, max_batch=2, max_seq_len=64, dtype=torch.float32).init_random(seed=4)
    return cfg, source


def official_dict(decoder: Decoder) -> dict[str, torch.Tensor]:
    """The decoder's weights as the official checkpoint names them, plus an mtp entry to skip."""
    weights = {k: v.clone() for k, v in decoder.state_dict().items()}
    weights["mtp.0.attn.wq_a.weight"] = torch.randn(3, 3)
    return weights


def assert_same_weights(a: Decoder, b: Decoder):
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_load_from_dict_file_and_shards(tiny_pair, tmp_path):
    cfg, source = tiny_pair
    weights = official_dict(source)
    target = Decoder(cfg, max_batch=2, max_seq_len=64, dtype=torch.float32)
    target.load_official(weights)
    assert_same_weights(source, target)

    save_file(weights, tmp_path / "one.safetensors")
    target = Decoder(cfg, max_batch=2, max_seq_len=64, dtype=torch.float32)
    target.load_official(tmp_path / "one.safetensors")
    assert_same_weights(source, target)

    shards = tmp_path / "shards"
    shards.mkdir()
    keys = sorted(weights)
    for i in range(3):
        save_file({k: weights[k] for k in keys[i::3]}, shards / f"model-{i:05d}-of-00003.safetensors")
    target = Decoder(cfg, max_batch=2, max_seq_len=64, dtype=torch.float32)
    target.load_official(shards)
    assert_same_weights(source, target)


def quantize_fp8_blocks(w: torch.Tensor):
    """Block-scaled e4m3 the way checkpoints store it: one power-of-two scale per 128x128 block."""
    out, inp = w.shape
    rows, cols = -(-out // 128), -(-inp // 128)
    scale = torch.empty(rows, cols)
    q = torch.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = 2.0 ** torch.ceil(torch.log2(block.abs().max() / 448))
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = block / s
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def test_fp8_and_fp4_weights_are_dequantized():
    # fp8 with block scales on a matrix that spans several blocks and a partial one
    big = ModelConfig.preset("tiny").replace(dim=256, q_lora_rank=160)
    src = Decoder(big, max_batch=1, max_seq_len=64, dtype=torch.float32).init_random(seed=9)
    weights = official_dict(src)
    w = torch.randn(160, 256) * 3
    q, scale = quantize_fp8_blocks(w)
    weights["layers.1.attn.wq_a.weight"], weights["layers.1.attn.wq_a.scale"] = q, scale
    # fp4 experts: random codes, packed two per byte (low nibble first), one scale per 32 inputs
    codes = torch.randint(0, 16, (big.moe_inter_dim, big.dim))
    fp4_scale = torch.exp2(torch.randint(-4, 3, (big.moe_inter_dim, big.dim // 32)).float())
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    weights["layers.2.ffn.experts.5.w3.weight"] = packed.view(torch.float4_e2m1fn_x2)
    weights["layers.2.ffn.experts.5.w3.scale"] = fp4_scale.to(torch.float8_e8m0fnu)
    target = Decoder(big, max_batch=1, max_seq_len=64, dtype=torch.float32)
    target.load_official(weights)

    scale_full = scale.float().repeat_interleave(128, 0)[:160].repeat_interleave(128, 1)[:, :256]
    torch.testing.assert_close(target.layers[1].attn.wq_a.weight, q.float() * scale_full, rtol=0, atol=0)
    torch.testing.assert_close(target.layers[1].attn.wq_a.weight, w, rtol=0.07, atol=1e-4)  # e4m3: 3 mantissa bits, subnormals below ~scale/512
    magnitude = torch.tensor(E2M1_VALUES)[codes % 8]
    expected = torch.where(codes >= 8, -magnitude, magnitude) * fp4_scale.repeat_interleave(32, 1)
    torch.testing.assert_close(target.layers[2].ffn.experts.w3[5], expected, rtol=0, atol=0)


def test_bad_checkpoints_name_the_keys_and_change_nothing(tiny_pair):
    cfg, source = tiny_pair
    target = Decoder(cfg, max_batch=2, max_seq_len=64, dtype=torch.float32).init_random(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    weights = official_dict(source)
    weights["layers.0.attn.no_such.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"unknown keys.*layers\.0\.attn\.no_such\.weight"):
        target.load_official(weights)

    weights = official_dict(source)
    del weights["layers.3.attn.compressor.ape"]
    with pytest.raises(ValueError, match=r"missing keys.*layers\.3\.attn\.compressor\.ape"):
        target.load_official(weights)

    weights = official_dict(source)
    weights["layers.4.ffn.experts.2.w1.weight"] = torch.zeros(7, 7)
    with pytest.raises(ValueError, match=r"misshapen keys.*layers\.4\.ffn\.experts\.2\.w1\.weight"):
        target.load_official(weights)

    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        target.load_official("/nonexistent/checkpoint")
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_init_random_is_reproducible_and_seeded():
    cfg = ModelConfig.preset("tiny")
    a = Decoder(cfg, max_batch=1, max_seq_len=32, dtype=torch.float32).init_random(seed=3)
    b = Decoder(cfg, max_batch=1, max_seq_len=32, dtype=torch.float32).init_random(seed=3)
    c = Decoder(cfg, max_batch=1, max_seq_len=32, dtype=torch.float32).init_random(seed=4)
    assert_same_weights(a, b)
    assert not torch.equal(a.embed.weight, c.embed.weight)
    tid2eid = a.layers[0].ffn.gate.tid2eid
    assert all(len(set(row.tolist())) == row.numel() for row in tid2eid)  # distinct experts per token
