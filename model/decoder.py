"""The V4 decode step: embed, hc_mult residual copies through every block, hc head, final norm,
fp32 logits. One new token per sequence; sequences in a batch may be at different positions.
Split across ranks (`parallel`, model/parallel.py), every rank runs the same step on the same
inputs with its share of the weights and returns the same logits."""
from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from model.attention import Attention
from model.config import ModelConfig
from model.hyper import hc_head, hc_post, hc_post_pre_norm, hc_pre_norm
from model.layers import DecodeStep, Embedding, Linear, RMSNorm, fp32_linear, fp32_param, product_dtype
from model.moe import MoE
from model.parallel import ONE_PROCESS, Parallel, all_gather_last
from model.quant import hadamard_matrix
from model.rope import rope_frequencies, rope_table


class Block(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, num_slots: int, max_seq_len: int, dtype, device=None,
        parallel: Parallel = ONE_PROCESS,
    ):
        super().__init__()
        self.sinkhorn_iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.norm_eps
        self.attn = Attention(cfg, cfg.layer_ratios[layer_id], num_slots, max_seq_len, dtype, device, parallel)
        self.ffn = MoE(cfg, layer_id, dtype, device, parallel)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        mixes, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        fn_dtype = product_dtype(cfg.fp32_products, dtype)
        for side in ("attn", "ffn"):
            fn = torch.empty(mixes, width, dtype=fn_dtype, device=device)
            setattr(self, f"hc_{side}_fn", nn.Parameter(fn, requires_grad=False))
            setattr(self, f"hc_{side}_base", fp32_param(mixes, device=device))
            setattr(self, f"hc_{side}_scale", fp32_param(3, device=device))

    def _mix(self, side: str) -> tuple:
        """The hc parameters and the norm of one sublayer, as the boundary functions take them."""
        fn, scale, base = (getattr(self, f"hc_{side}_{p}") for p in ("fn", "scale", "base"))
        return fn, scale, base, getattr(self, f"{side}_norm"), self.sinkhorn_iters, self.hc_eps, self.norm_eps

    def forward(self, streams: torch.Tensor, step: DecodeStep, hadamard: torch.Tensor) -> torch.Tensor:
        step.check_batch(streams)
        x, post, comb = hc_pre_norm(streams, *self._mix("attn"))
        out = self.attn(x, step, hadamard)
        streams, x, post, comb = hc_post_pre_norm(out, streams, post, comb, *self._mix("ffn"))
        return hc_post(self.ffn(x, step.tokens), streams, post, comb)


