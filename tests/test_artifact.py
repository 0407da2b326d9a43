"""Artifacts (fuse/artifact.py): a start saves what it compiled; a start in a new process with
empty compile caches loads it and compiles nothing; a stale, corrupt or missing artifact never runs
silently."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import fuse
from decoders import TINY_SHAPE
from fuse import artifact as art
from fuse.step import layer_kinds
from model import Decoder, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETS = (4,)
LAYERS = 2  # one layer kind: an artifact's build compiles its frames (fuse/frames.py) without Inductor's cache

# One start in a new process (the decoder SPEC describes, seed 3): compile_decode with the
# artifact, then one step on fixed inputs; prints its counts and writes its logits.
START = textwrap.dedent("""
    import json, sys, time, torch, fuse
    from torch._inductor import async_compile
    from model import Decoder, ModelConfig
    spec = json.loads(sys.argv[4])
    # The compile threads Inductor has while it loads (or compiles) each kernel.
    threads = set()
    for name in ("triton", "cpp", "cpp_pybinding"):
        def counted(self, *args, _load=getattr(async_compile.AsyncCompile, name), **kwargs):
            threads.add(async_compile.get_compile_threads())
            return _load(self, *args, **kwargs)
        setattr(async_compile.AsyncCompile, name, counted)
    decoder = Decoder(ModelConfig.preset(spec["preset"], layers=spec.get("layers")), max_batch=spec["max_batch"],
                      max_seq_len=spec["max_seq_len"], dtype=getattr(torch, spec["dtype"]), device=spec["device"]).init_random(seed=3)
    start = time.perf_counter()
    runner = fuse.compile_decode(decoder, buckets=spec["buckets"], progress=False, artifact=sys.argv[1], artifact_mode=sys.argv[2])
    seconds = time.perf_counter() - start
    logits = runner(torch.tensor([5, 7, 11]), torch.tensor([0, 0, 0]), torch.tensor([0, 2, 3]))
    torch.save(logits.cpu(), sys.argv[3])
    s = runner.stats
    print(json.dumps({"seconds": seconds, "compiles": s.compiles, "inductor": s.inductor_compiles, "aot": s.aot_compiles,
                      "triton": s.triton_compiles, "phases": s.start_seconds, "action": runner.artifact.action,
                      "contents": runner.artifact.contents, "describe": runner.describe(), "threads": sorted(threads)}))
