"""Programmatic dependent launch (kernels/dependent_launch.py): a custom op's kernels, launched to
start while the kernel before them drains, read nothing that kernel writes before it is done.

On the GPU each op of a decode step is captured in a CUDA graph behind a kernel that lets its
successor launch at once and only then, after a delay, writes the op's activations: an op that
read them early would compute on the values from before. A control kernel that does not wait
shows that the window is real."""
from __future__ import annotations

import pytest
import torch

from kernels.dependent_launch import dependent_options
from kernels.triton_util import launches_dependents, plain_launches

# Arguments a step's kernels write before the op reads them; the others are parameters.
ACTIVATIONS = {
    "x", "out", "streams", "post", "comb", "mixes", "q", "index_cache", "slots", "visible", "scores", "inputs",
    "expert_ids", "expert_weights", "kv_cache", "indices", "hashed_ids",
}
PER_TOKEN_WEIGHTS = {"v4::indexer_scores", "v4::indexer_topk"}  # their `weights` come from the token
SPINS = 20000  # the writer's delay before it writes: tens of microseconds
WRITER_PROGRAMS = 132
ALIGN = 256


def test_plain_launches_turns_dependent_launch_off_and_back():
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    before = launches_dependents(device)
    with plain_launches():
        assert not launches_dependents(device)
        assert dependent_options(device) == {}
        with pytest.raises(RuntimeError):
            with plain_launches():
                raise RuntimeError("inner")
        assert not launches_dependents(device)  # the inner context's exit restored the outer one's
    assert launches_dependents(device) == before


def test_no_dependent_launch_off_the_gpu():
    assert not launches_dependents(torch.device("cpu"))
    assert dependent_options(torch.device("cpu")) == {}


