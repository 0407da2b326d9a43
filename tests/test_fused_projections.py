"""Projections that share an input run as one GEMM (model.layers.FusedLinear) while state_dict(),
loading and init keep the official per-projection names, shapes and values."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model.attention
from model import Decoder, ModelConfig
from model.layers import FusedLinear, LinearView, official_parameters
from model.loading import RESIDUAL_BRANCH_OUTPUTS, residual_branch_scale

OFFICIAL = json.loads((pathlib.Path(__file__).parent / "data" / "official_params.json").read_text())
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}


def tiny(fp32_products: str = "exact", dtype: torch.dtype = torch.float32) -> Decoder:
    cfg = ModelConfig.preset("tiny").replace(fp32_products=fp32_products)
    return Decoder(cfg, max_batch=3, max_seq_len=32, dtype=dtype)


def fused_modules(decoder: Decoder) -> dict[str, FusedLinear]:
    return {name: m for name, m in decoder.named_modules() if isinstance(m, FusedLinear)}


def official_key(fused_path: str, projection: str) -> str:
    """`layers.2.attn.x_proj` fusing `indexer.weights_proj` -> `layers.2.attn.indexer.weights_proj.weight`."""
    owner = fused_path.rpartition(".")[0]
    return f"{owner}.{projection}.weight"


def random_official_weights(decoder: Decoder, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values under every official name (not from init_random, so a misplaced row shows)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for key, value in decoder.state_dict().items():
        if value.is_floating_point():
            weights[key] = torch.randn(value.shape, generator=generator).to(value.dtype)
        else:
            weights[key] = value.clone()
    return weights


def test_flash_state_dict_is_the_official_table_and_holds_no_fused_weight():
    bf16_build = ModelConfig.preset("flash").replace(dtype="bf16", expert_dtype=None)
    decoder = Decoder(bf16_build, max_batch=1, max_seq_len=65536, device="meta")
    state = decoder.state_dict()
    described = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state.items()}
    assert described == OFFICIAL["flash"]
    fused = fused_modules(decoder)
    # per layer: x_proj, x32_proj on compressed layers (fp32 compressor weights), qr_proj; the
    # shared expert's weights are the last row of the expert stacks
    assert len(fused) == sum(3 if r else 2 for r in decoder.config.layer_ratios)
    ffn = decoder.layers[0].ffn
    assert ffn.experts.w1.shape[0] == decoder.config.n_routed_experts + 1
    assert state["layers.0.ffn.shared_experts.w2.weight"].shape == ffn.experts.w2.shape[1:]
    assert not any(key.startswith(tuple(path + "." for path in fused)) for key in state)
    ratio4 = decoder.layers[2].attn
    assert ratio4.x_proj.names == ("wq_a", "wkv", "indexer.weights_proj")
    assert ratio4.x32_proj.names == ("compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate")
    assert ratio4.qr_proj.names == ("wq_b", "indexer.wq_b")
    assert ratio4.x_proj.weight.shape == (1024 + 512 + 64, 4096)
    assert ratio4.x32_proj.weight.dtype == torch.float32 and ratio4.x32_proj.weight.shape == (2 * 1024 + 2 * 256, 4096)


def test_fp8_projections_fuse_by_format_with_their_scale_blocks():
    """The checkpoint's formats: the FP8 projections of x fuse with their 128-row scale blocks
    stacked; the indexer's bf16 weights_proj is a product of its own; the FP4 routed experts are
    stacked without the FP8 shared expert, which keeps its own linears."""
    decoder = Decoder(ModelConfig.preset("flash"), max_batch=1, max_seq_len=65536, device="meta")
    attn = decoder.layers[2].attn
    assert attn.x_proj.names == ("wq_a", "wkv") and attn.x_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.x_proj.scale.shape == ((1024 + 512) // 128, 4096 // 128)
    assert attn.x_dense_proj.names == ("indexer.weights_proj",) and attn.x_dense_proj.weight.dtype == torch.bfloat16
    assert attn.qr_proj.names == ("wq_b", "indexer.wq_b") and attn.qr_proj.scale.shape == ((32768 + 8192) // 128, 1024 // 128)
    assert attn.wkv.scale.shape == (4, 32) and attn.indexer.wq_b.scale.shape == (64, 8)
    ffn = decoder.layers[0].ffn
    assert ffn.experts.w1.shape == (256, 2048, 2048) and ffn.experts.w1.dtype == torch.uint8
    assert ffn.experts.w1_scale.shape == (256, 2048, 4096 // 32)
    assert not ffn.shared_experts.stacked and ffn.shared_experts.w2.weight.dtype == torch.float8_e4m3fn


def test_fast_products_join_the_model_dtype_group_with_the_same_state_dict():
    exact, fast = tiny("exact", torch.bfloat16), tiny("fast", torch.bfloat16)
    assert list(exact.state_dict()) == list(fast.state_dict())
    attn = fast.layers[2].attn  # ratio 4
    assert attn.x32_proj is None
    assert attn.x_proj.names == (
        "wq_a", "wkv", "indexer.weights_proj",
        "compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate",
    )
    assert attn.x_proj.weight.dtype == torch.bfloat16
    assert exact.layers[2].attn.x32_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("fp32_products", ["exact", "fast"])
def test_load_and_state_dict_round_trip_every_tensor(fp32_products):
    decoder = tiny(fp32_products, torch.bfloat16)
    weights = random_official_weights(decoder, seed=1)
    decoder.load_state_dict(weights)
    state = decoder.state_dict()
    assert list(state) == list(weights)
    for key, value in weights.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    for path, fused in fused_modules(decoder).items():  # the fused weight is the pieces stacked in order
        pieces = [weights[official_key(path, name)] for name in fused.names]
        assert torch.equal(fused.weight, torch.cat(pieces)), path

    other = tiny(fp32_products, torch.bfloat16)
    other.load_official(weights)
    assert all(torch.equal(value, weights[key]) for key, value in other.state_dict().items())


def test_load_state_dict_reports_missing_and_misshapen_projections():
    decoder = tiny()
    weights = random_official_weights(decoder, seed=2)
    del weights["layers.2.attn.indexer.compressor.wgate.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key.*layers\.2\.attn\.indexer\.compressor\.wgate\.weight"):
        decoder.load_state_dict(weights)
    weights = random_official_weights(decoder, seed=2)
    weights["layers.0.ffn.shared_experts.w3.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"layers\.0\.ffn\.shared_experts\.w3\.weight: got \[3, 3\]"):
        decoder.load_state_dict(weights)


@pytest.mark.parametrize("fp32_products, dtype", [("exact", torch.float32), ("exact", torch.bfloat16), ("fast", torch.bfloat16)])
def test_fused_forward_equals_separate_linears_on_the_official_weights(fp32_products, dtype):
    decoder = tiny(fp32_products, dtype)
    weights = random_official_weights(decoder, seed=3)
    decoder.load_state_dict(weights)
    generator = torch.Generator().manual_seed(4)
    for path, fused in fused_modules(decoder).items():
        x = torch.randn(3, fused.weight.shape[1], generator=generator).to(fused.weight.dtype)
        products = fused(x)
        assert tuple(products) == fused.names
        for name, product in products.items():
            expected = F.linear(x.float(), weights[official_key(path, name)].float())
            tolerance = 1e-5 if fused.weight.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(product.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_init_draws_each_projection_under_its_official_name_with_its_fan_in():
    decoder = tiny()
    names = [name for name, _ in official_parameters(decoder)]
    # The unfused parameter list: the state dict with the routed experts stacked again.
    unfused = [k for k in decoder.state_dict() if ".experts." not in k]
    assert [n for n in names if ".experts." not in n] == unfused
    modules = dict(decoder.named_modules())
    assert not any(isinstance(modules.get(n.rpartition(".")[0]), FusedLinear) for n in names)

    decoder.init_random(seed=5)
    state = decoder.state_dict()
    views = {n + ".weight": m for n, m in decoder.named_modules() if isinstance(m, LinearView)}
    # the fused projections' views, and the shared expert's three rows of the expert stacks
    assert len(views) == sum({0: 6, 128: 8, 4: 12}[r] for r in decoder.config.layer_ratios)
    branch_scale = residual_branch_scale(decoder.config.n_layers)
    for key, view in views.items():
        # the shared expert's w2 writes into the residual streams: drawn smaller (model/loading.py)
        expected = branch_scale if key.endswith(RESIDUAL_BRANCH_OUTPUTS) else 1.0
        std = state[key].float().std().item()
        assert abs(std * view.in_features**0.5 / expected - 1) < 0.1, (key, std)
    for key, value in state.items():
        if key.endswith(("attn.wo_b.weight", "w2.weight")):
            assert abs(value.float().std().item() * value.shape[-1] ** 0.5 / branch_scale - 1) < 0.15, key


def test_init_does_not_depend_on_how_projections_are_grouped():
    """fp32 model: the compressors join x_proj; bf16 "exact": they form x32_proj. Drawn per
    official name in the unfused order, both get the same values (up to the bf16 rounding)."""
    one_group = tiny("exact", torch.float32).init_random(seed=5).state_dict()
    two_groups = tiny("exact", torch.bfloat16).init_random(seed=5)
    assert two_groups.layers[2].attn.x32_proj is not None
    for key, value in two_groups.state_dict().items():
        assert torch.equal(value, one_group[key].to(value.dtype)), key


def test_fused_linear_checks_its_projections():
    a, b = LinearView(16, 4), LinearView(8, 4)
    with pytest.raises(ValueError, match="inputs of one width"):
        FusedLinear({"a": a, "b": b}, torch.float32)
    with pytest.raises(ValueError, match="at least one projection"):
        FusedLinear({}, torch.float32)
    with pytest.raises(RuntimeError, match="not part of a FusedLinear"):
        a.weight
    FusedLinear({"a": a}, torch.float32)
    with pytest.raises(ValueError, match=r"already fused elsewhere: \['a'\]"):
        FusedLinear({"a": a}, torch.float32)


class MatmulsPerLayer(TorchDispatchMode):
    """Counts matrix-product kernels (aten mm/addmm/bmm/baddbmm) per decoder layer."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.layer = None
        self.counts: dict[int, int] = {}
        self.hooks = [
            block.register_forward_pre_hook(lambda module, args, i=i: setattr(self, "layer", i))
            for i, block in enumerate(decoder.layers)
        ]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # linears_beside is one GEMM per product (inside the op, where this mode does not see them)
        n = 1 if func in MATMULS else len(args[0]) if func is torch.ops.v4.linears_beside.default else 0
        if n and self.layer is not None:
            self.counts[self.layer] = self.counts.get(self.layer, 0) + n
        return func(*args, **(kwargs or {}))

    def remove_hooks(self):
        for hook in self.hooks:
            hook.remove()