class Decoder(nn.Module):
    """Decode-step model owning preallocated caches for `max_batch` cache slots (plus one
    scratch slot, `pad_slot`, that padded batch rows may use without touching real sequences).

    `decoder(tokens, positions, slots)` takes three int64 tensors of shape [B] and returns fp32
    logits [B, vocab]. Position 0 on a slot starts a new sequence there. Inputs are checked
    before anything is written (see `check_inputs`); `step` is the same computation unchecked,
    for callers that validated already (and for torch.compile).

    `parallel` (model.parallel.Parallel) splits the model across the ranks of a torch.distributed
    group as the official inference does: each rank holds its share and runs every step with
    the same inputs; the default is one process, the whole model."""

    def __init__(
        self,
        config: ModelConfig,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        check_device_values: bool = True,
        parallel: Parallel | None = None,
        layer_ids: Sequence[int] | None = None,
    ):
        """`layer_ids`: build only these of the config's layers, in this order (a decoder of one
        layer of each kind compiles the same graphs as the whole one); default: every layer."""
        super().__init__()
        if max_batch < 1 or max_seq_len < 1:
            raise ValueError(f"max_batch and max_seq_len must be positive, got {max_batch} and {max_seq_len}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        cfg = config
        parallel = parallel or ONE_PROCESS
        parallel.check(cfg)
        self.parallel = parallel
        self.config = cfg
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.pad_slot = max_batch
        # Values of inputs already on an accelerator can only be checked after a device sync.
        self.check_device_values = check_device_values
        num_slots = max_batch + 1
        self.embed = Embedding(cfg.vocab_size, cfg.dim, dtype, device, parallel)
        ids = range(cfg.n_layers) if layer_ids is None else tuple(layer_ids)
        if not ids or any(not 0 <= i < cfg.n_layers for i in ids):
            raise ValueError(f"layer_ids must name some of the config's {cfg.n_layers} layers, got {layer_ids}")
        self.layers = nn.ModuleList(Block(cfg, i, num_slots, max_seq_len, dtype, device, parallel) for i in ids)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device)
        head_dtype = product_dtype(cfg.fp32_products, dtype)
        self.head = Linear(cfg.dim, parallel.local(cfg.vocab_size), head_dtype, device)  # this rank's vocabulary
        hc_head_fn = torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=head_dtype, device=device)
        self.hc_head_fn = nn.Parameter(hc_head_fn, requires_grad=False)
        self.hc_head_base = fp32_param(cfg.hc_mult, device=device)
        self.hc_head_scale = fp32_param(1, device=device)

        window_freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta)
        compress_freqs = rope_frequencies(
            cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
        )
        self.register_buffer("rope_window", rope_table(max_seq_len, window_freqs).to(device), persistent=False)
        self.register_buffer("rope_compress", rope_table(max_seq_len, compress_freqs).to(device), persistent=False)
        self.register_buffer("hadamard", hadamard_matrix(cfg.index_head_dim, device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # -- the step -----------------------------------------------------------------------------
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        layers: Sequence[Callable[..., torch.Tensor]] | None = None,
        logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One decode step without input checks. All inputs int64 [B] on the model's device.
        `layers` replaces the blocks' calls and `logits` the head's (e.g. with separately
        compiled ones); default: self.layers and self.logits."""
        step = DecodeStep(
            tokens=tokens,
            positions=positions,
            slots=slots,
            rope_window=self.rope_window[positions],
            rope_compress=self.rope_compress[positions],
            rope_compress_table=self.rope_compress,
        )
        cfg = self.config
        streams = self.embed(tokens).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        for layer in self.layers if layers is None else layers:
            streams = layer(streams, step, self.hadamard)
        return (self.logits if logits is None else logits)(streams)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """The head: hc head, final norm and the LM head, streams [B, hc, D] -> fp32 [B, vocab]."""
        cfg = self.config
        x = hc_head(streams, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.hc_eps, cfg.norm_eps)
        return all_gather_last(fp32_linear(self.norm(x), self.head.weight), self.parallel)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            tokens, positions, slots = self.check_inputs(tokens, positions, slots)
        return self.step(tokens, positions, slots)

    def recurrent_state(self) -> dict[str, torch.Tensor]:
        """The buffers a step reads back besides the cache rows it rewrites: the compressors'
        pooling windows (rings over the last positions). Restoring them (and nothing else) makes
        a repeated step at the same positions start from the same state."""
        return {name: buf for name, buf in self.named_buffers() if name.endswith(("kv_state", "score_state"))}

    # -- input checks -------------------------------------------------------------------------
    def check_inputs(self, tokens, positions, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raise ValueError naming the problem, before anything is written. Shapes and dtypes are
        always checked. Values are checked on host tensors (free; they are then moved to the
        model's device) and, if `check_device_values`, on device tensors (one device sync)."""
        named = {"tokens": tokens, "positions": positions, "slots": slots}
        for name, t in named.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"{name} must have shape [B], got {tuple(t.shape)}")
        batch = tokens.shape[0]
        if positions.shape[0] != batch or slots.shape[0] != batch:
            raise ValueError(
                f"tokens, positions and slots must have the same length, got {batch}, {positions.shape[0]}, {slots.shape[0]}"
            )
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch size must be in [1, {self.max_batch}] (max_batch), got {batch}")
        on_host = all(t.device.type == "cpu" for t in named.values())
        if on_host or self.check_device_values:
            self._check_values(tokens, positions, slots)
        device = self.device
        return tuple(t.to(device, non_blocking=True) for t in (tokens, positions, slots))

    def _check_values(self, tokens, positions, slots) -> None:
        def out_of_range(t, low, high):
            bad = (t < low) | (t >= high)
            return t[bad].tolist() if bool(bad.any()) else None

        cfg = self.config
        for name, t, high, what in (
            ("tokens", tokens, cfg.vocab_size, "vocabulary size"),
            ("positions", positions, self.max_seq_len, "max_seq_len"),
            ("slots", slots, self.max_batch, "max_batch"),
        ):
            bad = out_of_range(t, 0, high)
            if bad is not None:
                raise ValueError(f"{name} must be in [0, {high}) ({what}); got {bad[:8]}")
        if slots.unique().numel() != slots.numel():
            values, counts = slots.unique(return_counts=True)
            raise ValueError(f"each slot may appear once per batch; repeated: {values[counts > 1].tolist()}")

    # -- weights ------------------------------------------------------------------------------
    def load_official(self, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        """Load weights named and shaped as the official inference code names them (see
        model.loading.load_official_weights); split across ranks, each rank reads its parts only.
        Collective where split: every rank calls it, and if one fails every rank raises its error."""
        from model.loading import load_official_weights

        load_official_weights(self, source)

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "Decoder":
        """Reproducible random weights (for a given seed and device) with activations of sane
        scale, so that logits are neither degenerate nor huge. Split across ranks, each rank gets
        its part of the weights the one-process decoder draws with the same seed."""
        from model.loading import init_random_weights

        init_random_weights(self, seed)
        return self
