"""GPU benchmarks of the decode kernels, one module per op, run as `python -m kernels.bench`.

`timing` is the one place for CUDA-event and CUDA-graph timing, `tables` writes the markdown,
`resource_usage` compiles the sparse-MLA kernels for sm_90 offline (no GPU needed)."""
