"""A compile-friendly decode-step model of DeepSeek-V4-Flash."""
from model.config import ModelConfig
from model.decoder import Decoder

__all__ = ["Decoder", "ModelConfig"]
