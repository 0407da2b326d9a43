"""One rank of the split-model checks of tests/test_parallel.py, started by torchrun (gloo):

    torchrun --standalone --nproc-per-node W tests/parallel_worker.py OUT_DIR CHECK [CHECK ...]

Checks: `load` (a split load of safetensors checkpoints equals init_random's part), `decode`
(split eager and compiled logits against the one-process decoder's over 50 steps of mixed
batches), `corrupt` (a checkpoint only rank 1 reads is misshapen: every rank must raise rank
1's error), `compile-failure` (rank 1's step cannot be compiled: every rank must raise its
error), `gpu-decode` (NCCL, one GPU per rank: the split step compiled and captured against
the one-process decoder), `fuse-commands` (`fuse report` and `fuse bench` from the command
line, split across the ranks). Each rank writes what it found to OUT_DIR/rank<r>.json; an assertion that fails ends
the rank with status 1, a failure every rank raised as it should with status 3."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import random
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from model import Decoder, ModelConfig  # noqa: E402
from model.parallel import Parallel, ParallelError  # noqa: E402

SHAPE = dict(max_batch=4, max_seq_len=64)
STEPS = 50


def schedule(vocab: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Steps of batches of 1, 3, 2 and 4 sequences on 4 slots, each slot at its own position; a
    slot now and then starts a new sequence at position 0."""
    rng = random.Random(seed)
    position = [0] * SHAPE["max_batch"]
    out = []
    for step in range(steps):
        batch = (1, 3, 2, 4)[step % 4]
        slots = rng.sample(range(SHAPE["max_batch"]), batch)
        for s in slots:
            if rng.random() < 0.05:
                position[s] = 0
        tokens = torch.tensor([rng.randrange(vocab) for _ in slots])
        positions = torch.tensor([position[s] for s in slots])
        for s in slots:
            position[s] += 1
        out.append((tokens, positions, torch.tensor(slots)))
    return out


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def check_decode(parallel: Parallel, report: dict) -> None:
    """Split eager and split compiled against the one-process decoder, same seed, fp32, with
    exact arithmetic (the QAT rounding simulation off): 1e-5. With it on (the preset's default),
    the split eager step: a 1e-7 change of a sum's order now and then moves one value across an
    fp8 / fp4 rounding step, which changes that sequence's later logits by about 1e-4."""
    import fuse

    cfg = ModelConfig.preset("tiny").replace(qat=False)
    steps = schedule(cfg.vocab_size, STEPS, seed=7)
    whole = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=3)
    expected = [whole(*batch) for batch in steps]
    split = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=3)
    compiled = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=3)
    torch._dynamo.utils.counters.clear()
    runner = fuse.compile_decode(compiled, buckets=(4,), dynamic_batch=False, progress=False)
    for name, run in (("eager", split), ("compiled", runner)):
        report[f"{name} worst relative error"] = compare(name, run, steps, expected, 1e-5, parallel)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert runner.stats.graph_breaks == 0 and breaks == 0, f"graph breaks: {runner.describe()}"
    report["graph breaks"] = breaks
    report["runner"] = runner.describe()

    cfg = ModelConfig.preset("tiny")
    whole = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=3)
    expected = [whole(*batch) for batch in steps]
    split = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=3)
    report["eager with qat worst relative error"] = compare("eager with qat", split, steps, expected, 1e-3, parallel)


def compare(name: str, run, steps: list, expected: list, tolerance: float, parallel: Parallel) -> float:
    worst = 0.0
    for i, batch in enumerate(steps):
        error = relative(run(*batch), expected[i])
        assert error <= tolerance, f"rank {parallel.rank} {name} step {i}: relative error {error:.2e}"
        worst = max(worst, error)
    assert worst > 0, f"{name}: bit-identical to the one-process decoder: is it split at all?"
    return worst


