"""fuse.inspect and CompileOptions.dump_dir: the depyf dump of the runner's compiled decode step
and its kernel index.

The CPU tests read the dumps of the session's shared tiny runners (tests/conftest.py: nested with
buckets 1, 2, 4, regional with the same buckets sharing one graph per layer kind); the Triton side of the parser is tested on a
hand-written piece of CUDA output code."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

import fuse
from fuse.inspection import DUMP_FILES, module_list
from fuse.output_code import known_ops, launches, ops_from_kernel_name, parse_output_code, triton_kernel_info, wrapper_arity
from kernels.hc_mix import tiles
from model import Decoder, ModelConfig


@pytest.fixture(scope="module")
def inspected(tiny_nested):
    """(decoder, its runner's inspection, state before and after the runner's build)."""
    _, runner, before, after = tiny_nested
    return runner.decoder, runner.inspection, before, after


def layer_kinds(cfg: ModelConfig) -> dict[int, tuple[int, bool]]:
    """Layer -> (compress ratio, hash routing): what makes blocks compile to different graphs."""
    return {i: (cfg.layer_ratios[i], i < cfg.n_hash_layers) for i in range(cfg.n_layers)}


def test_dump_has_bytecode_graphs_and_output_code(inspected):
    _, result, _, _ = inspected
    assert result.graphs
    for graph in result.graphs:
        files = graph.files
        transformed = files["transformed_code"].read_text()
        assert re.search(r"def __transformed_code_\d+_for_step\(tokens, positions, slots\)", transformed)
        assert re.search(rf"{graph.name}[_(]", transformed)  # it calls this graph
        assert "class GraphModule(torch.nn.Module)" in files["captured_graph"].read_text()
        for stage in ("aot_forward_graph", "post_grad_graph"):  # absent where the compile cache served the graph
            assert files[stage] is None or "torch.ops.aten." in files[stage].read_text()
        output = files["output_code"].read_text()
        assert "def call(" in output and "async_compile.cpp_pybinding" in output
        assert all(p.parent == result.out_dir for p in files.values() if p is not None)
    assert list(result.out_dir.glob("full_code_for_step_*.py"))


def test_index_lists_fused_kernels(inspected):
    _, result, _, _ = inspected
    generated = [k for k in result.kernels if k.kind == "cpp"]
    assert generated and all(k.name.startswith("cpp_") and k.calls >= 1 for k in generated)
    assert any(len(k.ops) >= 2 and all(op.startswith(("aten.", "v4.")) for op in k.ops) for k in generated)
    assert any(k.kind == "extern" and k.name == "extern_kernels.mm" for k in result.kernels)
    for graph in result.graphs:  # every launch of a generated kernel is counted, once per run of its function
        output = graph.files["output_code"].read_text()
        functions = dict(re.findall(r"^def (\w+subgraph\w*)\(args\):\n(.*?)(?=^\S)", output, re.M | re.S))
        wrapper = output.split("def call(", 1)[1]
        runs = {name: len(re.findall(rf"= {name}\(", wrapper)) for name in functions}
        for k in graph.kernels:
            if k.kind == "cpp":
                launches = lambda code: len(re.findall(rf"^\s+{k.name}\(", code, re.M))
                expected = launches(wrapper) + sum(launches(body) * runs[name] for name, body in functions.items())
                assert k.calls == expected, k.name


def test_cpp_launches_name_their_source_nodes(inspected, tiny_regional):
    """On the CPU every C++ kernel launch has Inductor's origin comment above it (fuse's backend
    has it written), so the index names the captured-graph nodes of the kernels."""
    for result in (inspected[1], tiny_regional[1].inspection):
        for graph in result.graphs:
            lines = graph.files["output_code"].read_text().splitlines()
            launches = [i for i, line in enumerate(lines) if re.match(r"\s+cpp_fused_\w+\(", line)]
            assert launches and all("Source Nodes: [" in lines[i - 1] for i in launches), graph.name
        generated = [k for k in result.kernels if k.kind == "cpp"]
        assert all(k.source_nodes for k in generated)
        # outside nested regions' functions the nodes are the kernel's own, and its ops those it fused
        own = [k for k in generated if "invoke_subgraph" not in k.source_nodes]
        assert own and all(k.ops and all(op.startswith("aten.") for op in k.ops) for k in own)


def expand(module: str) -> set[str]:
    """`layers.[0-1,3].attn` -> {layers.0.attn, layers.1.attn, layers.3.attn}."""
    match = re.fullmatch(r"layers\.\[([\d,-]+)\](.*)", module)
    if not match:
        return {module}
    indices = set()
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        indices |= set(range(int(low), int(high or low) + 1))
    return {f"layers.{i}{match.group(2)}" for i in indices}


def test_index_names_the_model_modules_of_every_kernel(inspected, tiny_regional):
    """Each kernel names the decoder modules it computes for: a kernel of a function several
    layers share names all the layers of that kind, and each custom op the module that calls it,
    in every layer that does."""
    decoder, nested, _, _ = inspected
    regional = tiny_regional[1].inspection
    cfg = decoder.config
    kinds = layer_kinds(cfg)
    top_level = {"embed", "norm", "head", "(model)"}
    for result in (nested, regional):
        for graph in result.graphs:
            for k in graph.kernels:
                assert k.modules, (graph.name, k.name)
                paths = set().union(*map(expand, k.modules))
                assert all(p in top_level or re.match(r"layers\.\d+(\.|$)", p) for p in paths), (k.name, k.modules)
                layers = {int(p.split(".")[1]) for p in paths if p.startswith("layers.")}
                # a kernel runs for every layer of the kinds it runs for
                assert layers == {i for i in range(cfg.n_layers) if kinds[i] in {kinds[j] for j in layers}}, (k.name, k.modules)
                if graph.layers is not None:  # regional: the layers that run the graph
                    assert layers <= set(graph.layers)
        for bucket in result.buckets:
            named: dict[str, set[str]] = {}
            for graph in result.graphs_of(bucket):
                for k in graph.kernels:
                    if k.kind == "custom op":
                        named.setdefault(k.name, set()).update(*map(expand, k.modules))
            assert named == {
                "v4.sparse_mla_decode": {f"layers.{i}.attn" for i in range(cfg.n_layers)},
                "v4.moe_experts": {f"layers.{i}.ffn.experts" for i in range(cfg.n_layers)},
                "v4.indexer_topk": {f"layers.{i}.attn.indexer" for i in range(cfg.n_layers) if cfg.layer_ratios[i] == 4},
                "v4.grouped_linear": {f"layers.{i}.attn.wo_a" for i in range(cfg.n_layers)},
            }
    assert any("compressor" in m for k in nested.kernels for m in k.modules)
    rows = re.findall(r"^\| `cpp_fused\w+` \| cpp \| \d+ \| (layers\.[^|]*) \|", nested.index_md.read_text(), re.M)
    assert rows and any("layers.[" in row for row in rows)  # shared functions, written once for their layers


def test_launches_follow_arguments_through_region_calls(inspected):
    """output_code.launches: one launch per path of calls, so they add up to each kernel's calls;
    a launch in a region's function reads the graph inputs its call passes."""
    _, result, _, _ = inspected
    for graph in result.graphs:
        found = launches(graph.files["output_code"].read_text())
        assert Counter(l.kernel for l in found) == {k.name: k.calls for k in graph.kernels}
        assert any(l.region_inputs for l in found) and any(l.region_inputs is None for l in found)
    code = NESTED_OUTPUT_CODE
    assert [(l.kernel, l.inputs, l.region_inputs) for l in launches(code) if l.kernel == "v4.moe_experts"] == [
        ("v4.moe_experts", (0, 1), (0, 1)), ("v4.moe_experts", (1,), (1,)), ("v4.moe_experts", (1,), (1,)),
    ]  # the later calls pass buffers for arg0_1, which are not followed
    assert wrapper_arity(code) == 2 and wrapper_arity("def f(x):\n    return x\n") is None


