"""Artifacts: what a start compiled, saved in one file that a later start (on this machine or
another with the same device and versions) loads instead of compiling.

An artifact is a zip file:

    manifest.json           what must match (MATCH_FIELDS) and what the artifact holds
    torch/cache-artifacts   torch.compiler.save_cache_artifacts(): Inductor's compiled graphs (their
                            Triton kernels bundled in), AOTAutograd's entries, Inductor's autotune results
    triton/<key>/<file>     the Triton cache entries the start opened outside Inductor: the custom
                            ops' kernels, their launchers and their autotune choices
    inductor/<dir>/<file>   Inductor's compiled C++ libraries (CPU kernels), keyed by their source
                            and compiler command line
    frames/<name>           the regional compile's frames, compiled ahead (fuse/frames.py): Dynamo's
                            bytecode and guards with the compiled graph, per layer kind and batch shape

A start from an artifact fills the process's compile caches from it and loads its frames: Dynamo
traces nothing, and what the frames' graphs and the custom ops launch loads from the caches.
(Without frames, from the nested or whole-step compilation, Dynamo traces the step again and every
Inductor and AOTAutograd compile is a cache hit.) A mismatch of any MATCH_FIELDS entry is named: "refuse" raises, "rebuild"
warns, compiles without the artifact and overwrites it."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib
import inspect
import json
import os
import pathlib
import platform
import warnings
import zipfile
import zlib
from typing import Iterator

import torch

from kernels.triton_util import triton_version

FORMAT = "fuse-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TORCH_CACHE = "torch/cache-artifacts"
# What a start from the artifact must share with the start that built it, in the order the
# manifest lists them and a mismatch names them.
MATCH_FIELDS = (
    "format_version", "fuse_source", "torch", "triton", "python", "cuda", "device", "capability", "cpu_threads",
    "model_preset", "model_config", "dtype", "max_batch", "max_seq_len",
    "buckets", "dynamic_batch", "batch_one_shared", "compilation", "skinny_product_columns", "mode", "inductor_options",
)
PRESETS = ("tiny", "bench", "flash")
# The manifest's "contents" keys (torch's cache artifact kinds, then fuse's), as describe() says them.
CONTENT_NAMES = {
    "inductor": "Inductor graphs", "aot_autograd": "AOTAutograd entries", "autotune": "Inductor autotune results",
    "pgo": "Dynamo profiles", "triton_entries": "Triton cache entries", "cpp_libraries": "C++ libraries",
    "frames": "compiled frames",
}
FRAMES = "frames/"


class ArtifactMismatch(ValueError):
    """The artifact was built for another version, device, model or options (`mismatches`
    holds (field, in the artifact, here) for each)."""

    def __init__(self, message: str, mismatches: list[tuple[str, object, object]]):
        super().__init__(message)
        self.mismatches = mismatches


@dataclasses.dataclass
class ArtifactUse:
    """What a start did with its artifact."""

    path: str
    action: str  # "loaded", "built" (there was none) or "rebuilt" (it did not match or was unreadable)
    reason: str = ""  # why it was rebuilt
    size_bytes: int = 0
    contents: dict[str, int] = dataclasses.field(default_factory=dict)  # entries per kind
    frames: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False)  # loaded: fuse/frames.py's, by name

    def describe(self) -> str:
        held = ", ".join(f"{n} {CONTENT_NAMES.get(kind, kind)}" for kind, n in self.contents.items())
        size = f"{self.size_bytes / 2**20:.1f} MiB"
        if self.action == "loaded":
            return f"artifact: loaded {self.path} ({size}: {held})"
        what = "built" if self.action == "built" else f"rebuilt ({self.reason})"
        return f"artifact: {what} and saved to {self.path} ({size}: {held})"


# -- what must match ------------------------------------------------------------------------------
def expected_manifest(decoder, options, buckets: tuple[int, ...]) -> dict[str, object]:
    """The MATCH_FIELDS of a start of `decoder` with `options` (CompileOptions) on this machine."""
    device = decoder.device
    config = getattr(decoder, "config", None)
    config_fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None
    dtype = getattr(decoder, "dtype", None) or next(iter(decoder.parameters())).dtype
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = "%d.%d" % torch.cuda.get_device_capability(device)
    else:
        name = device.type
        capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None
    manifest = {
        "format_version": FORMAT_VERSION,
        "fuse_source": fuse_source_hash(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "device": name,
        "capability": capability,
        # Inductor's CPU kernels are generated for the thread count, part of their cache key.
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "model_preset": _preset_name(config),
        "model_config": _digest(json.dumps(config_fields, sort_keys=True, default=str)) if config_fields else None,
        "dtype": str(dtype).removeprefix("torch."),
        "max_batch": decoder.max_batch,
        "max_seq_len": getattr(decoder, "max_seq_len", None),
        "buckets": list(buckets),
        "dynamic_batch": options.dynamic_batch,
        "batch_one_shared": options.batch_one_shared,
        "compilation": options.compilation,
        "skinny_product_columns": options.skinny_product_columns,
        "mode": options.mode,
        "inductor_options": {k: repr(v) for k, v in sorted((options.inductor_options or {}).items())},
    }
    return json.loads(json.dumps(manifest))  # as the manifest file will read back


def manifest_details(decoder) -> dict[str, object]:
    """What the manifest keeps beside MATCH_FIELDS to explain a mismatch: the model's config."""
    config = getattr(decoder, "config", None)
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None
    return {"model_config_fields": json.loads(json.dumps(fields, default=str))} if fields else {}


