"""Without CUDA, Triton kernels run only in Triton's interpreter, which is chosen when triton is
first imported: turn it on before any test module (or what it imports) loads triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
