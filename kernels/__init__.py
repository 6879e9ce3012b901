"""Numeric kernels: the run-time half of every planned product.

The backend interface is :mod:`.backend`; :mod:`.registry` finds a backend by name. Two backends
run a lowered :class:`~spscan.planner.program.Program`:

* :mod:`.torch_ops` — vectorized gather-multiply-segment-sum with torch ops (CPU default,
  reference for the Triton kernels), with :mod:`.spgemm_rows_torch` (row-wise SpGEMM) and
  :mod:`.cpu_chain` (the linear-scan middle as one compiled loop, numba, over the fixed-width
  vectors of :mod:`.cpu_simd`: the loop in :mod:`.cpu_chain_tiles`, its tables in
  :mod:`.cpu_chain_tables`);
* :mod:`.triton_backend` — Triton kernels, one launch per scan step per primitive:
  :mod:`.spgemm` / :mod:`.spgemm_rows` (numeric SpGEMM from planned pair lists or row patterns),
  :mod:`.spmv` (batched ``J^T g`` with the affine term), :mod:`.gemm` / :mod:`.gemv` (batched
  small dense nodes, ``tl.dot`` from 16), :mod:`.linear_run` (the linear-scan middle as one
  persistent launch, or in chunks for long uniform runs).

Launch parameters come from :mod:`.launch` only (``dot_precision`` lives there too);
:mod:`.segments` lays out a step's segments long-first; :mod:`.aot` compiles recorded
launches for CUDA targets without a GPU.

Compiled CPU loops that front ends call directly, always through :data:`.backend.cpu_ops`:
:mod:`.cpu_recurrence` (recurrence forwards that also write the chain's values; loops in
:mod:`.cpu_recurrence_loops`, their inlined pieces in :mod:`.cpu_recurrence_steps`),
:mod:`.cpu_nt` (long-reduction products ``A Z^T``: weight gradients) and :mod:`.cpu_pool` (the
max-pool forward). :mod:`.cpu_numba` imports numba on first use for all of them.
"""
