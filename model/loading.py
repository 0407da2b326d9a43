"""Weights for a Decoder: the official checkpoint layout (bf16/fp32, fp8 e4m3 with 128x128 block
scales, fp4 e2m1 experts with 1x32 block scales, dequantised on load) and reproducible random init.
A decoder split across ranks (model/parallel.py) reads and draws only its parts."""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Callable, Mapping, NamedTuple

import torch
from torch import nn

from kernels.blockscale import dequantize_fp4_weight, dequantize_fp8_weight, quantize_fp4_weight, quantize_fp8_weight
from model.formats import from_checkpoint, logical_in_features
from model.layers import official_parameters
from model.parallel import ONE_PROCESS, FP8_BLOCK, Parallel, Part


class _Entry(NamedTuple):
    meta: torch.Tensor  # shape and dtype only
    load: Callable[[Part | None], torch.Tensor]  # the tensor, or only the given part of it


def _narrow(t: torch.Tensor, part: Part | None) -> torch.Tensor:
    return t if part is None else t.narrow(part.dim, part.start, part.stop - part.start)


def _read_safetensors(f, key: str, part: Part | None) -> torch.Tensor:
    if part is None:
        return f.get_tensor(key)
    return f.get_slice(key)[(slice(None),) * part.dim + (slice(part.start, part.stop),)]  # reads that part only


