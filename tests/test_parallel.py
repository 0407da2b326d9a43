"""The model split across ranks (model/parallel.py): the shard arithmetic in one process, and
under torchrun with gloo (tests/launches.py, tests/parallel_worker.py): split eager and
compiled logits against the one-process decoder, split loads against init_random's parts, and
a rank that cannot load or compile stopping every rank with its error."""
from __future__ import annotations

import json

import pytest
import torch

from model import Decoder, ModelConfig
from model.parallel import Parallel

from launches import Launch

SHAPE = dict(max_batch=4, max_seq_len=64)


# -- the layout, in one process -------------------------------------------------------------
def layout(world_size: int, rank: int) -> Parallel:
    return Parallel(world_size, rank, group_name="unused: no step runs")


@pytest.mark.parametrize("world_size", [2, 4])
def test_init_random_gives_each_rank_its_part_of_the_one_process_weights(world_size):
    """Split shapes, official names and values: every rank's state dict is its part of the
    one-process decoder's (same seed), and the parts together are all of it."""
    cfg = ModelConfig.preset("tiny")
    whole = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=4).state_dict()
    seen = {}
    for rank in range(world_size):
        parallel = layout(world_size, rank)
        split = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=4).state_dict()
        for key, value in split.items():
            part = parallel.part(key, tuple(whole[key].shape))
            expected = whole[key] if part is None else whole[key].narrow(part.dim, part.start, part.stop - part.start)
            assert torch.equal(value, expected), f"rank {rank}: {key}"
            seen.setdefault(key, []).append(rank)
    assert set(seen) == set(whole)
    split_keys = {k for k in whole if layout(world_size, 0).split_dim(k) is not None}
    assert {"embed.weight", "head.weight", "layers.0.attn.wq_b.weight", "layers.0.attn.wo_b.weight",
            "layers.2.attn.indexer.weights_proj.weight", "layers.0.attn.attn_sink"} <= split_keys
    per_expert = [k for k in whole if ".ffn.experts.5." in k]
    assert per_expert and all(seen[k] == [5 * world_size // cfg.n_routed_experts] for k in per_expert)
    assert seen["layers.0.ffn.shared_experts.w1.weight"] == list(range(world_size))


def test_split_shapes():
    cfg = ModelConfig.preset("tiny")
    d = Decoder(cfg, dtype=torch.float32, parallel=layout(4, 3), **SHAPE)
    attn = d.layers[2].attn
    assert attn.attn_sink.shape == (cfg.n_heads // 4,)
    assert attn.wq_b.weight.shape == (cfg.n_heads // 4 * cfg.head_dim, cfg.q_lora_rank)
    assert attn.wo_b.weight.shape == (cfg.dim, cfg.o_groups // 4 * cfg.o_lora_rank)
    assert attn.indexer.wq_b.weight.shape[0] == cfg.index_n_heads // 4 * cfg.index_head_dim
    assert d.embed.weight.shape == d.head.weight.shape == (cfg.vocab_size // 4, cfg.dim)
    assert d.layers[0].ffn.experts.w1.shape[0] == cfg.n_routed_experts // 4 + 1  # its experts and the shared one
    assert d.layers[0].ffn.experts.first == 3 * cfg.n_routed_experts // 4


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_flash_splits_on_whole_scale_blocks(world_size):
    """V4-Flash in its checkpoint formats (FP8 linears, FP4 experts), built on the meta device: each
    rank's FP8 parts are whole 128 x 128 scale blocks, its experts whole, its vocabulary a part."""
    cfg = ModelConfig.preset("flash", layers=3)
    d = Decoder(cfg, max_batch=2, max_seq_len=256, dtype=torch.bfloat16, device="meta", parallel=layout(world_size, world_size - 1))
    attn, w = d.layers[2].attn, world_size
    assert attn.wq_b.weight.shape == (cfg.n_heads * cfg.head_dim // w, cfg.q_lora_rank)
    assert attn.wq_b.scale.shape == (cfg.n_heads * cfg.head_dim // w // 128, cfg.q_lora_rank // 128)
    assert attn.wo_b.weight.shape == (cfg.dim, cfg.o_groups * cfg.o_lora_rank // w)
    assert attn.wo_b.scale.shape == (cfg.dim // 128, cfg.o_groups * cfg.o_lora_rank // w // 128)
    assert d.layers[2].ffn.experts.w1.shape == (cfg.n_routed_experts // w, cfg.moe_inter_dim, cfg.dim // 2)  # packed FP4
    assert d.head.weight.shape == (cfg.vocab_size // w, cfg.dim)


def test_what_does_not_divide_is_named():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"n_heads = 8, o_groups = 4, index_n_heads = 8, n_routed_experts = 8, vocab_size = 512 not divisible by 3"):
        Decoder(cfg, parallel=layout(3, 0), device="meta", **SHAPE)
    with pytest.raises(ValueError, match=r"o_groups = 4 not divisible by 8"):
        Decoder(cfg.replace(n_heads=16, index_n_heads=16, n_routed_experts=16), parallel=layout(8, 0), device="meta", **SHAPE)
    # FP8 weights split on whole 128-row scale blocks: tiny-fp8's wo_b has 4 x 64 inputs
    with pytest.raises(ValueError, match=r"scale blocks: .*wo_b's inputs .* = 64"):
        Decoder(ModelConfig.preset("tiny-fp8"), parallel=layout(4, 0), device="meta", **SHAPE)
    with pytest.raises(ValueError, match="rank must be in"):
        Parallel(2, 2, "g")
    with pytest.raises(ValueError, match="needs a process group"):
        Parallel(2, 0)


def test_a_split_off_the_scale_blocks_is_named_before_anything_is_read():
    """A dense model split across 4 ranks, from an FP8 checkpoint: each rank's 64 inputs of
    wo_b are half a 128-wide scale block, so the scales cannot dequantise its part alone (the
    checking half of load_official, which every rank runs before the ranks agree)."""
    from model.loading import _Entry, _plan_load

    fp8 = ModelConfig.preset("tiny-fp8", layers=1)
    checkpoint = Decoder(fp8, dtype=torch.bfloat16, **SHAPE).init_random(seed=1).state_dict()
    entries = {k: _Entry(v, lambda part: pytest.fail("read before the checkpoint was checked")) for k, v in checkpoint.items()}
    dense = Decoder(fp8.replace(dtype="bf16", expert_dtype=None), dtype=torch.bfloat16, parallel=layout(4, 1), **SHAPE)
    with pytest.raises(ValueError, match=r"off their scale blocks .*layers\.0\.attn\.wo_b\.weight: split across 4 ranks along dim 1 into parts of 64,"):
        _plan_load(dense, entries, dense.parallel)
    # two ranks: 128 inputs each, whole blocks
    dense = Decoder(fp8.replace(dtype="bf16", expert_dtype=None), dtype=torch.bfloat16, parallel=layout(2, 1), **SHAPE)
    assert len(_plan_load(dense, entries, dense.parallel)) == len(dense.state_dict())


def test_one_process_layout_is_the_unsplit_model():
    """parallel=Parallel() is the default: the same weights and the same logits, bit for bit."""
    cfg = ModelConfig.preset("tiny")
    a = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=2)
    b = Decoder(cfg, dtype=torch.float32, parallel=Parallel(), **SHAPE).init_random(seed=2)
    args = torch.tensor([3, 99, 7]), torch.tensor([0, 0, 0]), torch.tensor([0, 2, 1])
    assert torch.equal(a(*args), b(*args))
    assert layout(1, 0).split_dim("embed.weight") is None


# -- under torchrun ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(cpu_launches):
    """Two ranks: split loads, decode, then `fuse report` and `fuse bench`."""
    launched = cpu_launches.get("two_ranks")
    status, output, reports = launched.result()
    assert status == 0 and len(reports) == 2, output[-4000:]
    return output, reports, launched.out


@pytest.fixture(scope="module")
def four_ranks(cpu_launches):
    return cpu_launches.get("four_ranks").result()


@pytest.fixture(scope="module")
def failing_ranks(cpu_launches):
    return cpu_launches.get("failing_ranks").result()


def test_two_ranks_load_and_decode_as_one_process(two_ranks):
    """Two ranks: split loads (bf16; FP8 linears with FP4 experts as they are; and dequantised
    into a dense model) equal the parts init_random draws; split eager and compiled logits
    equal the one-process decoder's within 1e-5 over 50 steps of mixed batches; no graph break."""
    _, reports, _ = two_ranks
    for report in reports:
        assert report["eager worst relative error"] <= 1e-5 and report["compiled worst relative error"] <= 1e-5
        assert report["graph breaks"] == 0
        assert report["load fp8 tensors"] > report["load bf16 tensors"]  # the scales too


def test_four_ranks_decode_as_one_process(four_ranks):
    status, output, reports = four_ranks
    assert status == 0 and len(reports) == 4, output[-4000:]
    assert all(r["compiled worst relative error"] <= 1e-5 and r["graph breaks"] == 0 for r in reports)


def test_a_rank_that_cannot_load_or_compile_stops_every_rank_with_its_error(failing_ranks):
    """Rank 1's checkpoint has a misshapen tensor: both ranks raise rank 1's ValueError and keep
    their weights. Then rank 1's compile fails (a graph break under fullgraph): rank 0, which
    compiled, raises rank 1's error instead of waiting in the step's first collective."""
    status, output, reports = failing_ranks
    assert status != 0 and len(reports) == 2, output[-4000:]
    for report in reports:
        assert report["corrupt failing rank"] == 1 and report["corrupt is ValueError"], report
        assert "failed on rank 1 of 2" in report["corrupt error"] and "layers.2.attn.wo_b.weight" in report["corrupt error"]
        assert report["corrupt weights unchanged"]
        assert report["compile failing rank"] == 1, report
        assert "failed on rank 1 of 2" in report["compile error"] and "graph_break" in report["compile error"], report


def test_fuse_report_and_bench_under_torchrun(two_ranks):
    """`fuse report`, then `fuse bench`, on two ranks: rank 0 alone writes each, with both ranks'
    kernel counts (report), step times (bench), time in collectives and floors; the split
    step checked against eager and fp32 passes in both."""
    output, reports, tmp_path = two_ranks
    assert [r["wrote"] for r in reports] == [["report", "bench"], []]
    assert all(r["report status"] == r["bench status"] == 0 for r in reports)
    assert output.count("wrote report.json") == output.count("wrote bench.json") == 1  # rank 0 only
    # per layer: the attention's and the experts' all-reduce; the embedding's, the head's all-gather
    least_collectives = 2 * 2 + 2

    result = json.loads((tmp_path / "report" / "report.json").read_text())
    assert result["world_size"] == 2 and [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        compiled = rank["launches"]["compiled"]
        assert compiled["collectives"] >= least_collectives and compiled["collective_us"] > 0
        assert rank["floor_bytes"]["weights"] > 0 and rank["floor_ms"] > 0
    assert result["max_relative_error"] <= 1e-5 and result["against_fp32"]["compiled"]["passed"]
    assert "## Per rank" in (tmp_path / "report" / "report.md").read_text()

    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert bench["world_size"] == 2 and bench["settings"]["variants"] == ["eager", "fuse"]
    (row,) = bench["rows"]
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    for rank in row["ranks"]:
        assert rank["floor_bytes"]["weights"] > 0 and rank["floor_ms"] > 0 and rank["ms"]["fuse"] > 0
        assert rank["launches"]["fuse"]["collectives"] >= least_collectives and rank["launches"]["fuse"]["collective_us"] > 0
    assert row["fuse"]["slowest_ms"] == max(r["ms"]["fuse"] for r in row["ranks"])
    assert row["checks"]["fuse"]["max_relative_error"] < 1e-4 and row["checks"]["against_fp32"]["fuse"]["passed"]
    markdown = (tmp_path / "bench" / "bench.md").read_text()
    assert "### Per rank" in markdown and "torchrun --standalone --nproc-per-node 2 -m fuse bench" in markdown


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpus_capture_the_split_step(tmp_path, world_size):
    """NCCL, one GPU per rank: every bucket captured with the collectives inside, the replayed
    split step against the one-process decoder on one GPU (world size 1: the launch, the process
    group and the runner of the split code on a machine of one GPU)."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    status, output, reports = Launch(world_size, tmp_path, ["gpu-decode"], timeout=600).result()
    assert status == 0 and len(reports) == world_size, output[-4000:]
    assert all(r["gpu worst relative error"] <= 1e-4 for r in reports)