@functools.lru_cache(maxsize=None)
def fuse_source_hash() -> str:
    """A hash of the fuse, kernels and model packages' Python source: their version, as far as an
    artifact is concerned (any change to them is a new one)."""
    digest = hashlib.sha256()
    for package in ("fuse", "kernels", "model"):
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _preset_name(config) -> str | None:
    preset = getattr(type(config), "preset", None)
    if preset is None:
        return None
    for name in PRESETS:
        try:
            if preset(name, layers=config.n_layers) == config:
                return name
        except ValueError:  # fewer layers than this config has
            continue
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mismatches(found: dict, expected: dict) -> list[tuple[str, object, object]]:
    """(field, in the artifact, here) for every MATCH_FIELDS entry that differs."""
    missing = object()
    out = []
    for name in MATCH_FIELDS:
        value = found.get(name, missing)
        if value != expected.get(name):
            out.append((name, "(missing)" if value is missing else value, expected.get(name)))
    return out


# -- opening --------------------------------------------------------------------------------------
def open_artifact(path: str, expected: dict, mode: str, details: dict | None = None) -> tuple[zipfile.ZipFile | None, str]:
    """(the opened artifact, "") when it is there and matches; (None, why) when this start must
    build it: there is none ("") or, with mode "rebuild", it is unreadable or does not match.
    Raises FileNotFoundError (mode "load", no file), ValueError (unreadable) or ArtifactMismatch."""
    if not os.path.exists(path):
        if mode == "load":
            raise FileNotFoundError(
                f"fuse: no artifact at {path} (artifact_mode='load' needs one; build it with `python -m fuse "
                f"precompile ... --artifact {path}` or a start with artifact_mode='refuse')"
            )
        return None, ""
    if os.path.isdir(path):
        raise ValueError(f"fuse: the artifact {path} is a folder; an artifact is one file (a zip)")
    try:
        archive, manifest = _read(path)
    except ValueError as error:
        if mode != "rebuild":
            raise
        warnings.warn(f"{error}; rebuilding it", stacklevel=4)
        return None, "unreadable"
    wrong = mismatches(manifest.get("match", {}), expected)
    if not wrong:
        return archive, ""
    archive.close()
    named = "; ".join(f"{name}: {theirs!r} in the artifact, {ours!r} here" for name, theirs, ours in wrong)
    theirs, ours = manifest.get("model_config_fields"), (details or {}).get("model_config_fields")
    if isinstance(theirs, dict) and isinstance(ours, dict) and theirs != ours:
        fields = [f"{k} {theirs.get(k)!r} -> {ours.get(k)!r}" for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        named += f" (model config fields: {', '.join(fields[:8])}{', ...' if len(fields) > 8 else ''})"
    if mode == "rebuild":
        warnings.warn(f"fuse: the artifact {path} was built for another start ({named}); rebuilding it", stacklevel=4)
        return None, "mismatch: " + ", ".join(name for name, _, _ in wrong)
    raise ArtifactMismatch(
        f"fuse: the artifact {path} was built for another start: {named}. Rebuild it (`python -m fuse precompile`, "
        f"artifact_mode='rebuild', or delete it), or start with the versions and options it was built for",
        wrong,
    )


def _read(path: str) -> tuple[zipfile.ZipFile, dict]:
    """The archive and its manifest; ValueError naming the path when it is not a readable artifact."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(f"fuse: {path} is not a readable fuse artifact ({type(error).__name__}: {error})") from error
    try:
        manifest = json.loads(archive.read(MANIFEST))
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("match"), dict):
            raise ValueError(f"its {MANIFEST} is not a {FORMAT} manifest")
        names = set(archive.namelist())
        if any(part in ("", ".", "..") for name in names for part in name.split("/")) or any(n.startswith("/") for n in names):
            raise ValueError("a member's name leaves the caches it is for")
        absent = [name for name in manifest.get("files", ()) if name not in names]
        if absent:
            raise ValueError(f"it lacks {absent[:5]}")
    except (KeyError, ValueError, zipfile.BadZipFile, zlib.error, OSError) as error:
        archive.close()
        raise ValueError(f"fuse: {path} is not a readable fuse artifact ({error})") from error
    return archive, manifest


# -- loading --------------------------------------------------------------------------------------
def load_artifact(archive: zipfile.ZipFile, path: str) -> ArtifactUse:
    """Fill this process's compile caches from the opened artifact (files already there are
    kept): torch's cache artifacts into Inductor's cache folder, the Triton entries into
    Triton's cache folder, the C++ libraries into Inductor's; the frames are returned."""
    manifest = json.loads(archive.read(MANIFEST))
    frames, info = {}, True
    try:
        triton_root = _triton_cache_dir()
        inductor_root = _inductor_cache_dir()
        for name in archive.namelist():
            kind, _, rest = name.partition("/")
            if kind == "triton" and triton_root:
                key, _, filename = rest.partition("/")
                data = archive.read(name)
                if filename.startswith("__grp__"):
                    data = _relocated_group(data, triton_root)
                _write_new(os.path.join(triton_root, key, filename), data)
            elif kind == "inductor":
                _write_new(os.path.join(inductor_root, *rest.split("/")), archive.read(name))
            elif name.startswith(FRAMES):
                frames[name.removeprefix(FRAMES)] = archive.read(name)
        if TORCH_CACHE in archive.namelist():  # absent where frames hold every graph
            info = torch.compiler.load_cache_artifacts(archive.read(TORCH_CACHE))
    except (zipfile.BadZipFile, zlib.error, KeyError, OSError) as error:  # a member's CRC or data, a truncated file
        raise ValueError(f"fuse: {path} is not a readable fuse artifact ({type(error).__name__}: {error})") from error
    finally:
        archive.close()
    if info is None:
        raise ValueError(f"fuse: {path} is not a readable fuse artifact (torch could not read its compile caches)")
    return ArtifactUse(path, "loaded", size_bytes=os.path.getsize(path), contents=manifest.get("contents", {}), frames=frames)


def _relocated_group(data: bytes, root: str) -> bytes:
    """A Triton group file names its members by absolute path: point them into `root`."""
    group = json.loads(data)
    children = group.get("child_paths", {})
    for child, old in children.items():
        children[child] = os.path.join(root, os.path.basename(os.path.dirname(old)), os.path.basename(old))
    return json.dumps(group).encode()


def _write_new(path: str, data: bytes) -> None:
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _triton_cache_dir() -> str | None:
    """Where Triton looks for the custom ops' kernels in this process (TRITON_CACHE_DIR or its default)."""
    try:
        from triton import knobs
    except ImportError:
        return os.environ.get("TRITON_CACHE_DIR") or (os.path.expanduser("~/.triton/cache") if triton_version() else None)
    return knobs.cache.dir


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# -- watching a start, saving -----------------------------------------------------------------------
class CompileCacheWatch:
    """What a start compiled and which cache entries it used (see `watching_compile_caches`)."""

    def __init__(self):
        self.triton_opened: set[str] = set()  # entry folders of Triton's cache the start looked up
        self.triton_written: set[str] = set()  # ...and those it wrote (a compile or an autotune run)

    def triton_compiles(self) -> int:
        """Triton cache entries written outside Inductor: a custom op's kernel or launcher compiled,
        or its autotune run. Inductor's kernels are counted with its graphs."""
        return sum(1 for folder in self.triton_written if not _inductor_kernel(folder))

    def triton_entries(self, with_inductor_kernels: bool = False) -> list[str]:
        """The entry folders to ship: those the start opened that hold files, less Inductor's kernels
        (its cached graphs carry them) unless `with_inductor_kernels`."""
        return sorted(
            folder for folder in self.triton_opened
            if os.path.isdir(folder) and _entry_files(folder) and (with_inductor_kernels or not _inductor_kernel(folder))
        )


