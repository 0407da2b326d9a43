"""`fuse bench` on the CPU (eager and compile_decode; the CUDA-graph variants need a GPU): the floor
it divides by, the context it synthesizes, and a short run end to end."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types

import pytest
import torch

from fuse import bench
from fuse.floor import expected_experts, floor_bytes
from model import Decoder, ModelConfig


@pytest.fixture(scope="module")
def tiny():
    return Decoder(ModelConfig.preset("tiny"), max_batch=4, max_seq_len=96, dtype=torch.float32).init_random(0)


def test_expected_experts_matches_simulated_routing():
    generator = torch.Generator().manual_seed(0)
    for n_experts, topk, batch in ((16, 6, 1), (16, 6, 3), (256, 6, 32), (8, 3, 4)):
        picks = torch.rand(4000, batch, n_experts, generator=generator).argsort(-1)[..., :topk]
        touched = torch.zeros(4000, n_experts).scatter_(1, picks.flatten(1), 1).sum(1).mean().item()
        assert expected_experts(n_experts, topk, batch) == pytest.approx(touched, rel=0.02)


def test_floor_counts_attended_rows_indexer_rows_and_weights(tiny):
    cfg = tiny.config
    elem = 4  # fp32 caches
    batch, context = 3, 90
    floor = floor_bytes(tiny, batch, context)
    # Independently from the config: per layer, the window rows, plus the top-k picks (ratio 4)
    # or every compressed entry (ratio 128), each head_dim wide; ratio-4 layers also score every
    # compressed entry of the indexer cache.
    window = min(context, cfg.window_size)
    rows = {0: window, 4: window + min(cfg.index_topk, context // 4), 128: window + context // 128}
    assert floor["kv"] == batch * sum(rows[r] for r in cfg.layer_ratios) * cfg.head_dim * elem
    assert floor["indexer"] == batch * (context // 4) * cfg.layer_ratios.count(4) * cfg.index_head_dim * elem

    params = dict(tiny.named_parameters())
    all_bytes = sum(p.numel() * p.element_size() for p in params.values())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if ".experts.w" in n)
    table_bytes = sum(params[n].numel() * params[n].element_size() for n in params if n == "embed.weight" or n.endswith("tid2eid"))
    one_row = sum(params[n][0].numel() * params[n].element_size() for n in params if n == "embed.weight" or n.endswith("tid2eid"))
    # The expert stacks hold the routed experts and the shared one, which every step reads.
    share = (expected_experts(cfg.n_routed_experts, cfg.n_activated_experts, batch) + 1) / (cfg.n_routed_experts + 1)
    assert floor["weights"] == pytest.approx(all_bytes - expert_bytes - table_bytes + expert_bytes * share + batch * one_row)
    assert floor["total"] == pytest.approx(floor["weights"] + floor["kv"] + floor["indexer"])
    # More sequences read more KV and touch more experts, never fewer.
    assert floor_bytes(tiny, batch + 1, context)["total"] > floor["total"]


def test_synthesized_context_fills_caches_and_states_only(tiny):
    weights = {n: p.clone() for n, p in tiny.named_parameters()}
    tables = {n: b.clone() for n, b in tiny.named_buffers() if n.startswith(("rope", "hadamard"))}
    bench.synthesize_context(tiny, seed=1)
    filled = [n for n, b in tiny.named_buffers() if n.endswith(("kv_cache", "kv_state", "score_state"))]
    assert len(filled) >= 3 * tiny.config.n_layers // 2
    for name, buf in tiny.named_buffers():
        if name in filled:
            assert buf.float().std() > 0.5, name  # random rows, not the zeros of a fresh decoder
    for name, p in tiny.named_parameters():
        assert torch.equal(p, weights[name])
    for name, b in tables.items():
        assert torch.equal(dict(tiny.named_buffers())[name], b)


def test_cpu_run_end_to_end(tmp_path):
    # Batches 2 and 4 share the symbolic batch's graph: one compile (batch 1's own graph is the runner tests').
    settings = bench.BenchSettings(
        preset="tiny", layers=2, contexts=(88,), batches=(2, 4), variants=bench.DEFAULT_VARIANTS, steps=2,
        eager_steps=2, repeats=1, device="cpu", out_dir=str(tmp_path),
    )
    result = bench.run_bench(settings, log=lambda line: None)
    assert result["settings"]["variants"] == ["eager", "fuse"]  # the CUDA-graph variants need a GPU
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(88, 2), (88, 4)]
    for row in result["rows"]:
        # fp32: compiled equals eager up to summation order (one step from the same state).
        assert row["checks"]["fuse"]["max_relative_error"] < 1e-4
        assert row["checks"]["fuse"]["top1_agreement"] == 1.0
        # the yardstick ran: eager with padding rows against eager, finite and as small in fp32
        noise = row["checks"][bench.YARDSTICK]
        assert 0 <= noise["max_relative_error"] < 1e-4 and noise["top1_agreement"] == 1.0
        # against the fp32 eager reference: the decoder is fp32, so eager is the reference's
        # arithmetic, the fuse variant is the fp32 compile, and the yardstick passes it
        against = row["checks"][bench.FP32]
        assert against["eager"] == {"worst_row": 0.0, "median_row": 0.0}
        assert against["fuse"]["passed"] and against["fuse"]["error"] < 1e-4, against["fuse"]
        assert bench.FP32_COMPILED not in against
        assert row["fuse"]["ms"] > 0 and row["eager"]["ms"] > 0 and row["floor_ms"] > 0
    assert result["variants"]["fuse"]["compiles"] >= 1 and result["variants"]["eager"]["compiles"] == 0

    bench.write_outputs(result, str(tmp_path))
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    markdown = (tmp_path / "bench.md").read_text()
    fuse_ms = result["rows"][1]["fuse"]["ms"]
    assert f"| 88 | 4 | {result['rows'][1]['eager']['ms']:.2f} | {fuse_ms:.2f} |" in markdown
    assert os.path.getsize(tmp_path / "bench.png") > 1000
    assert f"| context | batch | {bench.YARDSTICK} max rel. error / top-1 agree | fuse max rel. error" in markdown
    fuse_check = result["rows"][1]["checks"][bench.FP32]["fuse"]
    assert "| context | batch | eager float32 | fuse |" in markdown
    assert f"| 88 | 4 | 0.0e+00 / 0.0e+00 | {fuse_check['error']:.1e} / {fuse_check['typical_error']:.1e} pass |" in markdown


def test_yardstick_changes_only_the_summation_order(tiny):
    """The padded eager step that calibrates the accuracy table: its rows for the real sequences
    are the unpadded step's (up to summation order), and the next step after the checks sees the
    state they started from (cache rows a repeated step rewrites and the scratch slot aside)."""
    inputs = bench.step_inputs(2, 40, tiny.config.vocab_size, tiny.device, seed=3)
    before = {n: b.clone() for n, b in tiny.named_buffers()}
    with pytest.raises(ValueError, match="yardstick pads the batch to 65 rows: build the decoder with max_batch >= 65"):
        bench.check_against_eager({}, tiny, inputs)  # 4 slots: no room for the padding rows
    big = Decoder(tiny.config, max_batch=65, max_seq_len=96, dtype=torch.float32).init_random(0)
    bench.synthesize_context(big, seed=1)
    big_before = {n: b.clone() for n, b in big.named_buffers()}
    checks = bench.check_against_eager({}, big, inputs)
    assert list(checks) == [bench.YARDSTICK]
    assert checks[bench.YARDSTICK]["max_relative_error"] < 1e-4
    after_checks = big.step(*inputs)
    for name, buf in big.named_buffers():
        buf.copy_(big_before[name])
    assert torch.equal(after_checks, big.step(*inputs))
    for name, buf in tiny.named_buffers():
        assert torch.equal(buf, before[name]), name  # the failed call changed nothing


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown variants \\['eager-graph'\\]"):
        bench.BenchSettings(variants=("eager-graph",))
    # Every compile_decode variant compiles private copies of the model's code: one run may time all.
    assert bench.BenchSettings(variants=("fuse", "fuse-static", "fuse-nested")).variants == ("fuse", "fuse-static", "fuse-nested")
    with pytest.raises(ValueError, match="batches and contexts must be positive"):
        bench.BenchSettings(batches=(0, 4))
    with pytest.raises(ValueError, match="inductor_options patch the compile_decode variant's compile; none of the variants"):
        bench.BenchSettings(variants=("eager", "eager-graphs"), inductor_options=(("combo_kernels", True),))


def test_inductor_options_on_the_command_line():
    from fuse.__main__ import _inductor_option

    assert _inductor_option("combo_kernels=True") == ("combo_kernels", True)
    assert _inductor_option("combo_kernel_max_num_nodes=4") == ("combo_kernel_max_num_nodes", 4)
    assert _inductor_option("triton.persistent_reductions=False") == ("triton.persistent_reductions", False)
    assert _inductor_option("max_autotune_gemm_backends=ATEN,TRITON") == ("max_autotune_gemm_backends", "ATEN,TRITON")
    for bad in ("combo_kernels", "=True"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            _inductor_option(bad)
    settings = bench.BenchSettings(contexts=(4096,), inductor_options=(("combo_kernels", True), ("x.y", "a b")))
    assert bench.command_line(dataclasses.asdict(settings)) == (
        "python -m fuse bench --preset bench --contexts 4096 --batches 1,16,32,64"
        " --inductor-option combo_kernels=True --inductor-option x.y='a b'"
    )


def test_variants_own_inductor_patches_join_the_runs(monkeypatch):
    """fuse-no-pdl and fuse-combo compile with their Inductor setting on top of --inductor-option's;
    plain fuse with the run's only."""
    seen = {}

    class Runner:
        run_checked = None

        def describe(self):
            return ""

    def compile_decode(decoder, **options):
        seen[len(seen)] = options
        return Runner()

    monkeypatch.setattr(bench, "compile_decode", compile_decode)
    decoder = types.SimpleNamespace(device=torch.device("cpu"))
    run = (("combo_kernels", False), ("max_fusion_size", 8))
    for name in ("fuse", "fuse-no-pdl", "fuse-combo"):
        bench.build_variant(name, decoder, (1,), lambda batch: (), run)
    assert seen[0]["inductor_options"] == {"combo_kernels": False, "max_fusion_size": 8}
    assert seen[1]["inductor_options"] == {"combo_kernels": False, "max_fusion_size": 8, "triton.enable_pdl": False}
    assert seen[2]["inductor_options"] == {"combo_kernels": True, "max_fusion_size": 8}
    assert all("compile" not in options and options["buckets"] == (1,) for options in seen.values())


