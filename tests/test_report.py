"""Launch accounting and the `fuse report` main job on the CPU."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from fuse.launches import CATEGORIES, classify_kernel, classify_op, count_launches
from fuse.report import ReportSettings, run_report


def chain(x, z, extra: int):
    y = torch.sin(x)
    for _ in range(extra):
        y = y * z  # one elementwise op each, tensor operands (no scalar wrapping)
    return torch.mm(y, z).sum(-1)


@pytest.mark.parametrize("extra", [1, 5])
def test_eager_count_moves_by_the_ops_added(extra):
    x, z = torch.randn(8, 8), torch.randn(8, 8)
    base = count_launches(chain, x, z, 0)
    more = count_launches(chain, x, z, extra)
    assert more.counts["elementwise"] - base.counts["elementwise"] == extra
    assert more.total - base.total == extra
    assert base.counts["gemm"] == 1 and base.counts["reduce"] >= 1


def test_compiled_count_sees_generated_kernels_and_fusion():
    x, z = torch.randn(8, 8), torch.randn(8, 8)
    compiled = torch.compile(chain, fullgraph=True, options={"cpp.enable_kernel_profile": True})
    few = count_launches(compiled, x, z, 1)
    many = count_launches(compiled, x, z, 6)
    assert few.counts["gemm"] == 1  # the mm stays an extern call
    assert any("cpp_fused" in name for name in many.kernels), many.kernels
    # six more multiplies fuse into the kernels that were already there
    assert many.counts["elementwise"] == few.counts["elementwise"]
    eager = count_launches(chain, x, z, 6)
    assert eager.glue > many.glue


def test_cpu_time_by_category_adds_up_to_the_kernels():
    x, z = torch.randn(8, 8), torch.randn(8, 8)
    report = count_launches(chain, x, z, 3)
    assert report.device == "cpu" and set(report.time_us) == set(CATEGORIES)
    assert sum(report.time_us.values()) == pytest.approx(sum(report.kernel_time_us.values()))
    assert report.time_us["gemm"] > 0 and 0 < report.glue_time_share() < 1


def test_kernel_names_are_classified():
    assert classify_kernel("triton_red_fused_add_mean_3") == "reduce"
    # a product rewritten as a reduction (skinny products) stays a product, with what it fused
    assert classify_kernel("triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_view_1") == "gemm"
    assert classify_kernel("triton_poi_fused__to_copy_add_bmm_mul_permute_unsqueeze_view_24") == "gemm"
    assert classify_kernel("triton_per_fused__softmax_1") == "reduce"
    assert classify_kernel("triton_poi_fused_add_mul_sin_0") == "elementwise"
    assert classify_kernel("triton_poi_fused_cat_index_put_2") == "copy"
    assert classify_kernel("graph_0_cpp_fused_clone_permute_view_6") == "elementwise"
    assert classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert classify_kernel("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert classify_kernel("void at::native::reduce_kernel<512, 1, ...>") == "reduce"
    assert classify_kernel("_sparse_mla_split_kernel", custom={"_sparse_mla_split_kernel"}) == "custom"
    assert classify_op("v4::moe_experts") == "custom" and classify_op("aten::index_put_") == "copy"
    # the decode-shaped projection kernel (v4::grouped_linear) is a matrix product, not an opaque custom op
    assert classify_kernel("_linear_kernel") == "gemm" and classify_op("v4::grouped_linear") == "gemm"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    settings = ReportSettings(preset="tiny", batch=4, steps=3, timing_steps=2, out_dir=str(folder))
    return folder, run_report(settings)


def test_report_checks_compiled_against_eager_and_counts_real_kernels(report):
    folder, result = report
    assert result["max_relative_error"] <= 1e-4
    # fp32: one step from the same state agrees to rounding; the padded eager step is the yardstick
    # (a different batch shape, other summation orders) and moves logits by rounding too.
    one = result["one_step"]
    assert one["compiled_vs_eager"] <= 1e-4 and 0 <= one["eager_padding_noise"] <= 1e-4
    # against the fp32 reference (fuse/numerics.py): the model is fp32, so its eager step is the
    # reference's arithmetic and the compiled step is the compiled fp32 one; the yardstick passes it
    fp32 = result["against_fp32"]
    assert fp32["dtype"] == "float32" and fp32["eager_worst_row"] == 0
    assert fp32["compiled"]["passed"] and fp32["compiled"]["error"] <= fp32["compiled"]["bound"] == 1e-4
    assert fp32["compiled_fp32"] == fp32["compiled"]
    assert "compiled float32: pass: worst row" in (folder / "report.md").read_text()
    eager, compiled = result["eager"], result["compiled"]
    assert eager["counts"]["custom"] == compiled["counts"]["custom"] > 0  # the opaque ops stay as they are
    assert compiled["glue"] * 10 <= eager["glue"]
    assert {"report.json", "report.md", "launches.png"} <= {p.name for p in folder.iterdir()}
    assert (folder / "launches.png").read_bytes()[:4] == b"\x89PNG"


def test_report_json_and_markdown_agree(report):
    folder, _ = report
    data = json.loads((folder / "report.json").read_text())
    table = {}
    for line in (folder / "report.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"[a-z]+", cells[0]) and cells[0] != "category":
            table[cells[0]] = (float(cells[1]), float(cells[2]))
    for category, count in data["eager"]["counts"].items():
        assert table[category] == (count, data["compiled"]["counts"][category])
    assert table["glue"] == (data["eager"]["glue"], data["compiled"]["glue"])
    assert table["total"] == (data["eager"]["total"], data["compiled"]["total"])


def test_time_by_category_agrees_with_the_json_and_adds_up(report):
    """The time table: each category's time per step as report.json has it, shares of the step
    that add up to the total, and glue the sum of its categories."""
    folder, _ = report
    data = json.loads((folder / "report.json").read_text())
    md = (folder / "report.md").read_text().split("## Time per decode step by category")[1].split("\n## ")[0]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
                                              if line.startswith("| ") and not line.startswith("| category"))}
    for column, side in ((0, "eager"), (2, "compiled")):
        times = data[side]["time_us"]
        total = sum(times.values())
        assert total > 0
        for category, us in times.items():
            assert abs(float(rows[category][column]) - us) < 0.06
            assert abs(float(rows[category][column + 1].rstrip("%")) - 100 * us / total) < 0.06
        assert abs(float(rows["total"][column]) - total) < 0.06 and rows["total"][column + 1] == "100.0%"
        glue = sum(float(rows[c][column]) for c in ("elementwise", "copy", "reduce"))
        assert abs(float(rows["glue"][column]) - glue) < 0.2
    assert abs(float(rows["glue"][3].rstrip("%")) - 100 * data["compiled"]["glue_time_share"]) < 0.06


def test_idle_between_counts_the_gaps_once_where_spans_overlap():
    """Gaps from the first start to the last end; nested and overlapping spans (kernels on two
    streams) cover their union once, whatever the order they come in."""
    from fuse.launches import idle_between

    spans = [(30, 31), (0, 10), (5, 12), (20, 25), (22, 23), (1, 2)]
    assert idle_between(spans) == (20 - 12) + (30 - 25)
    assert idle_between([(3, 8)]) == 0 and idle_between([]) == 0


def test_idle_before_splits_the_gaps_by_the_span_that_ends_each():
    """Against a count of unit time steps: every uncovered step between the first start and the
    last end belongs to the span that starts next; the parts sum to idle_between."""
    from fuse.launches import idle_before, idle_between

    rng = random.Random(7)
    for _ in range(50):
        starts = rng.sample(range(200), 12)  # distinct starts: "the span that starts next" is one
        spans = [(s, s + rng.randint(1, 15)) for s in starts]
        names = [rng.choice("abcd") for _ in spans]
        expected = {}
        for t in range(min(starts), max(end for _, end in spans)):
            if not any(s <= t < e for s, e in spans):
                name = min((s, n) for (s, _), n in zip(spans, names) if s > t)[1]
                expected[name] = expected.get(name, 0) + 1
        assert idle_before(spans, names) == expected
        assert sum(expected.values()) == idle_between(spans)


def test_overlapped_counts_the_time_spans_share():
    """Kernels on two streams: the time a span ran beside another, which category sums count twice."""
    from fuse.launches import overlapped

    assert overlapped([(0, 10), (4, 6), (5, 12), (20, 25)]) == (6 - 4) + (10 - 5)
    assert overlapped([(0, 10), (2, 3), (2, 3)]) == 1 + 1
    assert overlapped([(3, 8), (8, 9)]) == 0 and overlapped([]) == 0


def test_the_time_table_says_the_time_between_kernels(report):
    """Under the time table: the host time between the counted ops and kernels of a step (CPU),
    as report.json has it; eager dispatches op by op from Python, so its gaps are not empty."""
    folder, _ = report
    data = json.loads((folder / "report.json").read_text())
    md = (folder / "report.md").read_text().split("## Time per decode step by category")[1].split("\n## ")[0]
    line = next(line for line in md.splitlines() if line.startswith("Besides the kernels"))
    assert "host time between ops and kernels" in line
    for side in ("eager", "compiled"):
        idle = data[side]["idle_us"]
        assert idle >= 0 and f"{data[side]['label']} {idle:.1f} us" in line
    assert data["eager"]["idle_us"] > 0


def test_the_waits_table_lists_the_longest_waits_from_the_json(report):
    """report.md's waits table: the kernels with the most idle time before them, descending, as
    report.json has them; their idle times sum to the time between kernels."""
    folder, _ = report
    compiled = json.loads((folder / "report.json").read_text())["compiled"]
    waits = compiled["idle_before_us"]
    assert waits and abs(sum(waits.values()) - compiled["idle_us"]) < 1e-6 * max(1.0, compiled["idle_us"])
    md = (folder / "report.md").read_text().split("## Compiled step: the kernels the step waits for")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| `")]
    ranked = sorted(waits.items(), key=lambda kv: -kv[1])[:len(rows)]
    assert len(rows) == min(10, len(waits))
    for row, (name, us) in zip(rows, ranked):
        assert row[0] == f"`{name if len(name) <= 90 else name[:87] + '...'}`"
        assert abs(float(row[3]) - us) < 0.06


def test_per_kernel_counts_add_up_and_the_top_table_lists_the_slowest(report):
    folder, _ = report
    data = json.loads((folder / "report.json").read_text())
    compiled = data["compiled"]
    assert sum(compiled["kernels"].values()) == compiled["total"]
    assert set(compiled["kernel_time_us"]) == set(compiled["kernels"])
    md = (folder / "report.md").read_text().split("## Compiled step: the kernels that take the most time")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| `")]
    slowest = sorted(compiled["kernel_time_us"].items(), key=lambda kv: -kv[1])[: len(rows)]
    assert len(rows) == min(15, len(compiled["kernels"])) > 0
    for (name, us), row in zip(slowest, rows):
        assert row[0].strip("`").rstrip(".") in name
        assert float(row[2]) == compiled["kernels"][name] and abs(float(row[3]) - us) < 0.06


def test_every_profiled_kernel_is_in_the_inspection_index(report):
    """The dump is of the runner the report profiles: each kernel of the compiled step (and what
    the runner launches around it) has an entry in the index of that dump."""
    folder, result = report
    index = json.loads((folder / "inspect" / "index.json").read_text())
    listed = {(g["name"], k["name"]) for g in index["graphs"] if 4 in g["buckets"] for k in g["kernels"]}
    listed |= {("runner", k["name"]) for k in index["around_step"]}
    entries = result["index_entries"]
    assert set(entries) == set(result["compiled"]["kernels"])
    missing = [name for name, entry in entries.items() if entry is None]
    assert not missing, missing
    assert {(e["graph"], e["entry"]) for e in entries.values()} <= listed
    assert any(e["kind"] == "cpp" for e in entries.values()) and any(e["kind"] == "custom op" for e in entries.values())


def test_launches_chart_has_a_count_panel_and_a_time_panel(report):
    """launches.png: kernels by category on a log scale and the step's time by category, eager
    against compiled, every bar labelled; the PNG holds bars in both halves."""
    from matplotlib import image

    from fuse.launches import LaunchReport
    from fuse.report import launches_figure

    folder, result = report
    reports = [
        LaunchReport(label=r["label"], device=r["device"], calls=r["calls"], counts=r["counts"], time_us=r["time_us"], layers=r["layers"])
        for r in (result["eager"], result["compiled"])
    ]
    assert all(sum(r.time_us.values()) > 0 for r in reports)  # on the CPU too
    figure = launches_figure(*reports)
    counts, times = figure.axes
    assert counts.get_yscale() == "symlog" and "CPU time" in times.get_ylabel()
    for ax in (counts, times):
        assert len(ax.patches) == 2 * len(CATEGORIES)
        labels = [t.get_text() for t in ax.texts]
        assert len([t for t in labels if re.fullmatch(r"[\d.]+", t)]) == 2 * len(CATEGORIES)
    assert any("glue share" in t.get_text() for t in times.texts)
    pixels = image.imread(folder / "launches.png")
    height, width = pixels.shape[:2]
    assert width > 2 * height > 600
    colored = (pixels[..., :3].max(-1) - pixels[..., :3].min(-1)) > 0.3  # bar colours, not grey or white
    assert colored[:, : width // 2].sum() > 2000 and colored[:, width // 2 :].sum() > 2000


def test_report_writes_the_timeline_of_one_step_of_each(report):
    """trace-eager.json and trace-compiled.json: the profiler's Chrome traces of the counted steps,
    holding an event for every kernel counted (the CPU profiler names generated kernels `graph_<n>_...`)."""
    folder, result = report
    for label in ("eager", "compiled"):
        assert result["traces"][label] == f"trace-{label}.json"
        trace = json.loads((folder / f"trace-{label}.json").read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        names = {e.get("name") for e in events}
        counted = set(result[label]["kernels"])
        assert counted and counted <= names, sorted(counted - names)[:5]
    assert any("cpp_fused" in name for name in result["compiled"]["kernels"])


def test_the_slowest_kernels_are_in_the_index_with_file_ops_and_module(report):
    assert_top_kernels_indexed(*report)


@pytest.mark.gpu
def test_a_gpu_reports_slowest_kernels_are_in_its_index(tmp_path):
    folder = tmp_path / "report"
    result = run_report(ReportSettings(preset="tiny", device="cuda", batch=4, steps=2, timing_steps=2, out_dir=str(folder)))
    assert any(name.startswith("triton_") for name in result["compiled"]["kernel_time_us"])
    assert_top_kernels_indexed(folder, result)


def assert_top_kernels_indexed(folder, result) -> None:
    """Each kernel of report.md's top table has an index entry with the file it is in, the ops it
    computes (fused) and the model modules it came from; the runner's own copies say so."""
    index = json.loads((folder / "inspect" / "index.json").read_text())
    graphs = {g["name"]: g for g in index["graphs"]}
    top = sorted(result["compiled"]["kernel_time_us"].items(), key=lambda kv: -kv[1])[:15]
    assert top
    for name, _ in top:
        entry = result["index_entries"][name]
        if entry["graph"] == "runner":
            kernel = next(k for k in index["around_step"] if k["name"] == entry["entry"])
            assert kernel["modules"] == ["(runner)"]
        else:
            graph = graphs[entry["graph"]]
            assert (folder / "inspect" / graph["files"]["output_code"]).is_file()
            kernel = next(k for k in graph["kernels"] if k["name"] == entry["entry"])
            assert kernel["modules"] and all(re.fullmatch(r"[\w.\[\],-]+|\(model\)", m) for m in kernel["modules"]), kernel
        assert kernel["ops"], kernel
    md = (folder / "inspect" / "index.md").read_text()
    assert "| kernel | kind | calls | module | ops | source nodes |" in md and "## The files in this folder" in md


@pytest.mark.parametrize("layers", [0, 7])
def test_report_rejects_a_layer_count_the_preset_does_not_have(layers, tmp_path):
    settings = ReportSettings(layers=layers, out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"layers must be in \[1, 6\] for the tiny preset"):
        run_report(settings)
    assert not (tmp_path / "out").exists()  # nothing written for a rejected run


def test_report_on_the_first_layers_counts_fewer_kernels(report, tmp_path):
    _, full = report
    settings = ReportSettings(preset="tiny", batch=4, steps=1, timing_steps=1, out_dir=str(tmp_path), inspect=False, layers=2)
    result = run_report(settings)
    assert result["layers"] == 2 and result["compiled"]["layers"] == 2
    assert result["max_relative_error"] <= 1e-4
    # the first two layers (window only) run a subset of the full step's kernels
    assert 0 < result["compiled"]["total"] < full["compiled"]["total"]
    assert 0 < result["eager"]["total"] < full["eager"]["total"]
    assert "--layers 2" in (tmp_path / "report.md").read_text()