def _entry_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("tmp.") and n != "lock" and os.path.isfile(os.path.join(folder, n)))


def _inductor_kernel(folder: str) -> bool:
    """Inductor names its Triton kernels triton_*; the custom ops' are named otherwise."""
    files = _entry_files(folder) if os.path.isdir(folder) else []
    return bool(files) and all(n.removeprefix("__grp__").startswith("triton_") for n in files)


@contextlib.contextmanager
def watching_compile_caches(fresh_record: bool) -> Iterator[CompileCacheWatch]:
    """Record the Triton cache entries looked up inside (through Triton's cache-manager hook) and,
    with `fresh_record`, collect torch's cache artifacts of the block only (entries it loaded
    count as well as those it compiled), so that `save_artifact` inside saves what the block used."""
    watch = CompileCacheWatch()
    with contextlib.ExitStack() as stack:
        if fresh_record:
            stack.enter_context(_fresh_torch_cache_record())
        stack.enter_context(_recording_triton_cache(watch))
        yield watch


def _fresh_torch_cache_record():
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return contextlib.nullcontext()
    fresh = getattr(CacheArtifactManager, "with_fresh_cache", None)
    # Without it the artifact holds every entry this process used so far: more, never less.
    return fresh() if fresh is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _recording_triton_cache(watch: CompileCacheWatch):
    try:
        from triton import knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        yield
        return
    cache = getattr(knobs, "cache", None)
    if cache is None or "manager_class" not in dir(type(cache)):
        yield
        return
    had, previous = "manager_class" in cache.__dict__, cache.__dict__.get("manager_class")
    base = cache.manager_class or FileCacheManager
    signature = inspect.signature(base.__init__)

    class Recording(base):  # the manager in force, noting each entry folder a lookup opens
        def __init__(self, key, *args, **kwargs):
            super().__init__(key, *args, **kwargs)
            try:
                bound = signature.bind_partial(self, key, *args, **kwargs).arguments
            except TypeError:  # a manager of another signature: its lookups are still noted
                bound = {}
            folder = getattr(self, "cache_dir", None)
            if folder and not bound.get("override") and not bound.get("dump"):  # not Triton's dump or override folders
                watch.triton_opened.add(folder)

        def put(self, *args, **kwargs):
            path = super().put(*args, **kwargs)
            folder = getattr(self, "cache_dir", None)
            if folder in watch.triton_opened:
                watch.triton_written.add(folder)
            return path

    # Set in the knob's own storage: assigning None back would also clear TRITON_CACHE_MANAGER.
    cache.__dict__["manager_class"] = Recording
    try:
        yield
    finally:
        cache.__dict__.pop("manager_class", None)
        if had:
            cache.__dict__["manager_class"] = previous