def test_graph_memory_counts_private_pools_only(monkeypatch):
    """Graph memory is the private pools' segments (CUDA graphs, cudagraph trees), not memory a
    build leaves in, or frees from, the default pool."""
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 3 * 2**30},  # default pool: weights, caches
        {"segment_pool_id": (1, 1), "total_size": 2**29},  # a bucket graph's pool
        {"segment_pool_id": (1, 2), "total_size": 2**28},  # a cudagraph tree's pool
        {"total_size": 2**30},  # no pool id: counted as the default pool
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert bench.graph_pool_gib() == pytest.approx(0.75)


def test_dequantised_copy_holds_every_quantised_weight_dequantised():
    """`dequantised_copy`: each FP8 / FP4 tensor of the checkpoint-native decoder, dequantised with
    its scales (dequantize_weight, independent of the loader), in the dense copy's dtype; every
    other tensor and buffer as it is. A dense decoder has nothing to dequantise and is refused."""
    from kernels.blockscale.ref import dequantize_weight

    native = Decoder(ModelConfig.preset("tiny-fp8", layers=4), max_batch=3, max_seq_len=40, dtype=torch.float32).init_random(3)
    bench.synthesize_context(native, 4)
    copy = bench.dequantised_copy(native)
    assert not copy.config.weight_formats and copy.config.replace(dtype="fp8", expert_dtype="fp4") == native.config
    theirs, ours = native.state_dict(), copy.state_dict()
    scales = [k for k in theirs if k.endswith(".scale") and k not in ours]
    assert len(scales) > 10  # FP8 linears and FP4 experts of every layer
    for key in scales:
        weight = key[: -len("scale")] + "weight"
        torch.testing.assert_close(ours[weight], dequantize_weight(theirs[weight], theirs[key]).to(ours[weight].dtype), rtol=0, atol=0)
    for key, value in ours.items():
        if key[: -len("weight")] + "scale" not in scales:
            assert torch.equal(value, theirs[key]), key
    with pytest.raises(ValueError, match="dense already"):
        bench.dequantised_copy(Decoder(ModelConfig.preset("tiny", layers=2), max_batch=2, max_seq_len=16, dtype=torch.float32))


