"""A compiled step writes each cache and state row it changes in place: the code Inductor
generates never loops over a whole per-slot buffer. A write applied out of place copies the
buffer, every slot of it, each step: a cost that grows with max_batch rather than the batch (the
attention's cache takes two writes a step, the window row and then the compressed entry, the
pattern that made the compiler copy it)."""
from __future__ import annotations

import collections
import re

import torch

import fuse
from decoders import per_slot_buffers
from model import Decoder, ModelConfig

MAX_BATCH = 61  # 62 slots with the scratch slot: buffer sizes no other loop has


def test_no_loop_over_a_whole_per_slot_buffer(tmp_path):
    decoder = Decoder(ModelConfig.preset("tiny"), max_batch=MAX_BATCH, max_seq_len=64, dtype=torch.float32).init_random(0)
    per_slot = collections.defaultdict(list)  # size -> the buffers of that size
    for name, buf in per_slot_buffers(decoder).items():
        per_slot[buf.numel()].append(name)
    assert any(name.endswith("attn.kv_cache") for names in per_slot.values() for name in names)
    result = fuse.inspect(decoder, tmp_path / "dump", batch=2, compilation="regional")
    code = "\n".join(g.files["output_code"].read_text() for g in result.graphs)
    whole = {numel: names for numel, names in per_slot.items() if re.search(rf"\b{numel}L?\b", code)}
    assert not whole, f"the compiled step loops over whole buffers (size: buffers): {whole}"
