"""fuse: a torch.compile fusion layer for the decode path of DeepSeek-V4-Flash-class models."""
from fuse.runner import CompileOptions, DecodeRunner, RunnerStats, compile_decode
from fuse.inspect import inspect

__all__ = ["CompileOptions", "DecodeRunner", "RunnerStats", "compile_decode", "inspect"]
