"""Numeric kernels: the run-time half of every planned product.

The backend interface is :mod:`.backend`; :mod:`.registry` finds a backend by name. Two backends
run a lowered :class:`~spscan.planner.program.Program`:

* :mod:`.torch_ops` — vectorized gather-multiply-segment-sum with torch ops (CPU default,
  reference for the Triton kernels), with :mod:`.spgemm_rows_torch` (row-wise SpGEMM) and
  :mod:`.cpu.chain` (the linear-scan middle as one compiled loop, numba, over the fixed-width
  vectors of :mod:`.cpu.simd`: the loops in :mod:`.cpu.chain_tiles` and :mod:`.cpu.chain_narrow`, their
  tables in :mod:`.cpu.chain_tables`);
* :mod:`.triton.backend` — Triton kernels, one launch per scan step per primitive:
  :mod:`.triton.spgemm` / :mod:`.triton.spgemm_rows` (numeric SpGEMM from planned pair lists or row
  patterns), :mod:`.triton.spmv` (batched ``J^T g`` with the affine term), :mod:`.triton.gemm` /
  :mod:`.triton.gemv` (batched small dense nodes, ``tl.dot`` from 16), :mod:`.triton.linear_run` (the
  linear-scan middle as one persistent launch, or in chunks for long uniform runs), and
  :mod:`.triton.recurrence` (the structured-recurrence scan).

Launch parameters come from :mod:`.triton.launch` only (``dot_precision`` lives there too);
:mod:`.triton.segments` lays out a step's segments long-first; :mod:`.triton.aot` compiles recorded
launches for CUDA targets without a GPU.

Compiled CPU loops that front ends call directly, always through :data:`.backend.cpu_ops`:
:mod:`.cpu.recurrence` (recurrence forwards that also write the chain's values; loops in
:mod:`.cpu.recurrence_loops`, their inlined pieces in :mod:`.cpu.recurrence_steps`),
:mod:`.cpu.nt` (long-reduction products ``A Z^T``: weight gradients) and :mod:`.cpu.pool` (the
max-pool forward). :mod:`.cpu.jit` imports numba on first use for all of them.
"""
