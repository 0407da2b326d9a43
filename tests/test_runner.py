"""compile_decode on the CPU: compiled logits equal eager ones over mixed batch sizes that hit
padding, no graph breaks, no recompiles after warm-up, and padded rows never touch real slots."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

import fuse
from fuse.numerics import assert_close_up_to_rounding_flips, restore_point
from decoders import TINY_SHAPE, real_slot_caches
from model import Decoder, ModelConfig

MAX_BATCH = 4


def layer_kinds(cfg: ModelConfig) -> int:
    """Distinct layer kinds (compress ratio, hash or score routing): what compiles to different graphs."""
    return len({(cfg.layer_ratios[i], i < cfg.n_hash_layers) for i in range(cfg.n_layers)})


@pytest.fixture(scope="module")
def pair(tiny_nested):
    """The eager decoder and the runner of its copy (tests/conftest.py: nested, buckets 1, 2, 4)."""
    eager, runner, _, _ = tiny_nested
    return eager, runner


def test_compiled_matches_eager_over_mixed_batches(pair):
    eager, runner = pair
    # A symbolic batch: one graph for every bucket but 1, and one for batch 1, each the whole step
    # (nested compilation), whatever the number of layer kinds.
    assert len(runner.buckets) == 3
    assert runner.stats.compiles == 2
    assert runner.stats.graph_breaks == 0
    rng = random.Random(0)
    vocab = eager.config.vocab_size
    next_position = [0] * MAX_BATCH
    sizes_seen = set()
    for step in range(60):
        size = rng.choice([1, 2, 3, 4])
        slots = rng.sample(range(MAX_BATCH), size)
        if step == 40:  # a slot restarts a new sequence
            next_position[slots[0]] = 0
        tokens = torch.tensor([rng.randrange(vocab) for _ in slots])
        positions = torch.tensor([next_position[s] for s in slots])
        slots_t = torch.tensor(slots)
        expected = eager(tokens, positions, slots_t)
        actual = runner(tokens, positions, slots_t)
        scale = expected.abs().max()
        assert ((actual - expected).abs().max() / scale).item() <= 1e-4, f"step {step}"
        for s in slots:
            next_position[s] += 1
        sizes_seen.add(size)
    assert sizes_seen == {1, 2, 3, 4}  # 2 and 3 run padded in the bucket of 4
    assert runner.stats.recompiles == 0
    for name, value in real_slot_caches(eager).items():
        assert_close_up_to_rounding_flips(real_slot_caches(runner.decoder)[name], value, name)


def test_start_time_is_accounted_by_phase(pair):
    """Warm-up compiled every graph in the buckets' first calls (no graphs on the CPU): the phases
    sum to at most the buckets' warm-up time, and torch's compile timers are reported beside them
    (as torch counts them: once in a full-suite run they summed past the first calls' wall time)."""
    _, runner = pair
    t = runner.stats.start_seconds
    assert set(t) == {"first calls", "dynamo", "backend compile or cache load", "kernel compile", "autotune"}
    assert 0 < t["dynamo"] and 0 < t["backend compile or cache load"]
    assert t["first calls"] <= sum(runner.stats.warmup_seconds.values())
    assert t["backend compile or cache load"] <= t["first calls"]
    timers = f"torch's compile timers: dynamo {t['dynamo']:.1f} s, backend compile or cache load"
    assert f"start: first calls {t['first calls']:.1f} s ({timers}" in runner.describe()


def test_padding_never_touches_real_slots(pair):
    """A padded run writes the same real-slot caches as running each sequence alone."""
    eager, runner = pair
    before = real_slot_caches(runner.decoder)
    tokens, positions, slots = torch.tensor([5, 9]), torch.tensor([0, 0]), torch.tensor([3, 1])
    runner(tokens, positions, slots)  # bucket 4: two padding rows
    after = real_slot_caches(runner.decoder)
    for s in range(MAX_BATCH):
        if s in (1, 3):
            continue
        for name in before:
            assert torch.equal(before[name][s], after[name][s]), f"{name} slot {s} changed"
    for i, s in enumerate(slots.tolist()):
        eager(tokens[i : i + 1], positions[i : i + 1], torch.tensor([s]))
    for name, value in real_slot_caches(eager).items():
        assert_close_up_to_rounding_flips(after[name][[1, 3]], value[[1, 3]], name)


def test_bad_input_leaves_every_cache_unchanged(pair):
    """Refused before anything is written: every buffer (caches of every slot, the scratch slot's
    too, and the compressors' states) is as it was."""
    eager, runner = pair
    before = {name: buf.clone() for name, buf in runner.decoder.named_buffers()}
    with pytest.raises(ValueError, match="repeated"):
        runner(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="positions must be in"):
        runner(torch.tensor([1]), torch.tensor([runner.decoder.max_seq_len]), torch.tensor([0]))
    with pytest.raises(ValueError, match="tokens must be in"):
        runner(torch.tensor([1, eager.config.vocab_size]), torch.tensor([0, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must be int64"):
        runner(torch.tensor([1], dtype=torch.int32), torch.tensor([0]), torch.tensor([0]))
    for name, buf in runner.decoder.named_buffers():
        assert torch.equal(buf, before[name]), f"{name} changed"


def test_any_autograd_mode_of_the_caller_runs_the_same_graphs(pair):
    """Grad mode is part of Dynamo's guards: a request under no_grad or inference_mode must not
    recompile (strict mode would raise) and must give the same logits."""
    eager, runner = pair
    tokens, positions, slots = torch.tensor([5, 6]), torch.tensor([0, 0]), torch.tensor([0, 1])
    state = {name: buf.clone() for name, buf in runner.decoder.named_buffers()}
    results = []
    for mode in (contextlib.nullcontext(), torch.no_grad(), torch.inference_mode()):
        for name, buf in runner.decoder.named_buffers():
            buf.copy_(state[name])
        with mode:
            results.append(runner(tokens, positions, slots))
    assert not results[0].requires_grad
    assert all(torch.equal(r, results[0]) for r in results[1:])
    assert runner.stats.recompiles == 0


def test_uncompiled_runner_runs_the_eager_step_with_the_same_padding():
    """compile=False (the A/B baseline; on CUDA, eager inside the bucket graphs): no compile, and
    padded, chunked batches give the decoder's own logits."""
    cfg = ModelConfig.preset("tiny").replace(n_layers=2)
    reference = Decoder(cfg, max_batch=5, max_seq_len=16, dtype=torch.float32).init_random(seed=2)
    model = Decoder(cfg, max_batch=5, max_seq_len=16, dtype=torch.float32)
    model.load_state_dict(reference.state_dict())
    runner = fuse.compile_decode(model, buckets=(2, 4), compile=False, progress=False)
    assert runner.stats.compiles == 0
    generator = torch.Generator().manual_seed(3)
    for position in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (5,), generator=generator)  # 5 rows: chunks of 4 + 1 (padded to 2)
        positions, slots = torch.full((5,), position), torch.tensor([4, 0, 3, 1, 2])
        expected = reference(tokens, positions, slots)
        torch.testing.assert_close(runner(tokens, positions, slots), expected, rtol=1e-5, atol=1e-5)


def test_recompile_after_warm_up_is_an_error_naming_the_guard(pair):
    _, runner = pair
    runner.decoder.layers[0].attn.softmax_scale = 0.5  # a constant the compiled graph guarded on
    try:
        with pytest.raises(RuntimeError, match="recompile after warm-up(.|\n)*softmax_scale"):
            runner(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    finally:
        runner.decoder.layers[0].attn.softmax_scale = runner.decoder.config.head_dim**-0.5


def test_options_are_checked():
    with pytest.raises(ValueError, match="reduce-overhead"):
        fuse.CompileOptions(mode="reduce-overhead")
    with pytest.raises(ValueError, match="positive"):
        fuse.CompileOptions(buckets=(0, 2))
    with pytest.raises(ValueError, match="skinny_product_columns must be >= 0"):
        fuse.CompileOptions(skinny_product_columns=-1)
    with pytest.raises(ValueError, match="dump_dir writes the generated code; with compile=False there is none"):
        fuse.CompileOptions(dump_dir="dump", compile=False)
    with pytest.raises(ValueError, match="compilation must be one of \\('auto', 'nested', 'regional', 'whole'\\), got 'layers'"):
        fuse.CompileOptions(compilation="layers")
    with pytest.raises(ValueError, match="torch._inductor.config does not have: \\['combo_kernel'\\]"):
        fuse.CompileOptions(inductor_options={"combo_kernel": True, "combo_kernels": True})
    with pytest.raises(ValueError, match="batch_one_shared=True needs dynamic_batch=True"):
        fuse.CompileOptions(batch_one_shared=True, dynamic_batch=False)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"kernel_compile_workers must be >= 0 \(0: none ahead\) or None"):
            fuse.CompileOptions(kernel_compile_workers=bad)
        with pytest.raises(ValueError, match=r"^compile_workers must be >= 0 \(0: none\) or None"):
            fuse.CompileOptions(compile_workers=bad)


def test_auto_compilation_is_nested_only_where_dynamo_reuses_regions(monkeypatch):
    import fuse.options

    for reuses, expected in ((True, "nested"), (False, "regional")):
        monkeypatch.setattr(fuse.options, "dynamo_reuses_nested_regions", lambda: reuses)
        assert fuse.CompileOptions().compilation == expected
        assert fuse.CompileOptions(compilation="whole").compilation == "whole"


def test_each_build_compiles_private_code(pair):
    """Two builds of one model's step share no code object, so Dynamo keeps their graphs apart."""
    from fuse.step import build_step

    eager, _ = pair
    for compilation in ("nested", "whole", "regional"):
        options = fuse.CompileOptions(compilation=compilation)
        first, second = build_step(eager, options), build_step(eager, options)
        assert first.once_per_step and first.once_per_step[0] is not second.once_per_step[0]
        assert first.once_per_step[0].co_code == second.once_per_step[0].co_code
        if compilation == "regional":
            assert first.per_layer is not second.per_layer


def test_inductor_options_reach_the_backend_last():
    from fuse.backend import compile_backend

    options = fuse.CompileOptions(inductor_options={"combo_kernels": True, "split_reductions": True})
    patches = compile_backend(options, torch.device("cuda")).config_patches
    assert patches["combo_kernels"] is True
    assert patches["split_reductions"] is True  # the user's patch wins over compile_decode's own
    assert compile_backend(fuse.CompileOptions(), torch.device("cuda")).config_patches["split_reductions"] is False


def test_programmatic_dependent_launch_is_on_for_cuda_and_can_be_turned_off():
    from fuse.backend import compile_backend

    assert compile_backend(fuse.CompileOptions(), torch.device("cuda")).config_patches["triton.enable_pdl"] is True
    assert "triton.enable_pdl" not in compile_backend(fuse.CompileOptions(), torch.device("cpu")).config_patches
    off = fuse.CompileOptions(inductor_options={"triton.enable_pdl": False})
    assert compile_backend(off, torch.device("cuda")).config_patches["triton.enable_pdl"] is False


def test_the_compile_pool_starts_ahead_only_for_gpu_compiles(monkeypatch):
    """warm_compile_pool starts Inductor's pool of Triton compile processes for a CUDA device
    (torch's own backend does at its first call) and leaves the CPU's C++ compiles alone."""
    from torch._inductor import async_compile

    from fuse.backend import warm_compile_pool

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(True))
    warm_compile_pool(torch.device("cpu"))
    assert started == []
    warm_compile_pool(torch.device("cuda", 0))
    assert started == [True]


def test_regional_compile_matches_eager(tiny_regional):
    """compilation="regional" with batch_one_shared: per layer kind (ratio, hash or score routing)
    one graph with the batch unbacked, and the head (hc head, final norm, LM head) as one more
    region; the logits stay those of the eager step for batch 1 and for a batch padded into its
    bucket."""
    eager, runner, _, _ = tiny_regional
    assert runner.stats.compiles == layer_kinds(eager.config) + 1  # the blocks' graphs, then the head's
    assert runner.stats.graph_breaks == 0
    restore = restore_point(eager)
    try:
        for tokens, positions, slots in (([9], [0], [1]), ([5, 2], [0, 0], [2, 3]), ([7, 11, 3], [0, 0, 0], [0, 1, 3])):
            inputs = torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots)
            expected = eager(*inputs)
            actual = runner(*inputs)
            assert ((actual - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    finally:
        restore()


def run_graphs_as_traced(monkeypatch) -> None:
    """fuse's backend without Inductor: each graph runs as Dynamo traced it (for checks of what
    Dynamo records, at a fraction of a compile's time)."""
    monkeypatch.setattr("fuse.backend.compile_fx", lambda graph, example_inputs, config_patches: graph.forward)


@pytest.mark.parametrize("compilation", ["regional", "nested"])
def test_batch_one_shares_the_symbolic_graph(compilation, monkeypatch):
    """batch_one_shared: batch 1 runs the symbolic batch's graph (the batch unbacked), so each
    layer kind compiles once where batch 1 would add a second graph (the default: the nested
    step compiles twice, test_compiled_matches_eager_over_mixed_batches); every batch size, 1
    included, gives eager's logits. The graphs run as Dynamo traced them: Inductor's code for an
    unbacked batch is checked on the shared regional runner (test_regional_compile_matches_eager)."""
    run_graphs_as_traced(monkeypatch)
    cfg = ModelConfig.preset("tiny")
    eager = Decoder(cfg, **TINY_SHAPE).init_random(seed=31)
    model = Decoder(cfg, **TINY_SHAPE)
    model.load_state_dict(eager.state_dict())
    runner = fuse.compile_decode(model, buckets=(1, 2, 4), compilation=compilation, batch_one_shared=True, progress=False)
    graphs = layer_kinds(cfg) + 1 if compilation == "regional" else 1
    assert runner.stats.compiles == graphs and runner.stats.graph_breaks == 0
    for size in (1, 3, 4, 1, 2):
        slots = torch.arange(size).flip(0)
        inputs = torch.arange(size) * 3 + 1, torch.zeros(size, dtype=torch.long), slots
        expected = eager(*inputs)
        assert ((runner(*inputs) - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    assert runner.stats.recompiles == 0


@pytest.mark.parametrize("compilation", ["regional", "whole"])
def test_batch_one_shared_bounds_and_hints_the_batch(compilation, monkeypatch):
    """The unbacked batch of batch_one_shared is known to lie in [1, largest bucket] in every
    graph (unbounded, Inductor could not prove 32-bit indices safe) and carries the largest bucket
    as Inductor's size hint (without one it tunes for a batch of thousands). Dynamo's traced
    graphs carry both, so Inductor's compile is left out (each graph runs as traced)."""
    from fuse.step import build_step

    run_graphs_as_traced(monkeypatch)
    cfg = ModelConfig.preset("tiny")
    model = Decoder(cfg, **TINY_SHAPE).init_random(seed=32)
    graphs = []
    options = fuse.CompileOptions(buckets=(1, 2, 4), compilation=compilation, batch_one_shared=True)
    step = build_step(model, options, on_graph=graphs.append)
    with torch.no_grad():
        step.run(torch.tensor([5, 7, 9]), torch.tensor([0, 3, 1]), torch.tensor([2, 0, 1]))
    assert len(graphs) == (layer_kinds(cfg) + 1 if compilation == "regional" else 1)
    for graph in graphs:
        inputs = [node.meta.get("example_value") for node in graph.graph.find_nodes(op="placeholder")]
        batches = [t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0 and isinstance(t.shape[0], torch.SymInt)]
        assert batches, "no input has a symbolic batch"
        for batch in batches:
            shape_env, symbol = batch.node.shape_env, batch.node.expr
            bounds = shape_env.bound_sympy(symbol)
            assert (int(bounds.lower), int(bounds.upper)) == (1, 4), (symbol, bounds)
            assert shape_env.var_to_hint_override.get(symbol) == 4


def test_failed_capture_falls_back_for_that_bucket_only(pair, monkeypatch):
    """The capture of bucket 4 fails (as a capture-unsafe op would): that bucket runs without a
    graph and says why; bucket 1 keeps its graph. (The eager step stands in for the compiled one:
    the fallback does not depend on which step it runs.)"""
    import fuse.graphs
    import fuse.runner

    def capture(fn, pool=None, warmup=1):
        output = fn()
        if output.shape[0] == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return None, output

    monkeypatch.setattr(fuse.runner, "supports_graphs", lambda device: True)
    monkeypatch.setattr(fuse.graphs, "capture", capture)
    eager, _ = pair
    model = Decoder(eager.config, **TINY_SHAPE)
    model.load_state_dict(eager.state_dict())
    runner = fuse.compile_decode(model, buckets=(1, 4), compile=False, progress=False)
    assert runner.stats.captured == [1]
    assert list(runner.stats.fallbacks) == [4]
    assert "not permitted when stream is capturing" in runner.stats.fallbacks[4]
    assert "runs eager without a graph" in runner.describe()
    tokens, positions, slots = torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    fresh = Decoder(eager.config, **TINY_SHAPE)
    fresh.load_state_dict(eager.state_dict())
    torch.testing.assert_close(runner(tokens, positions, slots), fresh(tokens, positions, slots), rtol=1e-4, atol=1e-4)


def test_triton_toolchain_is_pinned_the_way_inductor_pins_it(monkeypatch):
    """A warm start must compile custom kernels with the ptxas a cold start used (the one Inductor
    selects); the runner asks Inductor's own helpers for it before compiling anything."""
    from torch._inductor.runtime import compile_tasks

    calls = []
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        if hasattr(compile_tasks, name):
            monkeypatch.setattr(compile_tasks, name, lambda name=name: calls.append(name))
    fuse.backend.pin_triton_toolchain()
    assert calls and calls[0] == "_set_triton_ptxas_path", calls