def unfused_forward(self: FusedLinear, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One F.linear per projection, as before fusion."""
    return {name: F.linear(x, w) for name, w in zip(self.names, self.weight.split(self.sizes))}


def one_step(decoder: Decoder) -> tuple[torch.Tensor, dict[int, int]]:
    counter = MatmulsPerLayer(decoder)
    try:
        with counter:
            logits = decoder(torch.tensor([5, 300, 17]), torch.tensor([0, 0, 0]), torch.tensor([1, 0, 2]))
    finally:
        counter.remove_hooks()
    return logits, counter.counts


# GEMMs saved per layer by compress ratio. One group on x: wq_a, wkv (+ compressor wkv, wgate)
# (+ indexer weights_proj and its compressor's wkv, wgate); one on qr: wq_b (+ indexer wq_b). With
# fp32 compressor weights in a bf16 model they form a second group on x.float(). (The shared
# expert runs inside the routed experts' kernel: no GEMM of its own either way.)
SAVED = {
    ("exact", torch.float32): {0: 1, 128: 3, 4: 6 + 1},
    ("exact", torch.bfloat16): {0: 1, 128: 1 + 1, 4: 2 + 3 + 1},
    ("fast", torch.bfloat16): {0: 1, 128: 3, 4: 6 + 1},
}


@pytest.mark.parametrize("fp32_products, dtype", list(SAVED))
def test_one_step_runs_fewer_matmuls_and_the_same_logits(fp32_products, dtype, monkeypatch):
    fused = tiny(fp32_products, dtype).init_random(seed=6)
    unfused = tiny(fp32_products, dtype)
    unfused.load_state_dict(fused.state_dict())
    fused_logits, fused_counts = one_step(fused)
    monkeypatch.setattr(FusedLinear, "forward", unfused_forward)
    monkeypatch.setattr(model.attention, "fused_products", lambda calls: {k: v for f, x in calls for k, v in f(x).items()})
    unfused_logits, unfused_counts = one_step(unfused)

    ratios = fused.config.layer_ratios
    saved = {layer: unfused_counts[layer] - fused_counts[layer] for layer in range(len(ratios))}
    assert saved == {layer: SAVED[fp32_products, dtype][r] for layer, r in enumerate(ratios)}
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused_logits, unfused_logits, rtol=tolerance, atol=tolerance * unfused_logits.abs().max().item())


# -- GPU: the fused GEMMs against separate ones ------------------------------------------------
def gpu_decoder(preset: str, dtype: torch.dtype) -> Decoder:
    """`bench` is cut to 4 layers (V4-Flash widths, compress ratios 0, 0, 4, 128)."""
    cfg = ModelConfig.preset(preset)
    if preset == "bench":
        cfg = cfg.replace(n_layers=4)
    return Decoder(cfg, max_batch=64, max_seq_len=64, dtype=dtype, device="cuda").init_random(seed=0)


@pytest.mark.gpu
def test_gpu_fused_gemms_match_separate_gemms_and_time_them():
    from kernels.bench.tables import markdown_table
    from kernels.bench.timing import graph_time_us, rotation_count

    decoder = gpu_decoder("bench", torch.bfloat16)
    state = decoder.state_dict()
    rows = []
    for path, fused in fused_modules(decoder).items():
        if not path.startswith(("layers.2.", "layers.3.")):  # layers 0-1 hold a subset of these groups
            continue
        sizes = fused.sizes
        # rotate through copies of the weight so that it is read from HBM, as in a decode step
        copies = rotation_count(fused.weight.numel() * fused.weight.element_size())
        weights = [fused.weight.clone() for _ in range(copies)]

        def separate(x, w):
            return [F.linear(x, piece) for piece in w.split(sizes)]

        def together(x, w):
            return F.linear(x, w).split(sizes, dim=-1)

        for batch in (1, 16, 64):
            generator = torch.Generator(device="cuda").manual_seed(batch)
            sets = [
                (torch.randn(batch, fused.weight.shape[1], generator=generator, device="cuda").to(fused.weight.dtype), w)
                for w in weights
            ]
            x = sets[0][0]
            products = fused(x)
            tolerance = 1e-4 if fused.weight.dtype == torch.float32 else 2e-2
            for name, piece in zip(fused.names, separate(x, fused.weight)):
                expected = F.linear(x.float(), state[official_key(path, name)].float())
                atol = tolerance * expected.abs().max().item()
                torch.testing.assert_close(products[name].float(), expected, rtol=tolerance, atol=atol)
                torch.testing.assert_close(piece.float(), expected, rtol=tolerance, atol=atol)
            separate_us, fused_us = graph_time_us(separate, sets), graph_time_us(together, sets)
            megabytes = fused.weight.numel() * fused.weight.element_size() / 1e6
            rows.append([
                path, "+".join(fused.names), str(fused.weight.dtype).removeprefix("torch."), f"{megabytes:.1f}",
                batch, f"{separate_us:.1f}", f"{fused_us:.1f}", f"{separate_us / fused_us:.2f}x",
            ])
    print()
    print(markdown_table(["group", "projections", "dtype", "MB", "batch", "separate us", "fused us", "speed-up"], rows))


@pytest.mark.gpu
@pytest.mark.parametrize("preset, dtype", [("tiny", torch.float32), ("bench", torch.bfloat16)], ids=["tiny-fp32", "bench4-bf16"])
def test_gpu_eager_step_launches_fewer_gemm_kernels(preset, dtype, monkeypatch):
    from fuse.launches import count_launches

    decoder = gpu_decoder(preset, dtype)
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, decoder.config.vocab_size, (8,), generator=generator, device="cuda")
    positions = torch.arange(8, device="cuda") * 3
    slots = torch.arange(8, device="cuda")
    buffers = {k: v.clone() for k, v in decoder.named_buffers()}

    def step():
        for k, v in decoder.named_buffers():  # the same cache state for every call
            v.copy_(buffers[k])
        return decoder.step(tokens, positions, slots)

    fused_logits = step()
    # The inputs tell count_launches the call runs on CUDA (device kernel events).
    fused = count_launches(lambda *inputs: step(), tokens, positions, slots, label="fused")
    monkeypatch.setattr(FusedLinear, "forward", unfused_forward)
    monkeypatch.setattr(model.attention, "fused_products", lambda calls: {k: v for f, x in calls for k, v in f(x).items()})
    unfused_logits = step()
    unfused = count_launches(lambda *inputs: step(), tokens, positions, slots, label="separate")
    error = ((fused_logits - unfused_logits).abs().max() / unfused_logits.abs().max()).item()
    print(
        f"\n{preset} {dtype}: gemm kernels per eager step: separate {unfused.counts['gemm']:.0f}, fused "
        f"{fused.counts['gemm']:.0f}; gemm device time {unfused.time_us['gemm']:.0f} -> {fused.time_us['gemm']:.0f} us; "
        f"logits relative difference {error:.2e}"
    )
    # Fewer GEMM calls per layer (see SAVED), though one fused GEMM may add a split-K reduce kernel.
    assert fused.counts["gemm"] < unfused.counts["gemm"]
    if dtype == torch.float32:  # fused and separate differ only in summation order
        assert error < 1e-4