def test_module_lists_name_each_layer_path_once():
    layers = tuple(f"layers.{i}" for i in range(6))
    assert module_list(["layers.0.attn", "layers.1.attn", "embed", "", "layers.3.ffn", "layers.5.ffn"], layers) == (
        "layers.[0-1].attn", "embed", "(model)", "layers.[3,5].ffn",
    )
    assert module_list(["layers.0", "layers.1", "layers.2", "layers.4"], layers) == ("layers.[0-2,4]",)
    assert module_list(["layers.3.attn.compressor"], layers) == ("layers.3.attn.compressor",)
    assert module_list(["layers.3.attn"], layers, run_by=(3, 5)) == ("layers.[3,5].attn",)


def test_nested_compilation_is_one_graph_per_shape_with_shared_layer_functions(inspected):
    """Nested compilation: the step is one graph for batch 1 and one for the symbolic batch the
    other buckets share; in each, a layer kind several layers share is one function its wrapper
    calls once per such layer, and the custom ops each layer calls are counted per step through
    those calls."""
    decoder, result, _, _ = inspected
    assert sorted(g.buckets for g in result.graphs) == [(1,), (2, 4)]
    kinds = Counter(layer_kinds(decoder.config).values())
    for graph in result.graphs:
        assert graph.layers is None and graph.runs_per_step == 1
        output = graph.files["output_code"].read_text()
        functions = re.findall(r"^def (\w+subgraph\w*)\(args\):", output, re.M)
        calls = {name: len(re.findall(rf"= {name}\(", output)) for name in functions}
        # Each kind several layers share is one function called once per such layer; a kind only
        # one layer has is inlined (torch 2.13) or a function called once (torch 2.11).
        assert sorted(n for n in calls.values() if n > 1) == sorted(n for n in kinds.values() if n > 1)
        assert len(functions) <= len(kinds) and all(n >= 1 for n in calls.values())
    ratios = Counter(decoder.config.layer_ratios)
    n_layers = decoder.config.n_layers
    per_step = {
        "v4.indexer_topk": ratios[4], "v4.moe_experts": n_layers, "v4.sparse_mla_decode": n_layers,
        "v4.grouped_linear": n_layers,
    }
    assert result.custom_op_calls == {1: per_step, 2: per_step, 4: per_step}


