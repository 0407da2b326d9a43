"""V4 attention for one decode token per sequence: one shared 512-wide KV head (MQA), a sliding
window ring, a KV compressor (ratio 4 with an indexer picking the top entries, or ratio 128
attending to all), sparse attention with per-head sinks, and a grouped low-rank output.

Caches hold one row set per cache slot: `kv_cache[slot]` is the window ring (rows
[0, window)) followed by the compressed entries. Everything is written with static shapes:
an entry is (re)written every step and becomes visible only once complete.

Projections that read the same input run as one GEMM (FusedLinear): the attention input feeds
wq_a, wkv, the compressors' wkv/wgate and the indexer's weights_proj; the normed low-rank query
feeds wq_b and the indexer's wq_b. Each projection keeps its official name as a LinearView.

Split across ranks (model/parallel.py), a rank holds a contiguous share of the heads, their rows
of wq_b and attn_sink, the groups those heads form (their rows of wo_a, their columns of wo_b)
and a share of the index heads (their rows of the indexer's wq_b and weights_proj); the
low-rank query, the KV head, the norms and the compressors are whole on every rank. The
output projection's partial sums and the index scores are summed over the ranks (one all-reduce
each)."""
from __future__ import annotations

import torch
from torch import nn

import kernels
from model.config import ModelConfig
from model.formats import scale_dtype_of
from model.layers import DecodeStep, FusedLinear, Linear, LinearView, RMSNorm, fp32_param, fused_products, product_dtype
from model.parallel import ONE_PROCESS, Parallel, all_reduce
from model.quant import fp4_qdq, fp8_qdq, hadamard_rotate
from model.rope import apply_rope