def inductor_cpp_libraries() -> list[str]:
    """Files of the C++ libraries Inductor has loaded in this process (CPU kernels), inside its
    cache folder: each library with the other files of its cache key (its source, object files)."""
    try:
        from torch._inductor import codecache
    except ImportError:
        return []
    root = os.path.realpath(_inductor_cache_dir())
    classes, found = [getattr(codecache, "CppCodeCache", None)], set()
    while classes:
        cls = classes.pop()
        if cls is None:
            continue
        classes.extend(cls.__subclasses__())
        for load in list(vars(cls).get("cache", {}).values()):
            try:  # a loader of a library already loaded returns it
                lib = load() if inspect.isfunction(load) else load
            except Exception:  # noqa: BLE001 - one not loaded: left out
                continue
            path = getattr(lib, "__file__", None) or getattr(lib, "_name", None)
            if isinstance(path, str) and os.path.realpath(path).startswith(root + os.sep):
                found.add(os.path.realpath(path))
    files = set()
    for path in found:
        folder, key = os.path.dirname(path), os.path.basename(path).split(".")[0]
        files.update(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(key + ".") and not n.endswith(".lock"))
    return sorted(files)


def save_artifact(path: str, match: dict, watch: CompileCacheWatch, action: str, reason: str = "",
                  info: dict | None = None, frames: dict[str, bytes] | None = None) -> ArtifactUse:
    """Write the artifact of the start that `watch` watched (call it inside the watch), replacing
    any file at `path` in one step; with the start's `frames` (fuse/frames.py) where it has them."""
    frames = frames or {}
    saved = torch.compiler.save_cache_artifacts()
    if saved is None and not frames:
        raise RuntimeError(
            f"fuse: no artifact written to {path}: the start neither compiled nor loaded anything through torch's "
            "compile caches (are they off? torch._inductor.config.fx_graph_cache, TORCHINDUCTOR_FORCE_DISABLE_CACHES)"
        )
    torch_bytes, cache_info = saved or (None, None)
    contents = {kind: len(keys) for kind, keys in sorted(cache_info.artifacts.items()) if keys} if cache_info else {}
    members: dict[str, str] = {}  # archive name -> file
    # A frame's graph does not carry Inductor's kernels as a cached graph does: ship them too.
    triton_entries = watch.triton_entries(with_inductor_kernels=bool(frames))
    for folder in triton_entries:
        for name in _entry_files(folder):
            members[f"triton/{os.path.basename(folder)}/{name}"] = os.path.join(folder, name)
    contents["triton_entries"] = len(triton_entries)
    root = os.path.realpath(_inductor_cache_dir())
    libraries = inductor_cpp_libraries()
    for file in libraries:
        members["inductor/" + os.path.relpath(file, root).replace(os.sep, "/")] = file
    contents["cpp_libraries"] = sum(1 for f in libraries if f.endswith(".so"))
    if frames:
        contents["frames"] = len(frames)
    if (torch._inductor.config.bundle_triton_into_fx_graph_cache is False) and match.get("cuda"):
        warnings.warn("fuse: bundle_triton_into_fx_graph_cache is off: Inductor's Triton kernels are not in the "
                      "artifact, a start from it compiles them", stacklevel=3)
    manifest = {
        "format": FORMAT,
        "match": match,
        "contents": contents,
        "files": sorted(members) + [FRAMES + name for name in sorted(frames)] + ([TORCH_CACHE] if torch_bytes else []),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **(info or {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
            archive.writestr(MANIFEST, json.dumps(manifest, indent=1))
            if torch_bytes:
                archive.writestr(TORCH_CACHE, torch_bytes)
            for name, file in members.items():
                archive.write(file, name)
            for name, data in frames.items():
                archive.writestr(FRAMES + name, data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return ArtifactUse(path, action, reason, size_bytes=os.path.getsize(path), contents=contents)