def test_regional_graphs_per_layer_kind_and_the_compiled_head(tiny_regional, inspected):
    """Regional compilation: one graph per distinct layer kind, every layer runs one of them, each
    calls its layer's custom ops once; the head is one more graph, run once per step, whose
    wrapper computes the LM head."""
    _, nested, _, _ = inspected
    _, runner, _, _ = tiny_regional
    decoder, result = runner.decoder, runner.inspection
    kinds = layer_kinds(decoder.config)
    (head,) = [g for g in result.graphs if g.layers is None]
    assert head.runs_per_step == 1 and "extern_kernels.mm" in [k.name for k in head.kernels]  # the LM head
    assert f"## `{head.name}`: the head (1 run(s) per step), buckets 1, 2, 4" in result.index_md.read_text()
    blocks = [g for g in result.graphs if g.layers is not None]
    assert len(blocks) == len(set(kinds.values()))
    assert sorted(i for g in blocks for i in g.layers) == list(range(decoder.config.n_layers))
    for graph in blocks:
        transformed = graph.files["transformed_code"].read_text()
        # batch_one_shared wraps the forward to bound the batch: the frame keeps the forward's name
        assert re.search(r"def __transformed_code_\d+_for_forward\((self, streams, step, hadamard|\*args)\)", transformed)
        (kind,) = {kinds[i] for i in graph.layers}
        ratio = kind[0]
        # Per run of the graph (one block): attention, its grouped output projection and the
        # experts once, the indexer on ratio-4 layers.
        calls = graph.calls("custom op")
        assert calls == {
            "v4.sparse_mla_decode": 1,
            "v4.grouped_linear": 1,
            "v4.moe_experts": 1,
            **({"v4.indexer_topk": 1} if ratio == 4 else {}),
        }, (graph.name, graph.layers)
        assert graph.runs_per_step == len(graph.layers)
    assert result.custom_op_calls == nested.custom_op_calls
    assert json.loads(result.index_json.read_text())["compilation"] == "regional"