def check_load(parallel: Parallel, out: pathlib.Path, report: dict) -> None:
    """Checkpoints written by the one-process decoder, loaded split: the parts equal what
    init_random gives the split decoder. bf16 (two files), and FP8 linears / FP4 experts loaded
    as they are and into a dense model (dequantised, scales read by the part)."""
    from safetensors.torch import save_file

    fp8 = ModelConfig.preset("tiny-fp8")
    dense = fp8.replace(dtype="bf16", expert_dtype=None)
    for name, cfg, stored_as, dtype in (
        ("bf16", ModelConfig.preset("tiny"), None, torch.float32),
        ("fp8", fp8, None, torch.bfloat16),
        ("fp8-dequantised", dense, fp8, torch.bfloat16),
    ):
        folder = out / f"checkpoint-{name}"
        if parallel.rank == 0:
            state = Decoder(stored_as or cfg, dtype=dtype, device="cpu", **SHAPE).init_random(seed=5).state_dict()
            folder.mkdir()
            keys = sorted(state)
            save_file({k: state[k].contiguous() for k in keys[::2]}, str(folder / "a.safetensors"))
            save_file({k: state[k].contiguous() for k in keys[1::2]}, str(folder / "b.safetensors"))
        dist.barrier()
        loaded = Decoder(cfg, dtype=dtype, parallel=parallel, **SHAPE)
        loaded.load_official(folder)
        if stored_as is None:
            drawn = Decoder(cfg, dtype=dtype, parallel=parallel, **SHAPE).init_random(seed=5).state_dict()
        else:  # the one-process dense decoder's load, this rank's part of it
            whole = Decoder(cfg, dtype=dtype, **SHAPE)
            whole.load_official(folder)
            drawn = {k: v for k, v in whole.state_dict().items() if not parallel.held_elsewhere(k, cfg.n_routed_experts)}
            drawn = {k: _part(parallel, k, v) for k, v in drawn.items()}
        got = loaded.state_dict()
        assert sorted(got) == sorted(drawn), f"{name}: keys differ: {sorted(set(got) ^ set(drawn))[:5]}"
        differ = [k for k in got if got[k].shape != drawn[k].shape or not torch.equal(got[k].view(torch.uint8), drawn[k].view(torch.uint8))]
        assert not differ, f"{name}: rank {parallel.rank} loaded other values than its part for {differ[:5]}"
        report[f"load {name} tensors"] = len(got)

    # A mapping whose other ranks' experts hold no data (meta tensors): they are never read.
    cfg = ModelConfig.preset("tiny")
    state = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=5).state_dict()
    hollow = {k: v.to("meta") if parallel.held_elsewhere(k, cfg.n_routed_experts) else v for k, v in state.items()}
    loaded = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE)
    loaded.load_official(hollow)
    assert torch.equal(loaded.embed.weight, _part(parallel, "embed.weight", state["embed.weight"]))
    report["load from a mapping"] = "ok"


def _part(parallel: Parallel, name: str, tensor: torch.Tensor) -> torch.Tensor:
    part = parallel.part(name, tuple(tensor.shape))
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)


def check_corrupt(parallel: Parallel, out: pathlib.Path, report: dict) -> None:
    """Rank 1's checkpoint has a misshapen tensor: every rank raises rank 1's error, and rank
    0, whose checkpoint is sound, keeps its weights."""
    from safetensors.torch import save_file

    cfg = ModelConfig.preset("tiny")
    state = Decoder(cfg, dtype=torch.float32, **SHAPE).init_random(seed=5).state_dict()
    if parallel.rank == 1:
        state["layers.2.attn.wo_b.weight"] = torch.zeros(3, 5)
    path = out / f"corrupt-rank{parallel.rank}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    decoder = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=9)
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    try:
        decoder.load_official(path)
    except ParallelError as error:
        report["corrupt error"] = str(error)
        report["corrupt failing rank"] = error.rank
        report["corrupt is ValueError"] = isinstance(error, ValueError)
        report["corrupt weights unchanged"] = all(torch.equal(v, before[k]) for k, v in decoder.state_dict().items())
        report["agreed failures"] = report.get("agreed failures", 0) + 1
        return
    raise AssertionError(f"rank {parallel.rank}: the load of a corrupt checkpoint on rank 1 did not fail here")