def _open_source(source, stack: contextlib.ExitStack) -> dict[str, _Entry]:
    """Every key with its shape and dtype and a loader, reading no tensor data yet (a full
    checkpoint is far larger than host memory). Each shard is opened once, its header parsed
    once, and kept open on `stack` for the loaders."""
    if isinstance(source, Mapping):
        return {k: _Entry(v, lambda part, v=v: _narrow(v, part)) for k, v in source.items()}
    from safetensors import safe_open

    path = os.fspath(source)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise ValueError(f"no safetensors checkpoint at {path}")
    entries: dict[str, _Entry] = {}
    for file in files:
        f = stack.enter_context(safe_open(file, framework="pt"))
        for key in f.keys():
            if key in entries:
                raise ValueError(f"key {key} appears in more than one shard (second: {file})")
            sl = f.get_slice(key)
            dtype, shape = _safetensors_dtype(sl.get_dtype()), sl.get_shape()
            if dtype == torch.float4_e2m1fn_x2:  # safetensors counts fp4 values, torch pairs of them
                shape = [*shape[:-1], shape[-1] // 2]
            meta = torch.empty(shape, dtype=dtype, device="meta")
            entries[key] = _Entry(meta, lambda part, f=f, key=key: _read_safetensors(f, key, part))
    return entries


def _is_fp4(t: torch.Tensor) -> bool:
    return t.dtype == getattr(torch, "float4_e2m1fn_x2", None)


def _logical_shape(key: str, peek: torch.Tensor, scales: Mapping[str, _Entry]) -> tuple[int, ...]:
    shape = tuple(peek.shape)
    if key[: -len("weight")] + "scale" in scales and (_is_fp4(peek) or peek.dtype in (torch.uint8, torch.int8)):
        return shape[:-1] + (shape[-1] * 2,)
    return shape


def load_official_weights(decoder: nn.Module, source) -> None:
    """Load `source` (a safetensors file, a directory of shards, or a dict) into `decoder`.
    `mtp.*` keys (the multi-token-prediction layer) are skipped. Unknown, missing or misshapen
    keys raise ValueError naming them, before any weight is changed.

    A decoder split across ranks reads only its parts of the checkpoint's tensors (and only
    its own experts), checked against the whole tensors' shapes. Every rank must call it: the
    ranks agree after checking (a rank's error is raised on every rank, before any weight is
    changed anywhere) and after reading."""
    parallel: Parallel = getattr(decoder, "parallel", ONE_PROCESS)
    with contextlib.ExitStack() as stack:
        plan = parallel.agreed("load_official (checking the checkpoint)", lambda: _plan_load(decoder, _open_source(source, stack), parallel))
        parallel.agreed("load_official (reading the weights)", lambda: _write_weights(plan))


_QUANTISED = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


def _stored_as(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor's bits hold: packed FP4 may come as float4, uint8 or int8."""
    return torch.float4_e2m1fn_x2 if t.dtype in (torch.uint8, torch.int8) else t.dtype


class _Load(NamedTuple):
    """One tensor to write: the checkpoint's entry and the part to read, and where the model
    holds it dense, the scale to dequantise it with and its part."""

    target: torch.Tensor
    entry: _Entry
    part: Part | None
    scale: _Entry | None = None
    scale_part: Part | None = None


def _scale_part(key: str, part: Part | None, parallel: Parallel) -> tuple[Part | None, str | None]:
    """The part of an FP8 weight's scale that dequantises `part` of the weight, or the problem."""
    if part is None:
        return None, None
    if (part.stop - part.start) % FP8_BLOCK:
        return None, (f"{key}: split across {parallel.world_size} ranks along dim {part.dim} into parts of {part.stop - part.start}, "
                      f"which do not fall on the checkpoint's {FP8_BLOCK}-wide scale blocks")
    return Part(part.dim, part.start // FP8_BLOCK, part.stop // FP8_BLOCK), None


def _plan_load(decoder: nn.Module, entries: dict[str, _Entry], parallel: Parallel = ONE_PROCESS) -> list[_Load]:
    """Block-scaled checkpoint tensors load as they are where the model stores that format (its
    state dict has the scale), and are dequantised where the model is dense; anything else that
    disagrees (a dense tensor for a quantised model, another format, a scale of another shape
    or dtype) is named, and nothing is read. Split across ranks, the checkpoint's tensors must
    have the whole model's shapes; the other ranks' experts are skipped."""
    n_experts = decoder.config.n_routed_experts
    entries = {k: v for k, v in entries.items() if not k.startswith("mtp.") and not parallel.held_elsewhere(k, n_experts)}
    targets = decoder.state_dict()
    # Scales of weights the model holds dense: applied on load.
    dequantised = {k: v for k, v in entries.items() if k.endswith(".scale") and k not in targets and k[: -len("scale")] + "weight" in entries}
    weights = {k: v for k, v in entries.items() if k not in dequantised}

    unknown = sorted(set(weights) - set(targets))
    missing = sorted(set(targets) - set(weights))
    problems = []
    if unknown:
        problems.append(f"unknown keys ({len(unknown)}): {unknown[:10]}")
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing[:10]}")
    misshapen, mistyped, unaligned = [], [], []
    plan = []
    for key in sorted(set(weights) & set(targets)):
        meta, target = weights[key].meta, targets[key]
        shape = _logical_shape(key, meta, dequantised)
        whole = parallel.full_shape(key, tuple(target.shape))
        scale_key = key[: -len("weight")] + "scale"
        part = parallel.part(key, shape)
        scale_part, problem = _scale_part(key, part, parallel) if scale_key in dequantised else (None, None)
        if shape != whole:
            split = f" ({list(target.shape)} on each of {parallel.world_size} ranks)" if whole != tuple(target.shape) else ""
            misshapen.append(f"{key}: checkpoint {list(shape)}, model {list(whole)}{split}")
        elif problem is not None:
            unaligned.append(problem)
        elif target.dtype in _QUANTISED and _stored_as(meta) != target.dtype:
            mistyped.append(f"{key}: checkpoint {meta.dtype}, model {target.dtype}")
        elif target.dtype not in _QUANTISED and _stored_as(meta) in _QUANTISED and scale_key not in dequantised:
            mistyped.append(f"{key}: checkpoint {meta.dtype} without a scale, model {target.dtype}")
        else:
            scale = dequantised.get(scale_key)
            plan.append(_Load(target, weights[key], part, scale, scale_part))
    if misshapen:
        problems.append(f"misshapen keys ({len(misshapen)}): {misshapen[:10]}")
    if unaligned:
        problems.append(f"split tensors off their scale blocks ({len(unaligned)}): {unaligned[:10]}")
    if mistyped:
        problems.append(
            f"tensors stored in another format than the model's ({len(mistyped)}; build the decoder with the "
            f"checkpoint's dtype / expert_dtype / scale_dtype): {mistyped[:10]}"
        )
    if problems:
        raise ValueError("cannot load official weights: " + "; ".join(problems))
    return plan


def _write_weights(plan: list[_Load]) -> None:
    with torch.no_grad():
        for target, entry, part, scale_entry, scale_part in plan:
            value = entry.load(part)
            if scale_entry is not None:
                scale = scale_entry.load(scale_part)
                if value.dtype == torch.float8_e4m3fn:
                    value = dequantize_fp8_weight(value, scale)
                else:
                    value = dequantize_fp4_weight(value, scale)
            if target.dtype in _QUANTISED:  # the bits as they are
                from_checkpoint(target).copy_(from_checkpoint(value).view(from_checkpoint(target).dtype).to(target.device))
            else:
                target.copy_(value.to(device=target.device, dtype=target.dtype))


def _safetensors_dtype(name: str) -> torch.dtype:
    table = {
        "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": torch.float8_e8m0fnu,
    }
    if name in table:
        return table[name]
    if name.startswith("F4"):
        return torch.float4_e2m1fn_x2
    raise ValueError(f"unsupported safetensors dtype {name}")


# The projections that write a block's sublayer output back into the residual streams.
RESIDUAL_BRANCH_OUTPUTS = ("attn.wo_b.weight", "ffn.experts.w2.weight", "ffn.shared_experts.w2.weight")


def residual_branch_scale(n_layers: int) -> float:
    """How much smaller than N(0, 1/fan_in) the residual branches' output projections are drawn:
    1/sqrt(2 n_layers), one factor per sublayer as GPT-2 and Megatron scale them."""
    return (2 * n_layers) ** -0.5


def _quantize_by_leading_slices(quantize, value: torch.Tensor, scale_dtype, slice_bytes: int = 1 << 30):
    """quantize(value) a few leading slices (experts) at a time: the blocks lie in the last two
    dims, so the result is the same, and the rounding's temporaries (several times the fp32
    input) stay small next to a stacked expert weight of several GB."""
    if value.dim() < 3 or value.numel() * value.element_size() <= slice_bytes:
        return quantize(value, scale_dtype)
    step = max(1, slice_bytes // (value[0].numel() * value.element_size()))
    parts = [quantize(value[start:start + step], scale_dtype) for start in range(0, value.shape[0], step)]
    return torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts])


@torch.no_grad()
def init_random_weights(decoder: nn.Module, seed: int) -> None:
    """Random weights that keep activations O(1): linear maps N(0, 1/fan_in), norms around 1,
    hyper-connection maps giving unit-variance mixes, distinct hash experts per token. Fused
    projections are drawn piece by piece under their official names, as if unfused; FP8 and FP4
    weights are drawn dense and quantised as the official checkpoints are (one power-of-two scale
    per block, kernels/blockscale/ref.py).

    The residual branches' output projections (RESIDUAL_BRANCH_OUTPUTS: the attention's wo_b,
    every expert's w2) are drawn `residual_branch_scale` smaller, so that the streams stay O(1)
    and a small perturbation does not grow from layer to layer, as in a trained network. The
    scale was chosen by comparing bf16 with fp32 eager logits of the same weights layer by layer
    (tiny widths, 43 layers): unscaled, the difference grew to 0.5 relative; scaled, the typical
    row stays near 1e-2 at every depth (what is left are discrete MoE routing flips, which do not grow).

    A decoder split across ranks draws each whole tensor as the one-process decoder does (one
    at a time) and keeps its part: every rank holds exactly its part of the same weights."""
    n_layers = decoder.config.n_layers
    parallel: Parallel = getattr(decoder, "parallel", ONE_PROCESS)
    generator = None
    params = dict(official_parameters(decoder))
    for name, param in params.items():
        scale = params.get(name[: -len("weight")] + "scale") if name.endswith("weight") else None
        if name.endswith(".scale") and name[: -len("scale")] + "weight" in params:
            continue  # drawn with its weight
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        leaf = name.rsplit(".", 1)[-1]
        shape = param.shape if scale is None else (*param.shape[:-1], logical_in_features(param, scale))
        shape = parallel.full_shape(name, tuple(shape))

        def normal(std: float, mean: float = 0.0) -> torch.Tensor:
            # in place: one fp32 temporary of the tensor's size (the embedding's is gigabytes)
            return torch.randn(shape, generator=generator, device=param.device, dtype=torch.float32).mul_(std).add_(mean)

        if leaf == "tid2eid":
            vocab, picks = param.shape
            n_experts = decoder.config.n_routed_experts
            noise = torch.rand(vocab, n_experts, generator=generator, device=param.device)
            value = noise.argsort(dim=-1)[:, :picks]
        elif leaf == "attn_sink":
            value = normal(0.5)
        elif leaf == "ape":
            value = normal(0.1)
        elif name.endswith("gate.bias"):
            value = normal(0.1)
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            value = normal(shape[-1] ** -0.5)
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            value = normal(0.3)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            value = torch.rand(shape, generator=generator, device=param.device) + 0.5
        elif name.endswith("norm.weight"):
            value = normal(0.1, 1.0)
        elif name == "embed.weight":
            value = normal(1.0)
        elif name.endswith(RESIDUAL_BRANCH_OUTPUTS):
            value = normal(shape[-1] ** -0.5 * residual_branch_scale(n_layers))
        else:
            value = normal(shape[-1] ** -0.5)
        part = parallel.part(name, tuple(value.shape))
        if scale is None:
            param.copy_(_narrow(value, part))  # copy_ rounds to param's dtype as .to() would
        else:
            quantize = quantize_fp8_weight if param.dtype == torch.float8_e4m3fn else quantize_fp4_weight
            values, scales = _quantize_by_leading_slices(quantize, value, scale.dtype)  # the whole tensor's blocks
            scale_name = name[: -len("weight")] + "scale"
            param.copy_(_narrow(values, parallel.part(name, tuple(values.shape))))
            scale.copy_(_narrow(scales, parallel.part(scale_name, tuple(scales.shape))))