def test_real_slots_and_global_state_are_untouched(inspected):
    _, _, (caches0, hooks0, entries0), (caches1, hooks1, entries1) = inspected
    assert any(v.abs().sum() > 0 for v in caches0.values())
    for name, value in caches0.items():
        assert torch.equal(caches1[name], value), name
    assert hooks1["exec_with_source"] is hooks0["exec_with_source"]
    assert hooks1["load_by_key_path"] is hooks0["load_by_key_path"]
    assert hooks1["lazy_format_graph_code"] is hooks0["lazy_format_graph_code"]
    assert hooks1["bytecode_hooks"] == hooks0["bytecode_hooks"]
    assert entries1 == entries0  # the model's own Block.forward gained no compiled entries


def test_index_json_and_markdown_agree(inspected):
    _, result, _, _ = inspected
    index = json.loads(result.index_json.read_text())
    assert index["compilation"] == "nested" and index["buckets"] == [1, 2, 4]
    assert index["custom_op_calls_per_step"] == {str(b): calls for b, calls in result.custom_op_calls.items()}
    assert [g["name"] for g in index["graphs"]] == [g.name for g in result.graphs]
    assert [k["name"] for g in index["graphs"] for k in g["kernels"]] == [k.name for k in result.kernels]
    for g in index["graphs"]:
        for role, name in g["files"].items():
            if name is None:
                assert role in ("aot_forward_graph", "post_grad_graph"), role  # stages a compile-cache hit skips
            else:
                assert (result.out_dir / name).is_file(), role

    markdown = result.index_md.read_text()
    per_step = re.findall(r"^\| (\d+) \| `([\w.]+)` \| (\d+) \|$", markdown, re.M)
    assert {(b, op): int(n) for b, op, n in per_step} == {
        (b, op): n for b, calls in index["custom_op_calls_per_step"].items() for op, n in calls.items()
    }
    sections = re.split(r"^## `(__compiled_fn_\d+)`.*$", markdown, flags=re.M)[1:]
    md_graphs = dict(zip(sections[::2], sections[1::2]))
    assert list(md_graphs) == [g["name"] for g in index["graphs"]]
    for g in index["graphs"]:
        rows = re.findall(r"^\| `([^`]+)` \| ([\w ]+) \| (\d+) \| ([^|]*) \| ([^|]*) \| ([^|]*) \|$", md_graphs[g["name"]], re.M)
        split = lambda cell: [x for x in cell.strip().split(", ") if x]
        assert [(name, kind, int(calls), split(modules), split(ops), split(nodes)) for name, kind, calls, modules, ops, nodes in rows] == [
            (k["name"], k["kind"], k["calls"], k["modules"], k["ops"], k["source_nodes"]) for k in g["kernels"]
        ]
        for name in g["files"].values():
            assert name is None or f"[`{name}`]({name})" in md_graphs[g["name"]]


def test_index_says_what_each_file_of_the_dump_is(inspected, tiny_regional):
    """index.md's first section describes every kind of file in the folder (DUMP_FILES, which the
    module docstring points at); every file the dump holds is of one of those kinds."""
    kinds = []
    for name, _ in DUMP_FILES:
        for pattern in name.split(", "):
            parts = re.split(r"(<[^>]+>|(?<=_)[NK](?=[._]))", pattern)
            kinds.append(re.compile("".join(".+" if p.startswith("<") else r"\d+" if p in "NK" and p else re.escape(p) for p in parts)))
    for result in (inspected[1], tiny_regional[1].inspection):
        section = result.index_md.read_text().split("## The files in this folder")[1].split("\n## ")[0]
        assert all(f"| `{name}` | {what} |" in section for name, what in DUMP_FILES)
        files = [p.name for p in result.out_dir.iterdir()]
        assert files and all(any(k.fullmatch(f) for k in kinds) for f in files), [f for f in files if not any(k.fullmatch(f) for k in kinds)]


