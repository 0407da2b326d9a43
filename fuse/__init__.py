"""fuse: a torch.compile fusion layer for the decode path of DeepSeek-V4-Flash-class models."""
from fuse.inspection import Inspection
from fuse.options import CompileOptions
from fuse.runner import DecodeRunner, compile_decode, inspect
from fuse.stats import RunnerStats

__all__ = ["CompileOptions", "DecodeRunner", "Inspection", "RunnerStats", "compile_decode", "inspect"]