def compressed_capacity(max_seq_len: int, ratio: int) -> int:
    # Rounded up: the entry of an incomplete last window is written (never read) every step.
    return -(-max_seq_len // ratio)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots[i], rows[i]] = values[i] for every i, indexed on the cache itself: a second
    write into a flattened view of the same cache in one step would have the compiler copy the
    whole cache (every slot) to apply the first write out of place."""
    cache.index_put_((slots, rows), values.to(cache.dtype))


def kv_fp8_qdq(kv: torch.Tensor, rope_dim: int, pow2_scale: bool) -> torch.Tensor:
    """The KV cache stores the non-rope channels as fp8 (blocks of 64); rope channels stay exact."""
    return fp8_qdq(kv, 64, pow2_scale, keep_last=rope_dim)


class Compressor(nn.Module):
    """Gated pooling of `ratio` consecutive tokens into one cache entry. Ratio 4 pools
    overlapping windows: the entry mixes the previous window (first half of the channels) and
    the current one (second half), so its state keeps two windows. Its projections wkv and wgate
    of the attention input are run by the attention, fused with the other projections of x."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, rotate: bool, num_slots: int, device=None):
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.rope_dim = cfg.rope_head_dim
        self.overlap = ratio == 4
        self.rotate = rotate  # indexer entries: Hadamard rotation + fp4; attention entries: fp8
        self.qat = cfg.qat
        self.pow2_scale = cfg.scale_fmt == "ue8m0"
        width = (2 if self.overlap else 1) * head_dim
        rows = (2 if self.overlap else 1) * ratio
        self.ape = fp32_param(ratio, width, device=device)
        self.wkv = LinearView(cfg.dim, width)
        self.wgate = LinearView(cfg.dim, width)
        self.norm = RMSNorm(head_dim, cfg.norm_eps, device)
        self.register_buffer("kv_state", torch.zeros(num_slots, rows, width, device=device), persistent=False)
        self.register_buffer("score_state", torch.zeros(num_slots, rows, width, device=device), persistent=False)

    def forward(
        self, kv: torch.Tensor, score: torch.Tensor, step: DecodeStep, cache: torch.Tensor, first_row: int, hadamard: torch.Tensor
    ):
        """Record this token's wkv and wgate products [B, width] (fp32, or the weights' dtype) and
        write the sequence's current entry to cache[slot, first_row + pos // ratio]."""
        r, d = self.ratio, self.head_dim
        pos, slots = step.positions, step.slots
        # The state is a ring over the last `rows` positions (position p in row p % rows): a
        # step writes one row and moves nothing, so it compiles to one small scatter.
        row = pos % self.kv_state.shape[1]
        write_rows(self.kv_state, slots, row, kv)
        write_rows(self.score_state, slots, row, score.float() + self.ape[pos % r])
        if self.overlap:
            # The window is the 2r positions ending with the current window, oldest first: the
            # previous window's first d channels, then the current window's last d channels.
            # A sequence's first window has no previous window: mask it (its rows are stale).
            j = torch.arange(2 * r, device=pos.device)
            first = pos - pos % r + r  # the previous window's start, mod 2r
            ring = ((first[:, None] + j) % (2 * r))[:, :, None]
            channel = torch.arange(d, device=pos.device) + (j[:, None] >= r) * d
            window_kv = self.kv_state[slots[:, None, None], ring, channel]
            no_previous = (j[None, :] < r) & (pos[:, None] < r)
            window_score = self.score_state[slots[:, None, None], ring, channel].masked_fill(no_previous[:, :, None], float("-inf"))
        else:
            window_kv, window_score = self.kv_state[slots], self.score_state[slots]
        pooled = (window_kv * window_score.softmax(dim=1)).sum(dim=1)
        entry = self.norm(pooled.to(cache.dtype))
        entry = apply_rope(entry, step.rope_compress_table[(pos // r) * r])
        if self.rotate:
            entry = hadamard_rotate(entry, hadamard)
            if self.qat:
                entry = fp4_qdq(entry, 32)
        elif self.qat:
            entry = kv_fp8_qdq(entry, self.rope_dim, self.pow2_scale)
        write_rows(cache, slots, first_row + pos // r, entry)


class Indexer(nn.Module):
    """Scores every visible compressed entry against 64 small query heads and keeps the top-k.
    Its projections (wq_b of the low-rank query, weights_proj and the compressor's of the
    attention input) are run by the attention, fused with the attention's own."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype, device=None,
                 parallel: Parallel = ONE_PROCESS):
        super().__init__()
        self.parallel = parallel
        self.n_heads = cfg.index_n_heads  # the scores' scale counts every rank's heads
        self.n_local_heads = parallel.local(cfg.index_n_heads)
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.qat = cfg.qat
        self.wq_b = LinearView(cfg.q_lora_rank, self.n_local_heads * self.head_dim)
        self.weights_proj = LinearView(cfg.dim, self.n_local_heads)
        self.compressor = Compressor(cfg, 4, self.head_dim, True, num_slots, device)
        capacity = compressed_capacity(max_seq_len, 4)
        self.register_buffer(
            "kv_cache", torch.zeros(num_slots, capacity, self.head_dim, dtype=dtype, device=device), persistent=False
        )

    def forward(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        compressor_kv: torch.Tensor,
        compressor_score: torch.Tensor,
        step: DecodeStep,
        hadamard: torch.Tensor,
    ) -> torch.Tensor:
        """Entry numbers [B, topk] int32 of the selected compressed entries, -1 where fewer are
        visible. Takes the products of its projections: q = wq_b(qr), weights = weights_proj(x),
        and its compressor's wkv(x), wgate(x)."""
        self.compressor(compressor_kv, compressor_score, step, self.kv_cache, 0, hadamard)
        q = q.unflatten(-1, (self.n_local_heads, self.head_dim))
        q = hadamard_rotate(apply_rope(q, step.rope_compress), hadamard)
        if self.qat:
            q = fp4_qdq(q, 32)
        weights = weights * (self.head_dim**-0.5 * self.n_heads**-0.5)
        visible = (step.positions + 1) // 4
        if self.parallel.world_size == 1:
            return kernels.indexer_topk(q, weights, self.kv_cache, step.slots, visible, self.topk)
        # Split heads: each rank scores with its own heads, the top-k is taken of the sum.
        scores = all_reduce(kernels.indexer_scores(q, weights, self.kv_cache, step.slots, visible), self.parallel)
        return kernels.indexer_select(scores, visible, self.topk)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ratio: int, num_slots: int, max_seq_len: int, dtype: torch.dtype, device=None,
        parallel: Parallel = ONE_PROCESS,
    ):
        super().__init__()
        self.parallel = parallel
        self.ratio = ratio
        self.n_heads = parallel.local(cfg.n_heads)  # this rank's heads
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.rope_head_dim
        self.window = cfg.window_size
        self.n_groups = parallel.local(cfg.o_groups)  # the groups this rank's heads form
        self.o_lora_rank = cfg.o_lora_rank
        self.eps = cfg.norm_eps
        self.qat = cfg.qat
        self.pow2_scale = cfg.scale_fmt == "ue8m0"
        self.softmax_scale = self.head_dim**-0.5
        self.attn_sink = fp32_param(self.n_heads, device=device)
        self.wq_a = LinearView(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device)
        self.wq_b = LinearView(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = LinearView(cfg.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, cfg.norm_eps, device)
        self.wo_a = Linear(cfg.n_heads * self.head_dim // cfg.o_groups, self.n_groups * self.o_lora_rank, dtype, device)
        self.wo_b = Linear(
            self.n_groups * self.o_lora_rank, cfg.dim, dtype, device,
            fmt=cfg.linear_format, scale_dtype=scale_dtype_of(cfg.scale_dtype), pow2=cfg.pow2_scales,
        )
        self.n_compressed = compressed_capacity(max_seq_len, ratio) if ratio else 0
        if ratio:
            self.compressor = Compressor(cfg, ratio, self.head_dim, False, num_slots, device)
        if ratio == 4:
            self.indexer = Indexer(cfg, num_slots, max_seq_len, dtype, device, parallel)
        rows = self.window + self.n_compressed
        self.register_buffer(
            "kv_cache", torch.zeros(num_slots, rows, self.head_dim, dtype=dtype, device=device), persistent=False
        )
        self._fuse_projections(cfg, product_dtype(cfg.fp32_products, dtype), dtype, device)

    def _fuse_projections(self, cfg: ModelConfig, compressor_dtype: torch.dtype, dtype: torch.dtype, device) -> None:
        """One product per input and weight format: x_proj for the attention input x, qr_proj
        for the normed low-rank query. With FP8 storage the projections the official code keeps
        in bf16 (the indexer's weights_proj) form x_dense_proj beside the FP8 x_proj. The
        compressors' weights are fp32 in "exact" fp32_products mode: they then read x in fp32
        through x32_proj; otherwise (x.float() cast back is x) they join the dense product of x."""
        on_x, on_qr, on_x32, dense_on_x = ["wq_a", "wkv"], ["wq_b"], [], []
        if self.ratio:
            on_x32 += ["compressor.wkv", "compressor.wgate"]
        if self.ratio == 4:
            dense_on_x.append("indexer.weights_proj")
            on_qr.append("indexer.wq_b")
            on_x32 += ["indexer.compressor.wkv", "indexer.compressor.wgate"]
        if compressor_dtype == dtype:
            dense_on_x, on_x32 = dense_on_x + on_x32, []
        fmt = cfg.linear_format
        if fmt == "dense":
            on_x, dense_on_x = on_x + dense_on_x, []
        views = lambda names: {name: self.get_submodule(name) for name in names}  # noqa: E731
        stored = dict(fmt=fmt, scale_dtype=scale_dtype_of(cfg.scale_dtype), pow2=cfg.pow2_scales)
        self.x_proj = FusedLinear(views(on_x), dtype, device, **stored)
        self.qr_proj = FusedLinear(views(on_qr), dtype, device, **stored)
        self.x_dense_proj = FusedLinear(views(dense_on_x), dtype, device) if dense_on_x else None
        self.x32_proj = FusedLinear(views(on_x32), compressor_dtype, device) if on_x32 else None

    def attended_rows(self, step: DecodeStep, compressed_entries: torch.Tensor | None) -> torch.Tensor:
        """Global row numbers [B, K] into kv_cache viewed as [slots * rows, head_dim]; -1 = masked."""
        # int32 from the start (the kernel's index type), so that each piece is written straight
        # into its columns of the result, with no int64 copy to convert.
        pos, rows_per_slot = step.positions, self.kv_cache.shape[1]
        base = (step.slots * rows_per_slot).to(torch.int32)[:, None]
        ring = torch.arange(self.window, dtype=torch.int32, device=pos.device)
        # Ring slot j holds position j + k*window; it is this sequence's once the sequence reached it.
        parts = [torch.where(ring[None, :] <= pos[:, None], base + ring, -1)]
        if self.ratio == 128:
            entry = torch.arange(self.n_compressed, dtype=torch.int32, device=pos.device)
            visible = (pos + 1) // self.ratio
            parts.append(torch.where(entry[None, :] < visible[:, None], base + self.window + entry, -1))
        elif self.ratio == 4:
            parts.append(torch.where(compressed_entries >= 0, base + self.window + compressed_entries, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def forward(self, x: torch.Tensor, step: DecodeStep, hadamard: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        rope = step.rope_compress if self.ratio else step.rope_window
        # {projection name: product}; the widest product first, the others beside it (fused_products)
        calls = [(self.x32_proj, x.float())] if self.x32_proj is not None else []
        calls.append((self.x_proj, x))
        if self.x_dense_proj is not None:
            calls.append((self.x_dense_proj, x))
        on_x = fused_products(calls)
        qr = self.q_norm(on_x["wq_a"])
        on_qr = self.qr_proj(qr)
        q = on_qr["wq_b"].unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        q = apply_rope(q, rope)

        kv = apply_rope(self.kv_norm(on_x["wkv"]), rope)
        if self.qat:
            kv = kv_fp8_qdq(kv, self.rope_dim, self.pow2_scale)
        entries = None
        if self.ratio == 4:
            entries = self.indexer(
                on_qr["indexer.wq_b"], on_x["indexer.weights_proj"],
                on_x["indexer.compressor.wkv"], on_x["indexer.compressor.wgate"], step, hadamard,
            )
        write_rows(self.kv_cache, step.slots, step.positions % self.window, kv)
        if self.ratio:
            self.compressor(on_x["compressor.wkv"], on_x["compressor.wgate"], step, self.kv_cache, self.window, hadamard)

        rows = self.attended_rows(step, entries)
        o = kernels.sparse_mla_decode(q, self.kv_cache, rows, self.attn_sink, self.softmax_scale)
        o = apply_rope(o, rope, inverse=True)
        # Grouped low-rank output: each group of heads has its own [o_lora_rank, heads*head_dim/groups] map.
        o = o.reshape(batch, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        out = self.wo_b(kernels.grouped_linear(o, wo_a).flatten(1))
        if self.parallel.world_size == 1:
            return out
        return all_reduce(out.float(), self.parallel).to(out.dtype)  # the ranks' partial sums, added in fp32

