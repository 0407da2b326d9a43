"""Graphs compiled in worker processes (fuse/compile_workers.py): this process then loads every
graph from the caches and computes eager's logits; a worker that fails costs only its time."""
from __future__ import annotations

import logging
import os
import re

import pytest
import torch

import fuse
from fuse import compile_workers
from fuse.step import layer_kinds
from model import Decoder, ModelConfig

SHAPE = dict(max_batch=4, max_seq_len=64)


def tiny(layers: int, seed: int = 0, dtype=torch.float32, device: str = "cpu") -> Decoder:
    return Decoder(ModelConfig.preset("tiny", layers=layers), dtype=dtype, device=device, **SHAPE).init_random(seed)


def logits_match_eager(runner, eager: Decoder) -> None:
    for size in (1, 3):
        inputs = [t.to(eager.device) for t in (torch.arange(size) * 5 + 2, torch.zeros(size, dtype=torch.long), torch.arange(size).flip(0))]
        expected = eager(*inputs)
        assert ((runner(*inputs) - expected).abs().max() / expected.abs().max()).item() <= 1e-4


def test_each_worker_builds_the_first_layer_of_its_kinds():
    model = tiny(6)
    firsts = [kind[0] for kind in layer_kinds(model)]
    assert len(firsts) < len(model.layers)  # kinds repeat
    buckets = (1, 2, 4)

    def jobs(**options):
        return compile_workers.worker_jobs(model, fuse.CompileOptions(compilation="regional", **options), buckets)

    # fewer workers than kinds and shapes: the kinds spread over them, every bucket each
    for count in (1, 2, len(firsts)):
        assert len(jobs(compile_workers=count)) == min(count, len(firsts))
        assert sorted(i for job in jobs(compile_workers=count) for i in job.layer_ids) == firsts
        assert all(job.buckets == buckets for job in jobs(compile_workers=count))
    # enough: one per kind and batch shape (batch 1's graph, the symbolic batch's)
    expected = sorted(((first,), shape) for first in firsts for shape in ((1,), (2, 4)))
    for count in (2 * len(firsts), 2 * len(firsts) + 3):
        assert sorted((job.layer_ids, job.buckets) for job in jobs(compile_workers=count)) == expected
    assert {job.buckets for job in jobs(compile_workers=9 * len(firsts), batch_one_shared=True)} == {buckets}
    assert {job.buckets for job in jobs(compile_workers=9 * len(firsts), dynamic_batch=False)} == {(1,), (2,), (4,)}
    assert jobs(compile_workers=0) == []
    # not where they cannot help: a whole-step graph, or "as many as fit" (CUDA only) on a CPU; off by default
    assert compile_workers.worker_jobs(model, fuse.CompileOptions(compilation="whole", compile_workers=2), buckets) == []
    assert jobs(compile_workers=None) == []
    assert jobs() == []
    with pytest.raises(ValueError, match="compile_workers must be >= 0"):
        fuse.CompileOptions(compile_workers=-1)


def test_a_worker_decoder_maps_the_weights_of_its_layers_and_copies_their_buffers():
    """On CUDA a worker's decoder takes this process's tensors (fuse/compile_workers.py sends them
    as IPC handles): its layer j is this decoder's layer layer_ids[j], the weights the same memory,
    the buffers copies it writes alone. Its step computes what a decoder of those layers loaded
    with the same state computes."""
    model = tiny(6, seed=3)
    model.layers[4].attn.kv_cache.normal_()  # a buffer holding something
    layer_ids = tuple(kind[0] for kind in layer_kinds(model))[::-1]
    worker = Decoder(model.config, dtype=torch.float32, device="meta", layer_ids=layer_ids, **SHAPE)
    compile_workers.adopt_tensors(worker, compile_workers.worker_tensors(model, layer_ids))
    here = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in (*worker.named_parameters(), *worker.named_buffers()):
        original = here[name if not name.startswith("layers.") else
                        "layers.{}.{}".format(layer_ids[int(name.split(".")[1])], name.split(".", 2)[2])]
        assert torch.equal(tensor, original), name
        assert (tensor.data_ptr() == original.data_ptr()) == isinstance(tensor, torch.nn.Parameter), name
    built = Decoder(model.config, dtype=torch.float32, layer_ids=layer_ids, **SHAPE)
    adopted = {**dict(worker.named_parameters()), **dict(worker.named_buffers())}
    with torch.no_grad():
        for name, tensor in (*built.named_parameters(), *built.named_buffers()):
            tensor.copy_(adopted[name])
    inputs = (torch.tensor([7, 3]), torch.tensor([0, 5]), torch.tensor([1, 0]))
    assert torch.equal(worker(*inputs), built(*inputs))
    assert not torch.equal(model.layers[4].attn.kv_cache, worker.layers[layer_ids.index(4)].attn.kv_cache)  # the step wrote the copy
    outside = {k: v for k, v in compile_workers.worker_tensors(model, (1,)).items() if not k.startswith("layers.")}
    with pytest.raises(RuntimeError, match=r"no tensor given for \['layers\.0\."):
        compile_workers.adopt_tensors(Decoder(model.config, dtype=torch.float32, device="meta", layer_ids=(1,), **SHAPE), outside)


