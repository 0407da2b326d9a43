"""The MoE gate: `ref` (the plain-torch reference and input checks), `triton` (the CUDA kernel),
`op` (the custom op `v4::moe_gate` and the choice of implementation)."""
from kernels.gate.op import IMPLS, MAX_ROWS, moe_gate, moe_gate_op
from kernels.gate.ref import moe_gate_reference

__all__ = ["IMPLS", "MAX_ROWS", "moe_gate", "moe_gate_op", "moe_gate_reference"]