""")
TINY_CPU = {"preset": "tiny", "layers": LAYERS, "device": "cpu", "dtype": "float32", "buckets": list(BUCKETS), "max_batch": 4,
            "max_seq_len": 64}


def start_in_new_process(tmp_path, name: str, artifact: str, mode: str, spec: dict = TINY_CPU,
                         empty_caches: bool = True, compile_threads: int | None = None) -> tuple[dict, torch.Tensor]:
    """A start in a new process: with `empty_caches`, compile caches that are new, empty folders;
    else this session's (what it compiles serves the in-process starts of later tests). With
    `compile_threads`, Inductor's (TORCHINDUCTOR_COMPILE_THREADS)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    if compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    if empty_caches:
        caches = tmp_path / f"caches-{name}"
        env.update(TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    logits = tmp_path / f"logits-{name}.pt"
    done = subprocess.run([sys.executable, "-c", START, artifact, mode, str(logits), json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(logits)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An artifact built by a start in a new process, that start's counts and logits. It compiles
    into this session's caches: the later in-process starts (a rebuild among them) find them warm."""
    tmp_path = tmp_path_factory.mktemp("artifact")
    path = str(tmp_path / "tiny.zip")
    stats, logits = start_in_new_process(tmp_path, "build", path, "refuse", empty_caches=False)
    return path, stats, logits, tmp_path


def tiny_decoder(config: ModelConfig | None = None, **shape) -> Decoder:
    return Decoder(config or ModelConfig.preset("tiny", layers=LAYERS), **{**TINY_SHAPE, **shape}).init_random(seed=3)


def copy_with_manifest(source: str, target: str, change) -> str:
    """`source` rewritten to `target` with `change(manifest)` applied to its manifest."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == art.MANIFEST:
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            new.writestr(item, data)
    return target


def test_a_start_from_the_artifact_alone_compiles_nothing_and_computes_the_same(built):
    path, build, build_logits, tmp_path = built
    # The build compiled, or loaded from this session's caches what an earlier start compiled.
    assert build["action"] == "built" and build["compiles"] >= 1, build
    assert "artifact save" in build["phases"] and "artifact: built and saved to" in build["describe"]
    with zipfile.ZipFile(path) as archive:
        manifest = json.loads(archive.read(art.MANIFEST))
        frames = sorted(n.removeprefix(art.FRAMES) for n in archive.namelist() if n.startswith(art.FRAMES))
    assert set(art.MATCH_FIELDS) <= set(manifest["match"])
    assert manifest["match"]["model_preset"] == "tiny" and manifest["match"]["buckets"] == [4]
    assert manifest["match"]["compilation"] == "regional"  # "auto" with an artifact: the compilation whose frames it holds
    # Every frame the build compiled (each layer kind's block and the head, at the symbolic batch), one per graph.
    kinds = len(layer_kinds(tiny_decoder()))
    assert frames == sorted([f"block{k}/batch" for k in range(kinds)] + ["head/batch"]), frames
    assert manifest["contents"]["frames"] == build["compiles"] == kinds + 1
    assert manifest["contents"]["cpp_libraries"] >= 1  # the CPU kernels, so that the next start builds none

    # Other, empty caches: only the artifact. Inductor set to compile in a pool of processes, as on a many-core host.
    warm, logits = start_in_new_process(tmp_path, "load", path, "load", compile_threads=4)
    print(f"\nstart that builds the artifact {build['seconds']:.1f} s: {build['phases']}"
          f"\nstart from the artifact {warm['seconds']:.1f} s: {warm['phases']}")
    assert warm["action"] == "loaded", warm
    # Dynamo traces nothing (the frames are loaded), and Inductor, AOTAutograd and Triton compile nothing.
    assert (warm["compiles"], warm["inductor"], warm["aot"], warm["triton"]) == (0, 0, 0, 0), warm["describe"]
    assert warm["phases"]["artifact load"] > 0 and "artifact save" not in warm["phases"]
    assert "artifact: loaded" in warm["describe"]
    # Its kernels load in this process: no pool of compile processes starts beside it.
    assert warm["threads"] == [1], warm["threads"]
    assert torch.equal(logits, build_logits)


def test_loaded_frames_compute_what_eager_does_and_refuse_calls_their_guards_do_not_accept(built):
    """The artifact's frames loaded in this process: the head's frame at the symbolic batch gives
    the eager head's logits for any batch of its range and compiles nothing; a call its guards
    refuse (another dtype) raises naming the frame instead of running or recompiling; an
    unreadable frame is named."""
    from fuse.frames import Frames
    from fuse.step import decode_mode

    with zipfile.ZipFile(built[0]) as archive:
        saved = {n.removeprefix(art.FRAMES): archive.read(n) for n in archive.namelist() if n.startswith(art.FRAMES)}
    decoder = tiny_decoder()
    options = fuse.CompileOptions(buckets=BUCKETS, artifact="unused.zip")  # as the build's
    frames = Frames.for_options(decoder, options, saved)
    head = frames.head()
    generator = torch.Generator().manual_seed(11)
    with decode_mode():  # the runner's: grad mode is one of the saved guards
        for batch in (2, 3):
            streams = torch.randn(batch, decoder.config.hc_mult, decoder.config.dim, generator=generator)
            torch.testing.assert_close(head(streams), decoder.logits(streams), rtol=1e-5, atol=1e-5)
        assert frames.compiled == []
        with pytest.raises(RuntimeError, match="compiled frame head/batch does not accept this call.*dtype"):
            head(streams.double())
    with pytest.raises(ValueError, match="compiled frame head/batch could not be loaded"):
        Frames.for_options(decoder, options, {"head/batch": b"not a frame"})


def test_a_mismatched_artifact_is_refused_naming_every_difference(built):
    path = built[0]
    cases = [
        # another model: the preset's config no longer matches (named field by field)
        (tiny_decoder(ModelConfig.preset("tiny", layers=LAYERS).replace(qat=False)), {}, ["model_preset: 'tiny' in the artifact, None here",
                                                                           "model_config", "qat True -> False"]),
        (tiny_decoder(), {"skinny_product_columns": 0}, ["skinny_product_columns: 64 in the artifact, 0 here"]),
        (tiny_decoder(max_seq_len=96), {"buckets": (2, 4)}, ["max_seq_len: 64 in the artifact, 96 here",
                                                             "buckets: [4] in the artifact, [2, 4] here"]),
    ]
    for decoder, options, named in cases:
        options = {"buckets": BUCKETS, **options}
        with pytest.raises(ValueError, match="was built for another start") as error:
            fuse.compile_decode(decoder, progress=False, artifact=path, **options)
        assert isinstance(error.value, art.ArtifactMismatch)
        for text in named:
            assert text in str(error.value), str(error.value)


def test_a_stale_artifact_is_refused_or_rebuilt(built, tmp_path):
    """A faked torch version: refused by default; with "rebuild" a warning names it, the start
    compiles without it and overwrites it with one that matches."""
    stale = copy_with_manifest(built[0], str(tmp_path / "stale.zip"), lambda m: m["match"].update(torch="0.0.1"))
    decoder = tiny_decoder()
    with pytest.raises(ValueError, match=re.escape(f"torch: '0.0.1' in the artifact, '{torch.__version__}' here")):
        fuse.compile_decode(decoder, buckets=BUCKETS, progress=False, artifact=stale)
    with pytest.warns(UserWarning, match=r"torch: '0.0.1' in the artifact.*rebuilding it"):
        runner = fuse.compile_decode(decoder, buckets=BUCKETS, progress=False, artifact=stale, artifact_mode="rebuild")
    assert runner.artifact.action == "rebuilt" and "torch" in runner.artifact.reason
    assert "artifact: rebuilt (mismatch: " in runner.describe()
    with zipfile.ZipFile(stale) as archive:
        assert json.loads(archive.read(art.MANIFEST))["match"]["torch"] == torch.__version__
    archive, reason = art.open_artifact(stale, art.expected_manifest(decoder, runner.options, BUCKETS), "refuse")
    assert archive is not None and reason == ""  # the rebuilt one matches
    archive.close()


def test_a_missing_or_corrupt_artifact_is_a_clear_error(built, tmp_path):
    decoder = tiny_decoder()
    start = lambda path, mode="refuse": fuse.compile_decode(decoder, buckets=BUCKETS, progress=False, artifact=str(path), artifact_mode=mode)  # noqa: E731
    with pytest.raises(FileNotFoundError, match=r"no artifact at .*missing.zip \(artifact_mode='load' needs one"):
        start(tmp_path / "missing.zip", "load")
    (tmp_path / "garbage.zip").write_bytes(b"not a zip at all")
    data = open(built[0], "rb").read()
    (tmp_path / "truncated.zip").write_bytes(data[: len(data) // 2])
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as other:
        other.writestr("readme.txt", "an unrelated zip")
    for name in ("garbage.zip", "truncated.zip", "other.zip"):
        with pytest.raises(ValueError, match=rf"{name} is not a readable fuse artifact"):
            start(tmp_path / name)
    # A member whose bytes changed after it was written: its CRC fails when the start loads it.
    with zipfile.ZipFile(built[0]) as archive:
        info = archive.getinfo(art.TORCH_CACHE)
        offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.compress_size // 2
    flipped = bytearray(data)
    flipped[offset] ^= 0xFF
    (tmp_path / "flipped.zip").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"flipped.zip is not a readable fuse artifact"):
        start(tmp_path / "flipped.zip")
    os.makedirs(tmp_path / "folder.zip")
    with pytest.raises(ValueError, match="is a folder"):
        start(tmp_path / "folder.zip")


def test_precompile_refuses_a_mismatched_artifact(built, capsys):
    """`fuse precompile` on an artifact built with other options: exit status 1, the mismatch named."""
    from fuse.__main__ import main

    argv = f"precompile --preset tiny --layers {LAYERS} --device cpu --buckets 4 --max-seq-len 64 --skinny-product-columns 0 --artifact"
    assert main(argv.split() + [built[0]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fuse precompile: the artifact ") and "skinny_product_columns: 64 in the artifact, 0 here" in err, err


def test_artifact_options_are_checked():
    with pytest.raises(ValueError, match="artifact_mode must be one of"):
        fuse.CompileOptions(artifact="a.zip", artifact_mode="ignore")
    with pytest.raises(ValueError, match="with compile=False there is nothing"):
        fuse.CompileOptions(artifact="a.zip", compile=False)
    with pytest.raises(ValueError, match="artifact must be a file path"):
        fuse.CompileOptions(artifact=3)
    assert fuse.CompileOptions(artifact=__import__("pathlib").Path("x/a.zip")).artifact == os.path.join("x", "a.zip")


def test_an_artifact_of_a_split_decoder_is_refused(tmp_path):
    """An artifact's manifest does not name the part of the model a rank holds: a decoder split
    across ranks is refused before anything is compiled or written (no process group needed)."""
    from model.parallel import Parallel

    split = Decoder(ModelConfig.preset("tiny", layers=1), max_batch=2, max_seq_len=16, dtype=torch.float32,
                    parallel=Parallel(2, 1, group_name="unused: nothing runs"))
    with pytest.raises(ValueError, match=r"^compile_decode\(artifact=...\) runs in one process only: this decoder is split across 2 ranks$"):
        fuse.compile_decode(split, buckets=(1,), artifact=str(tmp_path / "a.zip"), progress=False)
    assert not list(tmp_path.iterdir())


# -- the Triton side (the custom ops' kernels on CUDA), without a GPU ------------------------------
def test_the_triton_cache_entries_a_start_opens_are_recorded_and_counted(tmp_path, monkeypatch):
    """Through Triton's cache-manager hook: lookups are recorded, writes (compiles) counted, and
    the hook is gone afterwards."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    before = knobs.cache.__dict__.get("manager_class")
    with art.watching_compile_caches(fresh_record=False) as watch:
        get_cache_manager("a" * 64).put(b"binary", "_custom_kernel.cubin")  # compiled now
        get_cache_manager("b" * 64).get_file("_other_kernel.json")  # a miss: no entry
        inductor = get_cache_manager("c" * 64)
        inductor.put(b"binary", "triton_poi_fused_add_0.cubin")  # Inductor's: shipped in its graphs
    assert knobs.cache.__dict__.get("manager_class") is before and "TRITON_CACHE_MANAGER" not in os.environ
    assert watch.triton_compiles() == 1
    entries = watch.triton_entries()  # the custom kernel's; not the miss's (empty), not Inductor's
    assert len(entries) == 1 and os.listdir(entries[0]) == ["_custom_kernel.cubin"], entries
    # Inductor's too for an artifact with frames: a frame's graph does not carry its kernels.
    assert sorted(os.listdir(e)[0] for e in watch.triton_entries(with_inductor_kernels=True)) == [
        "_custom_kernel.cubin", "triton_poi_fused_add_0.cubin"]


def test_triton_group_files_are_pointed_at_the_new_cache(tmp_path):
    group = {"child_paths": {"k.cubin": "/old/cache/KEY/k.cubin", "k.json": "/old/cache/KEY/k.json"}}
    moved = json.loads(art._relocated_group(json.dumps(group).encode(), str(tmp_path)))
    assert moved["child_paths"] == {"k.cubin": str(tmp_path / "KEY" / "k.cubin"), "k.json": str(tmp_path / "KEY" / "k.json")}


def test_loading_restores_triton_entries_and_libraries_into_this_process_caches(built, tmp_path, monkeypatch):
    """An artifact with a Triton entry (as a CUDA start's would hold): it lands in Triton's cache
    folder with its group file pointing there; files already there are kept."""
    triton_root, inductor_root = tmp_path / "triton", tmp_path / "inductor"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_root))
    path = str(tmp_path / "with-triton.zip")
    shutil.copy(built[0], path)
    group = {"child_paths": {"_k.json": "/elsewhere/KEY/_k.json", "_k.cubin": "/elsewhere/KEY/_k.cubin"}}
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("triton/KEY/_k.cubin", b"cubin")
        archive.writestr("triton/KEY/_k.json", b"{}")
        archive.writestr("triton/KEY/__grp___k.json", json.dumps(group))
    os.makedirs(inductor_root / "zz")
    (inductor_root / "zz" / "kept.so").write_bytes(b"mine")
    use = art.load_artifact(zipfile.ZipFile(path), path)
    assert use.action == "loaded"
    assert (triton_root / "KEY" / "_k.cubin").read_bytes() == b"cubin"
    children = json.loads((triton_root / "KEY" / "__grp___k.json").read_text())["child_paths"]
    assert children["_k.cubin"] == str(triton_root / "KEY" / "_k.cubin")
    libraries = [n for n in zipfile.ZipFile(path).namelist() if n.startswith("inductor/") and n.endswith(".so")]
    assert libraries and all((inductor_root / n.removeprefix("inductor/")).exists() for n in libraries)
    assert (inductor_root / "zz" / "kept.so").read_bytes() == b"mine"


def test_start_times_table_has_the_artifact_start():
    from fuse import start_times

    start = {"seconds": 9.0, "compiles": 1, "captured": 0, "phases": {"first calls": 8.0, "dynamo": 5.0},
             "inductor_compiles": 0, "aot_compiles": 0, "triton_compiles": 0}
    result = {"command": "python -m fuse bench --start-times", "buckets": [1], "layers": 2,
              "cold": {**start, "seconds": 90.0, "inductor_compiles": 1, "aot_compiles": 1}, "warm": start,
              "artifact": {**start, "phases": {"artifact load": 0.2, "first calls": 8.0}}}
    table = start_times.to_markdown(result)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| cold", "| warm", "| artifact"]
    assert "artifact load" in rows[0] and "| 1 / 1 / 0 |" in rows[1] and "| 0 / 0 / 0 |" in rows[3]
    old = {k: v for k, v in result.items() if k != "artifact"}  # results written before artifacts still render
    assert "| artifact |" not in start_times.to_markdown(old)
    # on a GPU: the machine, and stock reduce-overhead's cold start beside compile_decode's
    stock = {"seconds": 120.0, "compiles": 8, "captured": None, "phases": {"dynamo": 30.0}}
    on_gpu = {**result, "reduce-overhead cold": stock, "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-05"}
    table = start_times.to_markdown(on_gpu)
    assert "on NVIDIA H200, torch 2.11.0, triton 3.6.0" in table
    assert "| reduce-overhead cold | 120.0 | 8 | - / - / - | - |" in table
    stopped = start_times.to_markdown({**on_gpu, "reduce-overhead cold": {"timed_out_after": 240}})
    assert "| reduce-overhead cold | > 240 (stopped) | - |" in stopped
    # a compile-workers start whose workers failed: named under the table, with their warning
    failed = {**start, "compile_workers": [0, 4], "warnings": ["fuse: the compile worker of layers [0], buckets [1],\nfailed (exit status 1)"]}
    notes = start_times.to_markdown({**on_gpu, "cold, compile workers": failed}).split("\n\n")[-1].splitlines()
    assert notes == ["- cold, compile workers: 0 of 4 compile workers succeeded.",
                     "- cold, compile workers: fuse: the compile worker of layers [0], buckets [1], failed (exit status 1)"]
    # the slowest worker's phases, where they reported them
    reported = {**start, "compile_workers": [2, 2], "compile_worker_peak_bytes": 3 * 2**29, "compile_worker_seconds": [
        {"start-up": 5.0, "decoder": 1.0, "graphs": 20.0}, {"start-up": 4.0, "decoder": 1.0, "graphs": 30.0}]}
    notes = start_times.to_markdown({**on_gpu, "cold, compile workers": reported}).split("\n\n")[-1].splitlines()
    assert notes[-2:] == ["- cold, compile workers: the slowest compile worker, 35.0 s from its launch: start-up 4.0, decoder 1.0, graphs 30.0.",
                          "- cold, compile workers: the largest compile worker's allocator peak 1.50 GiB (its CUDA context besides)."]


# -- on a GPU: the custom ops' Triton kernels and autotune choices travel too -----------------------
def check_gpu_artifact_start(tmp_path, spec: dict, build_with_precompile: bool = False) -> None:
    path = str(tmp_path / "artifact.zip")
    if build_with_precompile:  # the command, in a new process with empty caches
        env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "caches-build" / "inductor"),
               "TRITON_CACHE_DIR": str(tmp_path / "caches-build" / "triton")}
        command = [sys.executable, "-m", "fuse", "precompile", "--preset", spec["preset"], "--device", "cuda",
                   "--dtype", spec["dtype"], "--buckets", ",".join(map(str, spec["buckets"])), "--max-batch", str(spec["max_batch"]),
                   "--max-seq-len", str(spec["max_seq_len"]), "--artifact", path]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stderr.count("ready in") == len(spec["buckets"])  # a progress line per bucket
        print(f"\n{done.stdout}")
        cold = None
    else:
        cold, cold_logits = start_in_new_process(tmp_path, "build", path, "refuse", spec)
        assert cold["action"] == "built"
    with zipfile.ZipFile(path) as archive:
        contents = json.loads(archive.read(art.MANIFEST))["contents"]
    assert contents["triton_entries"] >= 1, contents  # the custom ops' kernels (and launchers)
    warm, logits = start_in_new_process(tmp_path, "load", path, "load", spec, compile_threads=4)
    print(f"\n{spec['preset']}: cold {cold['seconds'] if cold else '-'} s, from the artifact {warm['seconds']:.1f} s"
          f"\n{warm['describe']}")
    assert warm["action"] == "loaded"
    assert (warm["inductor"], warm["aot"], warm["triton"]) == (0, 0, 0), warm["describe"]
    assert "kernel compiles ahead" not in warm["phases"]  # the first calls load the kernels from the artifact's
    assert warm["threads"] == [1], warm["threads"]  # and Inductor's in this process, without a pool of compile processes
    if cold is not None:
        torch.testing.assert_close(logits, cold_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_start_from_the_artifact_compiles_nothing(tmp_path):
    spec = {"preset": "tiny", "device": "cuda", "dtype": "float32", "buckets": [1, 4], "max_batch": 4, "max_seq_len": 64}
    check_gpu_artifact_start(tmp_path, spec)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_bench_preset_artifact_from_precompile(tmp_path):
    """`fuse precompile` at V4-Flash widths, 43 layers, every bucket; a start from its artifact."""
    spec = {"preset": "bench", "device": "cuda", "dtype": "bfloat16", "buckets": [1, 2, 4, 8, 16, 32, 64], "max_batch": 64,
            "max_seq_len": 2048}
    check_gpu_artifact_start(tmp_path, spec, build_with_precompile=True)


def test_some_starts_are_a_section_of_their_own_naming_them(tmp_path, monkeypatch):
    """`--starts cold` runs the cold start only, and writes its table beside the full run's, not over it."""
    import json
    import subprocess

    from fuse import start_times
    from fuse.__main__ import main

    launched = []
    start = {"seconds": 9.0, "compiles": 1, "captured": 0, "phases": {"first calls": 8.0},
             "inductor_compiles": 1, "aot_compiles": 1, "triton_compiles": 0}

    def child(command, env, limit):
        launched.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(start) + "\n", stderr="")

    monkeypatch.setattr(start_times, "run_start", child)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.md").write_text("<!-- results: fuse bench start-times bench -->\nthe full run\n<!-- /results -->\n")
    assert main("bench --device cpu --start-times --starts cold --results results.md".split()) == 0
    assert len(launched) == 1 and "--artifact" in launched[0]
    written = (tmp_path / "results.md").read_text()
    assert "the full run" in written and "<!-- results: fuse bench start-times bench (cold) -->" in written
    assert "`python -m fuse bench --start-times --preset bench --starts cold`" in written


