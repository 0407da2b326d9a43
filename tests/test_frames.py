"""Frames compiled ahead (fuse/frames.py): compiled at their first call, saved, loaded back, and
named per batch shape; the artifact's use of them is in test_artifact.py."""
from __future__ import annotations

import pytest
import torch

from fuse.frames import Frames
from fuse.options import CompileOptions, dynamo_saves_frames
from fuse.step import decode_mode
from model import Decoder, ModelConfig

pytestmark = pytest.mark.skipif(not dynamo_saves_frames(), reason="this torch does not save Dynamo's frames")


def test_a_shared_batch_frame_round_trips_and_serves_every_batch():
    """batch_one_shared: the head's one frame (the batch unbacked and bounded) compiled at its
    first call serves batch 1 too; saved and loaded into new Frames it gives the eager head's
    logits without compiling."""
    decoder = Decoder(ModelConfig.preset("tiny", layers=1), max_batch=4, max_seq_len=16, dtype=torch.float32).init_random(seed=5)
    options = CompileOptions(buckets=(1, 2, 4), batch_one_shared=True)
    generator = torch.Generator().manual_seed(6)
    streams = {b: torch.randn(b, decoder.config.hc_mult, decoder.config.dim, generator=generator) for b in (3, 1, 4)}
    with decode_mode():
        frames = Frames.for_options(decoder, options)
        for b, x in streams.items():
            torch.testing.assert_close(frames.head()(x), decoder.logits(x), rtol=1e-5, atol=1e-5)
        assert frames.compiled == ["head/batch"]  # one frame for batch 1 and the rest
        assert frames.seconds["backend compile or cache load"] > 0 and frames.seconds["dynamo"] > 0
        loaded = Frames.for_options(decoder, options, frames.saved())
        for b, x in streams.items():
            torch.testing.assert_close(loaded.head()(x), decoder.logits(x), rtol=1e-5, atol=1e-5)
        assert loaded.compiled == []
        with pytest.raises(RuntimeError, match="compiled frame head/batch does not accept this call"):
            loaded.head()(torch.randn(5, decoder.config.hc_mult, decoder.config.dim))  # past the largest bucket
