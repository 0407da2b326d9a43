"""Compiling the custom ops' kernels ahead (kernels/precompile.py, fuse/precompile.py): the fake
run records exactly the op calls a real step makes and changes nothing; the replay reuses only
tensors the op reads. The compiles themselves: tests/test_sm90_compile.py (the launches then
compile nothing) and the GPU test below (the first calls compile nothing)."""
from __future__ import annotations

import pytest
import torch

import fuse
from fuse.precompile import bucket_op_calls, distinct_blocks
from fuse.padding import padding_rows
from kernels.precompile import Layout, OpCall, compile_ahead, record_op_calls
from kernels.sparse_mla import sparse_mla_decode_reference
from model import Decoder, ModelConfig


def tiny(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    return Decoder(ModelConfig.preset("tiny"), max_batch=4, max_seq_len=64, dtype=dtype, device=device).init_random(seed)


def test_the_fake_run_records_the_calls_of_a_real_step_and_changes_nothing():
    model = tiny(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    recorded = bucket_op_calls(model, (1, 4))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    with record_op_calls() as real:  # the same steps, executed
        for size in (1, 4):
            model.step(*padding_rows(model, size))
    assert list(recorded) == list(real.calls)
    assert {call.name for call in recorded} >= {"sparse_mla_decode", "moe_experts", "indexer_topk"}
    # where each was made: the kind of the block (its index in layer_kinds) or outside the blocks, and the bucket
    kinds = len(distinct_blocks(model))
    for call, sites in recorded.items():
        assert all(kind is None or 0 <= kind < kinds for kind, _ in sites) and {size for _, size in sites} <= {1, 4}
        if call.name == "moe_experts":  # in every block, at its bucket's rows
            assert {size for _, size in sites} == {call.args[0].shape[0]} and None not in {kind for kind, _ in sites}
    assert {kind for sites in recorded.values() for kind, _ in sites} == set(range(kinds))
    sizes = {call.args[0].shape[0] for call in recorded if call.name == "moe_experts"}
    assert sizes == {1, 4}


def test_the_fake_run_of_one_block_per_kind_records_every_call_of_the_full_step():
    """Blocks alike launch alike: the fake run calls one block per kind, and records the calls a
    real step through every block makes (a deeper tiny model, so that kinds repeat)."""
    cfg = ModelConfig.preset("tiny", layers=6)
    model = Decoder(cfg, max_batch=4, max_seq_len=64, dtype=torch.float32).init_random(4)
    blocks = distinct_blocks(model)
    kinds = {(cfg.layer_ratios[i], i < cfg.n_hash_layers) for i in range(cfg.n_layers)}
    assert len(blocks) == len(kinds) < cfg.n_layers
    called = []
    forward = type(model.layers[0]).forward

    def counting(block, *args):
        called.append(block)
        return forward(block, *args)

    type(model.layers[0]).forward = counting
    try:
        recorded = bucket_op_calls(model, (1, 4))
    finally:
        type(model.layers[0]).forward = forward
    assert len(called) == 2 * len(blocks)  # two buckets
    with record_op_calls() as real:
        for size in (1, 4):
            model.step(*padding_rows(model, size))
    assert set(recorded) == set(real.calls)


def test_the_replay_passes_real_tensors_only_where_the_op_reads_them():
    torch.manual_seed(1)
    q, kv = torch.randn(2, 4, 32), torch.randn(3, 8, 32)
    indices, sink = torch.randint(0, 8, (2, 4), dtype=torch.int32), torch.randn(4)
    workspace = torch.randn(64)
    with record_op_calls() as record:
        torch.ops.v4.sparse_mla_decode_with_workspace(q, kv, indices, sink, 0.1, workspace)
    (call,) = record.calls
    assert set(map(id, call.stand_ins.values())) == {id(q), id(kv), id(indices), id(sink)}  # not the written workspace
    args, _ = call.arguments()
    assert args[0] is q and args[5] is not workspace and args[5].shape == workspace.shape
    before = workspace.clone()
    call.replay()
    assert torch.equal(workspace, before)
    out, _ = torch.ops.v4.sparse_mla_decode_with_workspace(*args)
    torch.testing.assert_close(out, sparse_mla_decode_reference(q, kv, indices, sink, 0.1)[0])


def test_a_layout_is_rebuilt_with_its_strides_and_offset_and_zero_integers():
    base = torch.arange(100, dtype=torch.int64)
    view = base[3:].as_strided((4, 5), (1, 8), 7)
    layout = Layout.of(view)
    made = layout.empty()
    assert (made.shape, made.stride(), made.storage_offset(), made.dtype) == ((4, 5), (1, 8), 7, torch.int64)
    assert not made.any()
    assert Layout.of(made) == layout
    meta = OpCall(torch.ops.aten.add.Tensor, (Layout.of(torch.empty(2, 3, device="meta")),), ())
    (made_on_cpu,), _ = meta.arguments(device="cpu")
    assert made_on_cpu.device.type == "cpu" and made_on_cpu.shape == (2, 3)


@pytest.mark.parametrize("workers", [-1, True, 1.5])
def test_bad_kernel_compile_workers_are_refused(workers):
    with pytest.raises((ValueError, TypeError), match="kernel_compile_workers"):
        fuse.CompileOptions(kernel_compile_workers=workers)


@pytest.mark.gpu
def test_gpu_first_calls_compile_no_kernel_after_the_compiles_ahead(monkeypatch):
    """Every kernel variant the buckets' first calls launch was compiled ahead: the first calls
    compile none (the in-memory kernel caches emptied first, so that the ahead set is the whole set)."""
    import sys

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import fuse.runner

    for module in [m for name, m in sys.modules.items() if name.startswith("kernels.")]:
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                value.cache.clear()
            fn = value.fn if isinstance(value, Autotuner) else value
            if isinstance(fn, JITFunction):
                fn.device_caches.clear()
    compiles_in_first_calls = []
    build_buckets, do_compile = fuse.runner.build_buckets, JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles_in_first_calls.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    def first_calls(*args, **kwargs):
        monkeypatch.setattr(JITFunction, "_do_compile", counting)
        try:
            return build_buckets(*args, **kwargs)
        finally:
            monkeypatch.setattr(JITFunction, "_do_compile", do_compile)

    monkeypatch.setattr(fuse.runner, "build_buckets", first_calls)
    model = tiny(2, device="cuda", dtype=torch.bfloat16)
    runner = fuse.compile_decode(model, buckets=(1, 2, 4), compile=False, progress=False)
    assert runner.stats.kernels_compiled_ahead > 0
    assert compiles_in_first_calls == [], compiles_in_first_calls


def test_a_step_that_cannot_run_on_fake_tensors_costs_only_the_compiles_ahead():
    """Compiling ahead only saves time: a step that fails on fake tensors keeps what it recorded
    before the failure and warns; a replayed call that raises is skipped, the others still run."""
    model = tiny(3)

    def failing_after_one_bucket(tokens, positions, slots, layers):
        if tokens.shape[0] > 1:
            raise RuntimeError("cannot run here")
        return model.step(tokens, positions, slots, layers=layers)

    with pytest.warns(UserWarning, match="did not run on fake tensors \\(RuntimeError: cannot run here\\)"):
        calls = bucket_op_calls(model, (1, 4), step=failing_after_one_bucket)
    assert calls and {call.args[0].shape[0] for call in calls if call.name == "moe_experts"} == {1}
    ran = []

    def failing():
        raise ValueError("bad call")

    with pytest.warns(UserWarning, match="1 call\\(s\\) skipped.*ValueError: bad call"):
        assert compile_ahead([lambda: ran.append(1), failing, lambda: ran.append(2)], workers=1) == 0
    assert ran == [1, 2]