def test_cpu_run_with_the_dequantised_variant(tmp_path):
    """The dequantised copy timed beside the native decoder from the same caches: its own floor
    (more bytes: dense weights), its logits against the native eager step's (apart by the skipped
    activation quantisation, not by a bug: the top token agrees), and its table."""
    settings = bench.BenchSettings(
        preset="tiny-fp8", layers=2, contexts=(40,), batches=(2,), variants=("eager", "fuse", bench.DEQUANTISED), steps=1,
        eager_steps=1, repeats=1, device="cpu", out_dir=str(tmp_path),
    )
    result = bench.run_bench(settings, log=lambda line: None)
    (row,) = result["rows"]
    dense = row[bench.DEQUANTISED]
    assert dense["ms"] > 0 and dense["floor_bytes"]["total"] > row["floor_bytes"]["total"]
    check = row["checks"][bench.DEQUANTISED]
    assert 0 < check["max_relative_error"] < 0.5 and check["top1_agreement"] == 1.0
    assert row["checks"]["fuse"]["max_relative_error"] < check["max_relative_error"]
    markdown = bench.to_markdown(result)
    assert (f"| 40 | 2 | {row['fuse']['ms']:.2f} | {row['floor_ms']:.2f} | {dense['ms']:.2f} | {dense['floor_ms']:.2f} | "
            f"{dense['ms'] / row['fuse']['ms']:.2f}x |") in markdown
    # A dense preset has nothing to dequantise: the variant is left out, the others run. (Its
    # compile after the checkpoint-format decoders' in this process is the case of compile_decode's
    # float constants: the softmax scale differs, and symbolic it would be refused by the attention op.)
    dense_preset = dataclasses.replace(settings, preset="tiny", variants=("fuse", bench.DEQUANTISED))
    said = []
    assert bench.run_bench(dense_preset, log=said.append)["settings"]["variants"] == ["fuse"]
    assert any(bench.DEQUANTISED in line for line in said)