def with_rope_table_layer(config: ModelConfig) -> ModelConfig:
    return config.replace(compress_ratios=(4,) + config.compress_ratios[1:])  # the kind with the rope table


@pytest.mark.parametrize("other_widths_first", [False, True])
def test_the_start_loads_every_graph_the_workers_compiled(tmp_path, caplog, other_widths_first):
    """A worker per batch shape of a layer kind that takes the rope table the step hands its
    blocks: its graphs must be traced alike in the batch-1 worker, which traces its block before
    any head, and here, where the head is traced at the larger bucket first. Also where this
    process compiled a decoder of other widths first: Dynamo remembers per frame the sizes earlier
    compiles saw, which must not make this process trace them otherwise than a fresh worker."""
    config = with_rope_table_layer(ModelConfig.preset("tiny", layers=1))
    if other_widths_first:
        widths = with_rope_table_layer(ModelConfig.preset("tiny-fp8", layers=1).replace(dtype="bf16", expert_dtype=None))
        assert widths.head_dim != config.head_dim
        other = Decoder(widths, dtype=torch.float32, **SHAPE).init_random(4)
        fuse.compile_decode(other, buckets=(1, 4), compilation="regional")
    eager = Decoder(config, dtype=torch.float32, **SHAPE).init_random(5)
    model = Decoder(config, dtype=torch.float32, **SHAPE)
    model.load_state_dict(eager.state_dict())
    assert len(layer_kinds(model)) == 1
    with caplog.at_level(logging.WARNING, logger="fuse"):
        runner = fuse.compile_decode(model, buckets=(1, 4), compilation="regional", compile_workers=2,
                                     cache_dir=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if "compile worker" in r.getMessage() or "worker processes" in r.getMessage()]
    assert lines[0] == "fuse: compiling the graphs in 2 worker processes"
    # a line for each as it ends, in the order they end, with its layers and buckets
    assert sorted(re.sub(r"\d+ of 2 ", "", line.split(" done in")[0]) for line in lines[1:]) == [
        "fuse: compile worker (layers [0], buckets [1])", "fuse: compile worker (layers [0], buckets [4])"]
    assert [line.split(" of 2")[0] for line in lines[1:]] == ["fuse: compile worker 1", "fuse: compile worker 2"]
    s = runner.stats
    assert s.compile_workers == 2 and s.compiles == 2 * 2  # traced here: the block and the head at each batch shape
    assert (s.inductor_compiles, s.aot_compiles) == (0, 0), runner.describe()
    assert s.start_seconds["waiting for compile workers"] > 0
    # each worker's phases, from its launch: together no longer than the wait for them
    assert [list(w) for w in s.compile_worker_seconds] == [["start-up", "decoder", "graphs"]] * 2
    for seconds in s.compile_worker_seconds:
        assert all(v > 0 for v in seconds.values()) and sum(seconds.values()) <= s.start_seconds["waiting for compile workers"] + 0.1
    logits_match_eager(runner, eager)


def test_an_artifact_build_loads_the_frames_the_workers_compiled(tmp_path):
    """A start that builds an artifact compiles its frames ahead (fuse/frames.py): the workers
    compile them, one layer kind each, each block frame renamed from its worker's decoder to this
    one's kind, and this process loads them without compiling."""
    eager = tiny(3, seed=5)
    model = tiny(3)
    model.load_state_dict(eager.state_dict())
    runner = fuse.compile_decode(model, buckets=(4,), compile_workers=2, artifact=str(tmp_path / "a.zip"), progress=False)
    s, kinds = runner.stats, len(layer_kinds(model))
    assert s.compile_workers == 2 and runner.frames.compiled == [], runner.describe()
    assert sorted(runner.frames.functions) == sorted([f"block{k}/batch" for k in range(kinds)] + ["head/batch"])
    assert s.compiles == kinds + 2  # each worker's blocks, and the head in each worker
    assert runner.artifact.contents["frames"] == kinds + 1
    assert [list(w)[-1] for w in s.compile_worker_seconds] == ["frames written"] * 2
    logits_match_eager(runner, eager)


