"""The floor of a decode step: the bytes it must read at least (weights it touches, attended KV
rows, the indexer cache), and the copy bandwidth that turns them into a time. `fuse bench` and
`fuse report` divide their step times by it; split across ranks, each rank by its own."""
from __future__ import annotations

import statistics
import time

import torch

from model import Decoder


def expected_experts(n_experts: int, topk: int, batch: int) -> float:
    """Distinct experts a batch touches on average when each token picks `topk` uniformly."""
    return n_experts * (1 - (1 - topk / n_experts) ** batch)


def floor_bytes(decoder: Decoder, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step must read at least: every weight it uses (routed experts: the expected
    distinct ones; embedding and hash table: the batch's rows), the KV rows sparse attention
    attends, and the indexer cache rows it scores. Compressor states and activations (small) are left out.
    Split across ranks (docs/parallel.md): what this rank must read, its share of the experts
    and of the vocabulary included."""
    cfg = decoder.config
    parallel = getattr(decoder, "parallel", None)
    share = 1 / parallel.world_size if parallel is not None else 1.0  # of the experts and the vocabulary
    weights = 0.0
    for name, p in decoder.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
            # routed experts (and the shared one where it is stacked with them), weights and scales
            shared_rows = p.shape[0] - round(cfg.n_routed_experts * share)
            touched = expected_experts(cfg.n_routed_experts, cfg.n_activated_experts, batch) * share + shared_rows
            weights += nbytes / p.shape[0] * touched
        elif name == "embed.weight":
            weights += nbytes / p.shape[0] * batch * share  # the batch's rows that fall in this rank's part
        elif name.endswith("tid2eid"):
            weights += nbytes / p.shape[0] * batch
        else:
            weights += nbytes
    kv = indexer = 0.0
    for block in decoder.layers:
        attn = block.attn
        row_bytes = attn.kv_cache.shape[-1] * attn.kv_cache.element_size()
        rows = min(context, cfg.window_size)
        if attn.ratio == 4:
            rows += min(cfg.index_topk, context // 4)
            cache = attn.indexer.kv_cache
            indexer += batch * (context // 4) * cache.shape[-1] * cache.element_size()
        elif attn.ratio == 128:
            rows += context // 128
        kv += batch * rows * row_bytes
    return {"weights": weights, "kv": kv, "indexer": indexer, "total": weights + kv + indexer}


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Bytes read plus written per second by a large copy on `device`."""
    if device.type == "cuda":
        from kernels.bench.timing import copy_bandwidth_gbs as measure

        return measure()
    src = torch.randn(32 << 20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def step_floor(decoder: Decoder, batch: int, context: int, copy_gbs: float) -> tuple[dict[str, float], float]:
    """(floor_bytes, the time reading them takes at `copy_gbs`, in ms)."""
    floor = floor_bytes(decoder, batch, context)
    return floor, floor["total"] / (copy_gbs * 1e9) * 1e3