def test_inspect_refuses_bad_arguments(tmp_path, inspected):
    decoder = inspected[0]
    with pytest.raises(ValueError, match="expected a decode model such as model.Decoder, got object"):
        fuse.inspect(object(), tmp_path / "a")
    with pytest.raises(ValueError, match="batch must be"):
        fuse.inspect(decoder, tmp_path / "b", batch=0)
    with pytest.raises(ValueError, match="batch must be"):
        fuse.inspect(decoder, tmp_path / "c", batch=decoder.max_batch + 1)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        fuse.inspect(decoder, tmp_path / "d")
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_an_earlier_dump_is_replaced(tmp_path):
    from fuse.inspection import _prepare_out_dir

    for name in ("__compiled_fn_3.kernel_0.py", "__transformed_code_0_for_forward.py", "full_code_for_forward_0.py", "index.json"):
        (tmp_path / name).write_text("old")
    assert _prepare_out_dir(tmp_path) == tmp_path.resolve()
    assert not list(tmp_path.iterdir())


def test_loader_shim_passes_keywords_under_depyf(tmp_path):
    """depyf 0.20's replacement loader rejects the keyword torch 2.13's PyCodeCache.load passes."""
    from torch._inductor.codecache import PyCodeCache

    from fuse.inspection import _depyf_dump

    before = PyCodeCache.__dict__["load_by_key_path"]
    with _depyf_dump(tmp_path):
        module = PyCodeCache.load(f"answer = {6 * 7}\n")
    assert module.answer == 42
    assert PyCodeCache.__dict__["load_by_key_path"] is before


def test_kernel_names_split_into_ops():
    known = known_ops()
    name = "cpp_fused___lshift_____rshift____to_copy_abs_add_bitwise_and_floor_divide_moe_experts_where_12"
    assert ops_from_kernel_name(name, known) == (
        "aten.__lshift__", "aten.__rshift__", "aten._to_copy", "aten.abs", "aten.add",
        "aten.bitwise_and", "aten.floor_divide", "aten.where",
    )  # a custom op in a kernel's name is an input it reads, never an op it runs
    assert ops_from_kernel_name("triton_poi_fused_mul_sigmoid_0", known) == ("aten.mul", "aten.sigmoid")
    assert ops_from_kernel_name("cpp_fused_frobnicate_add_3", known) == ("frobnicate", "aten.add")
    assert ops_from_kernel_name("triton_poi_0", known) == ()