@pytest.mark.gpu
def test_gpu_workers_compile_each_batch_shape_and_the_artifact_build_loads_their_frames(tmp_path, monkeypatch):
    """On CUDA: one worker per batch shape of the one layer kind, the custom ops' kernels compiled
    in this process while they run, and this process loads their frames without compiling."""
    from fuse import precompile

    eager = tiny(1, seed=5, device="cuda")
    model = tiny(1, device="cuda")
    model.load_state_dict(eager.state_dict())
    events = []
    compile_op_calls, finish = precompile.compile_op_calls, compile_workers.finish
    monkeypatch.setattr(precompile, "compile_op_calls", lambda *args: events.append("kernels") or compile_op_calls(*args))
    monkeypatch.setattr(compile_workers, "finish", lambda workers, **kw: events.append("workers waited for") or finish(workers, **kw))
    runner = fuse.compile_decode(model, buckets=(1, 4), compile_workers=2, artifact=str(tmp_path / "a.zip"), progress=False)
    s = runner.stats
    assert events == ["kernels", "workers waited for"] and s.kernels_compiled_ahead > 0
    assert [list(w) for w in s.compile_worker_seconds] == [list(compile_workers.WORKER_PHASES)] * 2
    assert s.compile_workers == s.compile_workers_started == 2 and runner.frames.compiled == [], runner.describe()
    assert 0 < s.compile_worker_peak_bytes < compile_workers.WORKER_OVERHEAD_BYTES  # what a worker is counted for
    assert sorted(runner.frames.functions) == ["block0/batch", "block0/batch1", "head/batch", "head/batch1"]
    assert s.captured == [4, 1]
    logits_match_eager(runner, eager)


def test_a_workers_phases_and_peak_are_read_from_its_last_report_line():
    line = compile_workers.REPORT_LINE
    output = (f'compiling\n{line}{{"reached": {{"start-up": 1.0}}, "peak_bytes": 5}}\n'
              f'{line}{{"reached": {{"start-up": 102.0, "decoder": 103.5, "graphs": 110.0}}, "peak_bytes": 7}}\nbye\n')
    assert compile_workers.read_report(output, launched=100.0) == ({"start-up": 2.0, "decoder": 1.5, "graphs": 6.5}, 7)
    assert compile_workers.read_report("Traceback ...\n", launched=100.0) == ({}, 0)


def test_a_failed_worker_warns_and_the_start_compiles_its_graphs(tmp_path, monkeypatch):
    eager = tiny(1, seed=6)
    model = tiny(1)
    model.load_state_dict(eager.state_dict())
    monkeypatch.setattr(compile_workers, "worker_jobs", lambda model, options, buckets: [compile_workers.Job((7,), buckets)])  # no such layer
    with pytest.warns(UserWarning, match=r"(?s)compile worker of layers \[7\], buckets \[4\], failed .*layer_ids must name some"):
        runner = fuse.compile_decode(model, buckets=(4,), compilation="regional", cache_dir=str(tmp_path), progress=False)
    assert (runner.stats.compile_workers, runner.stats.compile_workers_started) == (0, 1) and runner.stats.inductor_compiles > 0
    assert "graphs from 0 of 1 compile workers" in runner.describe()
    assert runner.stats.compile_worker_seconds == [] and runner.stats.compile_worker_peak_bytes == 0
    logits_match_eager(runner, eager)


def test_a_start_that_fails_while_its_workers_compile_stops_them_and_removes_their_files(tmp_path, monkeypatch):
    started = []
    start = compile_workers.start
    monkeypatch.setattr(compile_workers, "start", lambda *args: started.extend(start(*args)) or started)

    def finish(workers, progress=False):
        raise RuntimeError("the runner failed while its workers compiled")

    monkeypatch.setattr(compile_workers, "finish", finish)
    with pytest.raises(RuntimeError, match="while its workers compiled"):
        fuse.compile_decode(tiny(1), buckets=(4,), compilation="regional", compile_workers=1, cache_dir=str(tmp_path), progress=False)
    assert len(started) == 1 and started[0].process.poll() is not None  # ended, not left compiling
    assert not [path for path in (started[0].log_path, started[0].spec_path) if os.path.exists(path)]
