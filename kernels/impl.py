"""The `impl` argument every op takes, one vocabulary for all: "auto" (the custom op, which picks
the implementation for the device and shapes), "reference" (the plain-torch reference), "triton"
(the Triton path directly, e.g. on a CPU under TRITON_INTERPRET=1), then an op's own named
variants where it has several (each op's IMPLS)."""
from __future__ import annotations

COMMON_IMPLS = ("auto", "reference", "triton")


def check_impl(op: str, impl: str, impls: tuple[str, ...]) -> None:
    """Raise ValueError naming the op and the values it takes unless impl is one of them."""
    if impl not in impls:
        raise ValueError(f"{op}: impl must be one of {impls}, got {impl!r}")