def test_a_start_times_run_cut_short_keeps_the_starts_it_measured(tmp_path, monkeypatch):
    """The results section is written after each start: a later start that fails (or a run
    stopped at a time limit) leaves the rows measured before it."""
    import json
    import subprocess

    from fuse import start_times
    from fuse.__main__ import main

    start = {"seconds": 9.0, "compiles": 1, "captured": 0, "phases": {"first calls": 8.0},
             "inductor_compiles": 1, "aot_compiles": 1, "triton_compiles": 0}

    def child(command, env, limit):
        failed = "--artifact" not in command  # the warm start
        return subprocess.CompletedProcess(command, int(failed), stdout="" if failed else json.dumps(start) + "\n", stderr="boom")

    monkeypatch.setattr(start_times, "run_start", child)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="warm start failed"):
        main("bench --device cpu --start-times --starts cold,warm --results results.md".split())
    rows = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| cold"]


def test_a_start_leaves_nothing_running_for_the_next():
    """What a start's process left running in its session (here a process it started and did
    not wait for) is stopped once the start ends; a start past its time limit is stopped whole."""
    import time

    from fuse import start_times

    leaves = [sys.executable, "-c", "import os, subprocess; subprocess.Popen(['sleep', '60']); print(os.getpid())"]
    done = start_times.run_start(leaves, dict(os.environ), limit=30, settle_s=0.5)
    assert done.returncode == 0
    assert not start_times.session_running(int(done.stdout.split()[-1]))
    started = time.monotonic()
    assert start_times.run_start([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), limit=0.5) is None
    assert time.monotonic() - started < 20


def test_a_terminated_start_time_run_stops_the_start_it_waits_for(tmp_path):
    """SIGTERM to the process measuring start times (a time limit's) stops the start it waits for,
    though that start runs in a session of its own."""
    import signal
    import time

    from fuse import start_times

    started = tmp_path / "started"
    measuring = textwrap.dedent(f"""
        import os, sys
        from fuse import start_times
        start = [sys.executable, "-c", "import os, time; open({str(started)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
        with start_times.sigterm_exits():
            start_times.run_start(start, dict(os.environ), limit=120)
    """)
    process = subprocess.Popen([sys.executable, "-c", measuring], env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    session = int(started.read_text())
    assert start_times.session_running(session)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert not start_times.session_running(session)