# A short piece of CUDA output code in the shape Inductor writes it: kernels with origin comments
# above their definitions, then the wrapper with a comment above each launch.
TRITON_OUTPUT_CODE = '''
from torch._inductor.select_algorithm import extern_kernels
aten = torch.ops.aten
async_compile = AsyncCompile()


# kernel path: /tmp/torchinductor/ab/cab.py
# Topologically Sorted Source Nodes: [square, mean, add_1, rsqrt, mul_2], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add_1 => add_1
# Graph fragment:
#   %pow_1 : Tensor "f32[1, 128]" = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%arg0_1, 2))
triton_per_fused_add_mean_mul_pow_rsqrt_0 = async_compile.triton('triton_per_fused_add_mean_mul_pow_rsqrt_0', \'\'\'
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers, triton_heuristics

@triton_heuristics.persistent_reduction(size_hints={'x': 1, 'r0_': 128}, filename=__file__)
@triton.jit
def triton_per_fused_add_mean_mul_pow_rsqrt_0(in_out_ptr0, in_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    r0_1 = tl.arange(0, 128)[None, :]
    tmp0 = tl.load(in_ptr0 + r0_1)
    tmp3 = tl.sum(tmp0 * tmp0, 1)[:, None]
    tl.store(in_out_ptr0 + r0_1, tmp0 * libdevice.rsqrt(tmp3 / 128.0 + 1e-06))
\'\'\', device_str='cuda')


# kernel path: /tmp/torchinductor/cd/ccd.py
# Topologically Sorted Source Nodes: [sigmoid, mul_5], Original ATen: [aten.sigmoid, aten.mul]
triton_poi_fused_mul_sigmoid_1 = async_compile.triton('triton_poi_fused_mul_sigmoid_1', \'\'\'
@triton_heuristics.pointwise(size_hints={'x': 512}, filename=__file__)
@triton.jit
def triton_poi_fused_mul_sigmoid_1(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    x0 = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    tmp0 = tl.load(in_out_ptr0 + x0, x0 < xnumel)
    tl.store(in_out_ptr0 + x0, tmp0 * tl.sigmoid(tmp0), x0 < xnumel)
\'\'\', device_str='cuda')


# kernel path: /tmp/torchinductor/ef/cef.py
# Topologically Sorted Source Nodes: [scores, top], Original ATen: [aten.amax, aten.sub, aten.exp, aten.sum]
triton_red_fused_amax_exp_sub_sum_2 = async_compile.triton('triton_red_fused_amax_exp_sub_sum_2', \'\'\'
@triton_heuristics.reduction(size_hints={'x': 8, 'r0_': 4096}, filename=__file__)
@triton.jit
def triton_red_fused_amax_exp_sub_sum_2(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    pass
\'\'\', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((1, 128), (128, 1), torch.float32)
            # Topologically Sorted Source Nodes: [square, mean, add_1, rsqrt, mul_2], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
            stream0 = get_raw_stream(0)
            triton_per_fused_add_mean_mul_pow_rsqrt_0.run(buf0, arg0_1, 1, 128, stream=stream0)
            buf1 = empty_strided_cuda((1, 512), (512, 1), torch.float32)
            # Topologically Sorted Source Nodes: [linear], Original ATen: [aten.t, aten.mm]
            extern_kernels.mm(buf0, reinterpret_tensor(arg1_1, (128, 512), (1, 128), 0), out=buf1)
            # Topologically Sorted Source Nodes: [sigmoid, mul_5], Original ATen: [aten.sigmoid, aten.mul]
            triton_poi_fused_mul_sigmoid_1.run(buf1, 512, stream=stream0)
            # Topologically Sorted Source Nodes: [routed], Original ATen: [v4.moe_experts]
            buf2 = torch.ops.v4.moe_experts.default(buf1, arg2_1, 10.0)
            assert_size_stride(buf2, (1, 128), (128, 1), 'torch.ops.v4.moe_experts.default')
            # buffer buf2 (op: torch.ops.v4.moe_experts.default) is assumed to be not aligned
            buf3 = torch.ops.v4.moe_experts.default(buf2, arg2_1, 10.0)
            triton_poi_fused_mul_sigmoid_1.run(buf3, 512, stream=stream0)
            buf4 = empty_strided_cuda((8, ), (1, ), torch.float32)
            triton_red_fused_amax_exp_sub_sum_2.run(buf3, buf4, 8, 4096, stream=stream0)
            buf5 = torch.ops.aten.index_put_.default(buf4, [arg0_1], buf4)
            # Topologically Sorted Source Nodes: [view_3], Original ATen: [aten.view]
            buf6 = reinterpret_tensor(buf4, (2, 4), (4, 1), 0)  # alias
            buf7 = torch.ops.v4.indexer_topk.default(buf6, arg0_1, 8)
        return (buf4, buf7)
'''


def test_triton_output_code_is_parsed():
    kernels = {k.name: k for k in parse_output_code(TRITON_OUTPUT_CODE)}
    assert list(kernels) == [
        "triton_per_fused_add_mean_mul_pow_rsqrt_0",
        "triton_poi_fused_mul_sigmoid_1",
        "triton_red_fused_amax_exp_sub_sum_2",
        "extern_kernels.mm",
        "v4.moe_experts",
        "aten.index_put_",
        "v4.indexer_topk",
    ]
    norm = kernels["triton_per_fused_add_mean_mul_pow_rsqrt_0"]
    assert (norm.kind, norm.calls) == ("persistent reduction", 1)
    assert norm.source_nodes == ("square", "mean", "add_1", "rsqrt", "mul_2")
    assert norm.ops == ("aten.pow", "aten.mean", "aten.add", "aten.rsqrt", "aten.mul")
    assert (kernels["triton_poi_fused_mul_sigmoid_1"].kind, kernels["triton_poi_fused_mul_sigmoid_1"].calls) == ("pointwise", 2)
    red = kernels["triton_red_fused_amax_exp_sub_sum_2"]
    assert (red.kind, red.calls, red.source_nodes) == ("reduction", 1, ("scores", "top"))
    mm = kernels["extern_kernels.mm"]
    assert (mm.kind, mm.calls, mm.ops, mm.source_nodes) == ("extern", 1, ("aten.t", "aten.mm"), ("linear",))
    experts = kernels["v4.moe_experts"]  # the string and comment mentions are not calls
    assert (experts.kind, experts.calls, experts.source_nodes) == ("custom op", 2, ("routed",))
    assert (kernels["aten.index_put_"].kind, kernels["aten.index_put_"].calls) == ("extern", 1)
    topk = kernels["v4.indexer_topk"]  # the comment above the alias line is not about this call
    assert (topk.kind, topk.calls, topk.ops, topk.source_nodes) == ("custom op", 1, (), ())