def check_compile_failure(parallel: Parallel, report: dict) -> None:
    """Rank 1's block cannot be compiled (a graph break under fullgraph): rank 0 compiles its
    block, and then must raise rank 1's error rather than run the block's collectives alone."""
    import fuse

    cfg = ModelConfig.preset("tiny", layers=1)
    decoder = Decoder(cfg, dtype=torch.float32, parallel=parallel, **SHAPE).init_random(seed=1)
    if parallel.rank == 1:
        gate = decoder.layers[0].ffn.gate
        plain = gate.forward

        def breaking(x, tokens):
            torch._dynamo.graph_break()
            return plain(x, tokens)

        gate.forward = breaking
    try:
        fuse.compile_decode(decoder, buckets=(1,), compilation="regional", dynamic_batch=False, progress=False)
    except ParallelError as error:
        report["compile error"] = str(error)[:2000]
        report["compile failing rank"] = error.rank
        report["agreed failures"] = report.get("agreed failures", 0) + 1
        return
    raise AssertionError(f"rank {parallel.rank}: compile_decode did not fail although rank 1 could not compile")


def check_gpu_decode(parallel: Parallel, report: dict) -> None:
    """On CUDA with NCCL: the split step compiled and captured per bucket (the collectives in the
    graphs) against the one-process eager decoder on the same GPU, fp32, exact arithmetic."""
    import fuse

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = ModelConfig.preset("tiny").replace(qat=False)
    steps = schedule(cfg.vocab_size, 20, seed=7)
    whole = Decoder(cfg, dtype=torch.float32, device=device, **SHAPE).init_random(seed=3)
    expected = [whole(*batch) for batch in steps]
    split = Decoder(cfg, dtype=torch.float32, device=device, parallel=parallel, **SHAPE).init_random(seed=3)
    runner = fuse.compile_decode(split, buckets=(1, 2, 4), progress=False)
    assert runner.stats.captured == [4, 2, 1] and not runner.stats.fallbacks, runner.describe()
    report["gpu worst relative error"] = compare("gpu compiled, captured", runner, steps, expected, 1e-4, parallel)
    report["gpu runner"] = runner.describe()


# `fuse report` and `fuse bench` as the command line runs them, their smallest settings, in one
# launch (each launch starts torch in every rank again: CI time).
FUSE_COMMANDS = {
    "report": ["report", "--preset", "tiny", "--layers", "2", "--no-inspect", "--steps", "2", "--timing-steps", "1"],
    "bench": ["bench", "--preset", "tiny", "--layers", "2", "--device", "cpu", "--contexts", "40", "--batches", "2",
              "--steps", "1", "--eager-steps", "1", "--repeats", "1"],
}


def check_fuse_commands(out: pathlib.Path, report: dict) -> None:
    """Each of FUSE_COMMANDS into OUT/<command>; which of them this rank wrote outputs for."""
    import fuse.bench
    import fuse.report
    from fuse.__main__ import main as fuse_main

    report["wrote"] = []
    for module in (fuse.report, fuse.bench):
        plain = module.write_outputs

        def recorded(*args, plain=plain, name=module.__name__.split(".")[-1]):
            report["wrote"].append(name)
            return plain(*args)

        module.write_outputs = recorded
    for name, argv in FUSE_COMMANDS.items():
        report[f"{name} status"] = fuse_main([*argv, "--out", str(out / name)])


def main() -> int:
    out, checks = pathlib.Path(sys.argv[1]), sys.argv[2:]
    if "gpu-decode" in checks:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    parallel = Parallel.from_process_group(timeout=datetime.timedelta(seconds=120))
    report: dict = {"rank": parallel.rank, "world_size": parallel.world_size}
    status = 0
    try:
        for check in checks:
            {"decode": lambda: check_decode(parallel, report), "load": lambda: check_load(parallel, out, report),
             "corrupt": lambda: check_corrupt(parallel, out, report),
             "compile-failure": lambda: check_compile_failure(parallel, report),
             "gpu-decode": lambda: check_gpu_decode(parallel, report),
             "fuse-commands": lambda: check_fuse_commands(out, report)}[check]()
    except BaseException:  # noqa: BLE001 - written for the test, then a non-zero exit
        report["error"] = traceback.format_exc()
        status = 1
    (out / f"rank{parallel.rank}.json").write_text(json.dumps(report, indent=1))
    if status:
        sys.stderr.write(report["error"])
        os._exit(status)  # a failed rank must not wait for the others in the group's teardown
    if report.get("agreed failures"):
        # Every rank raised the failing rank's error, as it should: each ends with a non-zero
        # status, once all have written their reports (torchrun stops the others at the first exit).
        dist.barrier(group=parallel.control_group)
        os._exit(3)
    dist.destroy_process_group()
    # Every check passed and is written: skip the interpreter's teardown, where a rank now and
    # then aborts in a C++ destructor ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
