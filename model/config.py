"""Model configuration: one dataclass, with presets and a reader for the official config.json."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping


PRESETS = ("tiny", "tiny-fp8", "bench", "flash")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a DeepSeek-V4-class decoder. Field names follow the official ModelArgs."""

    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 2048
    n_layers: int = 43
    n_hash_layers: int = 3
    n_heads: int = 64
    # mixture of experts
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention (one shared KV head, low-rank q, grouped low-rank output)
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-6
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one ratio per layer: 0 = sliding window only, 4 = overlapping compressor + indexer, 128 = plain compressor
    compress_ratios: tuple[int, ...] = field(default_factory=lambda: (0, 0) + (4, 128) * 20 + (4,))
    # rotary embeddings (YaRN on compressed layers)
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # quantise-dequantise simulation of the FP8 KV cache and FP4 indexer (on in the official inference)
    qat: bool = True
    # ue8m0 = power-of-two block scales, as the official fp8 checkpoints use
    scale_fmt: str | None = "ue8m0"
    # Weight storage, as the official config names it. dtype "bf16": every linear in the model
    # dtype; "fp8": the linears the official code quantises (attention wq_a, wq_b, wkv, wo_b, the
    # indexer's wq_b, the shared expert) in e4m3 with 128 x 128 block scales, their activations
    # quantised per 128 values before each product (the official linear()). expert_dtype "fp4":
    # the routed experts in e2m1 with 1 x 32 block scales (None: as dtype says). scale_dtype
    # "fp8": ue8m0 scales (which also makes activation scales powers of two); "fp32": fp32.
    dtype: str = "bf16"
    expert_dtype: str | None = None
    scale_dtype: str = "fp8"
    # The products the official code runs in fp32 (hyper-connection mixes, gate, compressor
    # projections, LM head): "exact" keeps fp32 weights and math; "fast" stores those weights in
    # the model dtype and multiplies there (fp32 accumulation, fp32 result): half the bytes read.
    fp32_products: str = "exact"

    def __post_init__(self) -> None:
        ratios = tuple(int(r) for r in self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        problems = []
        if len(ratios) < self.n_layers:
            problems.append(f"compress_ratios has {len(ratios)} entries for {self.n_layers} layers")
        if any(r not in (0, 4, 128) for r in ratios[: self.n_layers]):
            problems.append(f"compress ratios must be 0, 4 or 128, got {sorted(set(ratios))}")
        if self.score_func != "sqrtsoftplus":
            problems.append(f"score_func {self.score_func!r} is not supported (V4 uses 'sqrtsoftplus')")
        problems += self._storage_problems()
        if self.fp32_products not in ("exact", "fast"):
            problems.append(f"fp32_products must be 'exact' or 'fast', got {self.fp32_products!r}")
        if self.n_shared_experts != 1:
            problems.append("exactly one shared expert is supported")
        if self.n_heads % self.o_groups:
            problems.append("n_heads must be a multiple of o_groups")
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            problems.append("rope_head_dim must be even and no wider than head_dim and index_head_dim")
        if self.qat:
            if (self.head_dim - self.rope_head_dim) % 64:
                problems.append("qat needs head_dim - rope_head_dim to be a multiple of 64 (fp8 blocks)")
            if self.index_head_dim % 32:
                problems.append("qat needs index_head_dim to be a multiple of 32 (fp4 blocks)")
        if self.index_head_dim & (self.index_head_dim - 1):
            problems.append("index_head_dim must be a power of two (Hadamard rotation)")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def _storage_problems(self) -> list[str]:
        problems = []
        if self.dtype not in ("bf16", "fp8"):
            problems.append(f"dtype must be 'bf16' or 'fp8', got {self.dtype!r}")
        if self.expert_dtype not in (None, "fp4"):
            problems.append(f"expert_dtype must be None or 'fp4', got {self.expert_dtype!r}")
        if self.scale_dtype not in ("fp8", "fp32"):
            problems.append(f"scale_dtype must be 'fp8' or 'fp32', got {self.scale_dtype!r}")
        # Activations are quantised in blocks of 128 along the products' inputs, and fused FP8
        # projections share 128-row scale blocks.
        needs = {}
        if self.dtype == "fp8":
            needs.update(dim=self.dim, q_lora_rank=self.q_lora_rank, moe_inter_dim=self.moe_inter_dim,
                         **{"o_groups * o_lora_rank": self.o_groups * self.o_lora_rank, "head_dim": self.head_dim,
                            "n_heads * head_dim": self.n_heads * self.head_dim,
                            "index_n_heads * index_head_dim": self.index_n_heads * self.index_head_dim})
        if self.expert_dtype == "fp4":
            needs.update(dim=self.dim, moe_inter_dim=self.moe_inter_dim)
        bad = [f"{name} = {value}" for name, value in needs.items() if value % 128]
        if bad:
            problems.append(f"dtype {self.dtype!r} / expert_dtype {self.expert_dtype!r} need multiples of 128: {', '.join(bad)}")
        return problems

    @property
    def linear_format(self) -> str:
        """How the linears the official code quantises are stored: "fp8" or "dense"."""
        return "fp8" if self.dtype == "fp8" else "dense"

    @property
    def expert_format(self) -> str:
        """How the routed experts are stored: "fp4", else as the other linears."""
        return "fp4" if self.expert_dtype == "fp4" else self.linear_format

    @property
    def weight_formats(self) -> str:
        """The storage of the quantisable weights in words ("" where every linear is dense)."""
        if self.linear_format == "dense" and self.expert_format == "dense":
            return ""
        scales = "ue8m0" if self.scale_dtype == "fp8" else "fp32"
        linears = "FP8 linears (e4m3, 128 x 128 blocks)" if self.linear_format == "fp8" else "dense linears"
        experts = {"fp4": "FP4 experts (e2m1, 1 x 32 blocks)", "fp8": "FP8 experts", "dense": "dense experts"}[self.expert_format]
        return f"{linears}, {experts}, {scales} scales"

    @property
    def pow2_scales(self) -> bool:
        """Power-of-two activation scales, as the official code sets them."""
        return self.scale_dtype == "fp8" or self.scale_fmt == "ue8m0"

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.n_layers]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, layers: int | None = None) -> "ModelConfig":
        """`tiny` (CPU tests), `tiny-fp8` (tiny with FP8 linears and FP4 experts), `flash` (exactly
        V4-Flash, FP8 linears and FP4 experts as its checkpoint), `bench` (V4-Flash widths, 16
        experts, bf16); `layers`: only the first that many of its layers (default: all)."""
        cfg = cls._full_preset(name)
        if layers is None:
            return cfg
        if not 1 <= layers <= cfg.n_layers:
            raise ValueError(f"layers must be in [1, {cfg.n_layers}] for the {name} preset, got {layers}")
        return cfg.replace(n_layers=layers)

    @classmethod
    def _full_preset(cls, name: str) -> "ModelConfig":
        if name == "flash":
            return cls(dtype="fp8", expert_dtype="fp4")
        if name == "bench":
            return cls(n_routed_experts=16)
        if name == "tiny":
            return cls(
                vocab_size=512,
                dim=128,
                moe_inter_dim=64,
                n_layers=6,
                n_heads=8,
                n_routed_experts=8,
                n_activated_experts=3,
                q_lora_rank=64,
                head_dim=96,
                rope_head_dim=32,
                o_groups=4,  # splits across 1, 2 or 4 ranks (model/parallel.py)
                o_lora_rank=32,
                window_size=16,
                compress_ratios=(0, 0, 4, 128, 4, 128),
                original_seq_len=64,
                index_n_heads=8,
                index_head_dim=64,
                index_topk=8,
            )
        if name == "tiny-fp8":  # tiny, with the checkpoint's formats: widths in whole 128-value blocks
            return cls._full_preset("tiny").replace(
                q_lora_rank=128, moe_inter_dim=128, o_lora_rank=64, head_dim=128, rope_head_dim=64,
                dtype="fp8", expert_dtype="fp4",
            )
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")

    @classmethod
    def from_official(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Read the official inference config.json (its ModelArgs field names), weight storage
        (dtype, expert_dtype, scale_dtype) included. Keys that concern the caches' capacity, the
        multi-token-prediction layer or parallelism are ignored; unknown keys are an error."""
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            with open(source) as f:
                raw = json.load(f)
        storage_only = {"max_batch_size", "max_seq_len", "n_mtp_layers"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - storage_only)
        if unknown:
            raise ValueError(f"unknown keys in official config: {unknown}")
        values = {k: v for k, v in raw.items() if k in known}
        if "compress_ratios" in values:
            values["compress_ratios"] = tuple(values["compress_ratios"])
        return cls(**values)