NESTED_OUTPUT_CODE = '''
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', \'\'\'
def triton_poi_fused_add_0(in_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
\'\'\', device_str='cuda')
triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', \'\'\'
def triton_poi_fused_mul_1(in_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
\'\'\', device_str='cuda')

def subgraph_0(args):
    arg0_1, arg1_1 = args
    triton_poi_fused_add_0.run(arg0_1, 64, stream=stream0)
    buf0 = torch.ops.v4.moe_experts.default(arg0_1, arg1_1, 10.0)
    return (buf0,)

class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        triton_poi_fused_mul_1.run(arg0_1, 64, stream=stream0)
        buf0 = subgraph_0([arg0_1, arg1_1])
        buf1 = subgraph_0([buf0[0], arg1_1])
        buf2 = subgraph_0([buf1[0], arg1_1])
        triton_poi_fused_add_0.run(buf2[0], 64, stream=stream0)
        return (buf2[0],)

runner = Runner(partitions=[])
call = runner.call

def benchmark_compiled_module(times=10, repeat=10):
    fn = lambda: call([arg0_1, arg1_1])
    triton_poi_fused_mul_1.run(arg0_1, 64, stream=stream0)
'''


def test_launches_in_a_subgraph_function_count_once_per_call():
    """Nested compile regions: a shared layer kind is a function the wrapper calls once per layer;
    its launches count that many times, and code the wrapper never runs counts for nothing."""
    kernels = {k.name: k.calls for k in parse_output_code(NESTED_OUTPUT_CODE)}
    assert kernels == {"triton_poi_fused_add_0": 3 + 1, "triton_poi_fused_mul_1": 1, "v4.moe_experts": 3}


def test_triton_kind_falls_back_to_the_decorator_and_ops_to_the_name():
    body = "@triton_heuristics.template(num_stages=3)\n@triton.jit\ndef triton_(arg_A, arg_B): pass"
    assert triton_kernel_info("triton_", "", body) == ("template", (), ())
    kind, ops, nodes = triton_kernel_info("triton_tem_fused_addmm_relu_4", "# kernel path: x.py", body)
    assert (kind, ops, nodes) == ("template", ("aten.addmm", "aten.relu"), ())
    older = "# Source Nodes: [gelu], Original ATen: [aten.gelu]"  # without "Topologically Sorted"
    assert triton_kernel_info("triton_poi_fused_gelu_0", older, "") == ("pointwise", ("aten.gelu",), ("gelu",))


@pytest.mark.gpu
def test_inspect_on_cuda_indexes_triton_kernels(tmp_path):
    cfg = ModelConfig.preset("tiny").replace(qat=False)
    decoder = Decoder(cfg, max_batch=2, max_seq_len=32, dtype=torch.float32, device="cuda").init_random(0)
    result = fuse.inspect(decoder, tmp_path / "dump")
    triton = [k for k in result.kernels if k.kind in ("pointwise", "reduction", "persistent reduction")]
    assert triton and all(k.name.startswith("triton_") and k.calls >= 1 for k in triton)
    assert any(len(k.ops) >= 2 and k.source_nodes for k in triton)
    ratios = Counter(cfg.layer_ratios)
    calls = result.custom_op_calls[1]
    # On CUDA an mHC boundary is one op where its kernels tile the width (hc_pre_norm first, then
    # hc_post_pre_norm before the experts); elsewhere its Sinkhorn is one (before attention and
    # before the experts).
    if tiles(cfg.dim):
        boundaries = {"v4.hc_pre_norm": cfg.n_layers, "v4.hc_post_pre_norm": cfg.n_layers}
    else:
        boundaries = {"v4.hc_split_sinkhorn": 2 * cfg.n_layers}
    assert calls == {
        **boundaries,
        "v4.grouped_linear": cfg.n_layers,  # the grouped output projection (wo_a), opaque on every device
        "v4.indexer_topk": ratios[4],
        "v4.moe_experts": cfg.n_layers,
        "v4.sparse_mla_decode": cfg.n_layers,
    }
    for graph in result.graphs:
        assert "async_compile.triton(" in graph.files["output_code"].read_text()
    print("\n" + "\n".join(f"{k.graph} {k.kind:20} {k.calls} {k.name}" for k in result.kernels[:40]))


