"""The decode step traces as one graph (no graph break) and compiles for the CPU."""
from __future__ import annotations

import torch

from model import Decoder, ModelConfig


def test_whole_step_compiles_without_graph_break():
    cfg = ModelConfig.preset("tiny")
    eager = Decoder(cfg, max_batch=3, max_seq_len=160, dtype=torch.float32).init_random(seed=5)
    compiled_model = Decoder(cfg, max_batch=3, max_seq_len=160, dtype=torch.float32)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)  # a graph break raises
    generator = torch.Generator().manual_seed(0)
    for p in range(6):  # different positions per sequence; crosses a ratio-4 boundary
        tokens = torch.randint(0, cfg.vocab_size, (3,), generator=generator)
        positions = torch.tensor([p, p + 2, 3 * p])
        slots = torch.tensor([2, 0, 1])
        expected = eager(tokens, positions, slots)
        actual = compiled(tokens, positions, slots)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(dict(compiled_model.named_buffers())[name], buf, rtol=1e-4, atol=1e-4)
