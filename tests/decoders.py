"""Decoders the tests share (tests/conftest.py's fixtures build them once per session)."""
from __future__ import annotations

import pathlib

import torch

# The report, bench and notebook build decoders of these shapes too, so that Inductor's compile
# cache serves their graphs.
TINY_SHAPE = dict(max_batch=4, max_seq_len=64, dtype=torch.float32)


def per_slot_buffers(decoder) -> dict[str, torch.Tensor]:
    """Every buffer with a row per cache slot (the real slots and the scratch slot)."""
    return {name: buf for name, buf in decoder.named_buffers() if buf.dim() >= 2 and buf.shape[0] == decoder.max_batch + 1}


def real_slot_caches(decoder) -> dict[str, torch.Tensor]:
    """Every per-slot buffer restricted to the real slots (the scratch slot is excluded)."""
    return {name: buf[: decoder.max_batch].clone() for name, buf in per_slot_buffers(decoder).items()}


def dump_hook_state() -> dict:
    """What depyf patches or registers while it dumps."""
    from torch._inductor.codecache import PyCodeCache

    return {
        "exec_with_source": torch.fx.graph_module._exec_with_source,
        "load_by_key_path": PyCodeCache.__dict__["load_by_key_path"],
        "lazy_format_graph_code": torch._dynamo.utils.lazy_format_graph_code.__code__,
        "bytecode_hooks": dict(torch._dynamo.convert_frame._bytecode_hooks),
    }


def compiled_tiny(dump: pathlib.Path, seed: int, **options):
    """(eager decoder, runner of a copy with the same weights and code dump, state before and after
    the runner's build): both decoders hold the same real sequences in slots 0 and 1 first."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import fuse
    from model import Decoder, ModelConfig

    cfg = ModelConfig.preset("tiny")
    eager = Decoder(cfg, **TINY_SHAPE).init_random(seed=seed)
    compiled_model = Decoder(cfg, **TINY_SHAPE)
    compiled_model.load_state_dict(eager.state_dict())
    generator = torch.Generator().manual_seed(seed)
    for position in range(5):
        tokens = torch.randint(0, cfg.vocab_size, (2,), generator=generator)
        for decoder in (eager, compiled_model):
            decoder(tokens, torch.full((2,), position), torch.arange(2))
    block_code = type(compiled_model.layers[0]).forward.__code__
    state = lambda: (real_slot_caches(compiled_model), dump_hook_state(), len(_debug_get_cache_entry_list(block_code)))  # noqa: E731
    before = state()
    runner = fuse.compile_decode(compiled_model, dump_dir=str(dump), progress=False, **options)
    return eager, runner, before, state()