def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def late_writer(src_ptr, dst_ptr, n, spins, sink_ptr, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now, before the writes
        pid = tl.program_id(0)
        acc = pid.to(tl.float32)
        for _ in range(spins):
            acc = acc * 0.999 + 1.0
        tl.store(sink_ptr + pid, acc)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    @triton.jit
    def eager_reader(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        # no gdc_wait: what a kernel that reads before it waits would see
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    return late_writer, eager_reader


class Arena:
    """The activations of one op call as views into one byte buffer, which one kernel rewrites."""

    def __init__(self, tensors: list[torch.Tensor]):
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.bytes = torch.zeros(max(size, ALIGN), dtype=torch.uint8, device="cuda")
        self.views = [
            self.bytes[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)
        ]

    def holding(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The arena's bytes with `tensors` in place of the views."""
        for view, t in zip(self.views, tensors):
            view.copy_(t)
        return self.bytes.clone()


def _other_values(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Valid values of t's kind that differ from t's: floats moved by their spread, integers (ids,
    slots, lengths) taken from the next row."""
    if t.is_floating_point():
        f = t.float()
        noise = torch.randn(f.shape, generator=generator, device="cpu").to(t.device)
        return (f + noise * (f.std() if f.numel() > 1 else 1.0) + 0.5).to(t.dtype)
    return torch.roll(t, 1, 0) if t.dim() and t.shape[0] > 1 else t.clone()


def _split_args(op: str, func, args, kwargs):
    """The call's arguments by schema name, with the activation tensors (lists flattened) listed."""
    schema = func._schema
    named = dict(zip([a.name for a in schema.arguments], args)) | kwargs
    active = ACTIVATIONS | ({"weights"} if op in PER_TOKEN_WEIGHTS else set())
    tensors = []
    for name, value in named.items():
        if name not in active:
            continue
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(v for v in value if isinstance(v, torch.Tensor))
    return named, active, tensors


def _with(named: dict, active: set, tensors: list[torch.Tensor]) -> dict:
    """The arguments with the activations replaced, in order, by `tensors`."""
    it = iter(tensors)
    out = {}
    for name, value in named.items():
        if name in active and isinstance(value, torch.Tensor):
            out[name] = next(it)
        elif name in active and isinstance(value, (list, tuple)):
            out[name] = [next(it) if isinstance(v, torch.Tensor) else v for v in value]
        else:
            out[name] = value
    return out


def _flat(outputs) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@pytest.fixture(scope="module")
def step_calls():
    """The step's op calls, and the calls of the ops a step makes through another: the indexer's
    halves (from its whole) and the FP4 experts without the FP8 shared expert beside them."""
    from op_calls import record_step_op_calls

    calls = record_step_op_calls()
    if "v4::indexer_topk" in calls:
        _, args, _ = calls["v4::indexer_topk"]
        scores = torch.ops.v4.indexer_scores.default(*args[:5])
        calls.setdefault("v4::indexer_scores", (torch.ops.v4.indexer_scores.default, tuple(args[:5]), {}))
        calls.setdefault("v4::indexer_select", (torch.ops.v4.indexer_select.default, (scores, args[4], args[5]), {}))
    if "v4::moe_experts_scaled_shared" in calls:
        _, args, _ = calls["v4::moe_experts_scaled_shared"]
        *routed, swiglu_limit, pow2 = (*args[:9], *args[-2:])
        calls.setdefault("v4::moe_experts_scaled", (torch.ops.v4.moe_experts_scaled.default, (*routed, swiglu_limit, -1, pow2), {}))
    return calls


@pytest.fixture(scope="module")
def kernels_on_hopper():
    if not launches_dependents(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper-or-later GPU and a Triton with gdc_wait")
    return _triton_kernels()


def _late_write_then(late_writer, arena: Arena, values: torch.Tensor, then):
    sink = torch.empty(WRITER_PROGRAMS, dtype=torch.float32, device="cuda")
    late_writer[(WRITER_PROGRAMS,)](values, arena.bytes, arena.bytes.numel(), SPINS, sink, BLOCK=1024)
    return then()


@pytest.mark.gpu
def test_the_window_is_real(kernels_on_hopper):
    """A dependent that reads before it waits sees the values from before the late writer's."""
    late_writer, eager_reader = kernels_on_hopper
    arena = Arena([torch.empty(1 << 16, dtype=torch.float32, device="cuda")])
    before = arena.holding([torch.zeros(1 << 16, device="cuda")])
    after = arena.holding([torch.ones(1 << 16, device="cuda")])
    seen = torch.empty_like(arena.bytes)

    def read():
        eager_reader[(arena.bytes.numel() // 1024,)](arena.bytes, seen, arena.bytes.numel(), BLOCK=1024, launch_pdl=True)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        arena.bytes.copy_(before)
        _late_write_then(late_writer, arena, after, read)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(arena.bytes, after)
    assert not torch.equal(seen, after), "a kernel that did not wait saw the late writes: the test's window is not open"


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted({
    "v4::blockscale_linear", "v4::grouped_linear", "v4::hc_post_pre_norm", "v4::hc_pre_norm", "v4::hc_split_sinkhorn",
    "v4::indexer_scores", "v4::indexer_select", "v4::indexer_topk", "v4::linears_beside", "v4::moe_experts",
    "v4::moe_experts_scaled", "v4::moe_experts_scaled_shared", "v4::moe_gate", "v4::sparse_mla_decode",
}))
def test_op_reads_what_the_kernel_before_wrote(op, step_calls, kernels_on_hopper):
    late_writer, _ = kernels_on_hopper
    if op not in step_calls:
        pytest.skip(f"the recorded step did not call {op}")
    func, args, kwargs = step_calls[op]
    named, active, tensors = _split_args(op, func, args, kwargs)
    assert tensors, f"{op}: no activation argument found"
    generator = torch.Generator().manual_seed(0)
    arena = Arena([t.contiguous() for t in tensors])
    old = arena.holding([t.contiguous() for t in tensors])
    new_values = [_other_values(t.contiguous(), generator) for t in tensors]
    new = arena.holding(new_values)

    with plain_launches():
        expected = [t.clone() for t in _flat(func(**_with(named, active, [v.clone() for v in new_values])))]
    call = lambda: _flat(func(**_with(named, active, arena.views)))  # noqa: E731
    arena.bytes.copy_(new)
    call()  # warm-up outside the capture: compiles, tunes, makes the arrival counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        arena.bytes.copy_(old)
        outputs = _late_write_then(late_writer, arena, new, call)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(outputs, expected)):
            assert torch.equal(got, want), (
                f"{op} output {i}: differs from the same call on the late-written values (max abs diff "
                f"{(got.float() - want.float()).abs().max().item():.3g}): it read an activation before the kernel before it was done"
            )