CPP_OUTPUT_CODE = '''
cpp_fused_add_mul_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}
\'\'\')
cpp_fused_index_mean_sparse_mla_decode_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}
\'\'\')

def subgraph_0(args):
    arg0_1, arg1_1 = args
    # Unsorted Source Nodes: [invoke_subgraph, streams], Original ATen: [aten.repeat, aten.index, aten.mean, v4.sparse_mla_decode]
    cpp_fused_index_mean_sparse_mla_decode_1(arg0_1, arg1_1)
    return (arg1_1,)

class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        # Topologically Sorted Source Nodes: [mul_3, add_7], Original ATen: [aten.mul, aten.add]
        cpp_fused_add_mul_0(arg0_1, arg1_1)
        buf0 = subgraph_0([arg0_1, arg1_1])
        return (buf0[0],)
'''


def test_cpp_launches_take_their_origin_comments():
    """fuse's backend has Inductor write the origin comment above C++ launches too; inside a
    nested region's function the comment names the region's call, so the kernel keeps the ops
    of its name (a custom op in it is an input it reads)."""
    kernels = {k.name: k for k in parse_output_code(CPP_OUTPUT_CODE)}
    top = kernels["cpp_fused_add_mul_0"]
    assert (top.kind, top.calls, top.source_nodes, top.ops) == ("cpp", 1, ("mul_3", "add_7"), ("aten.mul", "aten.add"))
    inner = kernels["cpp_fused_index_mean_sparse_mla_decode_1"]
    assert (inner.calls, inner.source_nodes, inner.ops) == (1, ("invoke_subgraph", "streams"), ("aten.index", "aten.mean"))


def test_calls_inside_a_region_function_keep_their_own_op():
    """Inside a nested region's function Inductor's comment above a library call or custom op
    lists the ops of the region's whole call (the embedding of the step included): the call's own
    op stands for them."""
    source = CPP_OUTPUT_CODE.replace(
        "    return (arg1_1,)",
        "    # Unsorted Source Nodes: [invoke_subgraph, streams], Original ATen: [aten.repeat, aten.embedding, aten.mm]\n"
        "    extern_kernels.mm(arg0_1, arg1_1, out=arg1_1)\n"
        "    # Unsorted Source Nodes: [invoke_subgraph, streams], Original ATen: [aten.repeat, v4.moe_experts]\n"
        "    buf1 = torch.ops.v4.moe_experts.default(arg0_1, arg1_1)\n"
        "    return (buf1,)",
    )
    kernels = {k.name: k for k in parse_output_code(source)}
    assert kernels["extern_kernels.mm"].ops == ("aten.mm",) and kernels["v4.moe_experts"].ops == ("v4.moe_experts",)
    assert kernels["v4.moe_experts"].source_nodes == ("invoke_subgraph", "streams")


def test_in_place_writes_of_the_wrapper_are_launches():
    """A mutated graph input written back (`arg.copy_(buf)`) or a zeroed buffer is a kernel the
    wrapper launches, indexed as the ATen op the profiler names it by."""
    source = "def call(args):\n    buf0 = empty((4,))\n    arg3_1.copy_(buf0)\n    buf1.zero_()\n    return (buf0,)\n"
    assert [(k.name, k.kind, k.calls) for k in parse_output_code(source)] == [("aten.copy_", "extern", 1), ("aten.zero_", "extern", 1)]
