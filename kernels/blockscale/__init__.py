"""Block-scaled FP8 / FP4 weights: `ref` (formats, the official act_quant, quantisers and the
plain-torch product), `op` (the custom op `v4::blockscale_linear`), `triton` (its CUDA kernel),
`gluon` (a second CUDA kernel for FP8 weights: the codes converted into the tensor-core fragments),
`gemv` (a one-row FP8 GEMV on the CUDA cores, the op's product for one row of small weights);
`device` (the Triton arithmetic of the formats) and `act_quant_pass` (the act_quant pre-pass),
which the block-scaled experts of kernels/moe use too."""
from kernels.blockscale.op import IMPLS, blockscale_linear, blockscale_linear_op
from kernels.blockscale.ref import (
    FP4_BLOCK, FP8_BLOCK, act_quant, act_quant_dequant, blockscale_linear_reference, dequantize_fp4_weight,
    dequantize_fp8_weight, dequantize_weight, quantize_fp4_weight, quantize_fp8_weight, unpack_fp4,
)

__all__ = [
    "FP4_BLOCK", "FP8_BLOCK", "IMPLS", "act_quant", "act_quant_dequant", "blockscale_linear", "blockscale_linear_op",
    "blockscale_linear_reference", "dequantize_fp4_weight", "dequantize_fp8_weight", "dequantize_weight",
    "quantize_fp4_weight", "quantize_fp8_weight", "unpack_fp4",
]
