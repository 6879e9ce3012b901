"""Numeric kernels: the run-time half of every planned product.

Two backends run a lowered :class:`~spscan.planner.program.Program`:

* :mod:`.torch_ops` — vectorized gather-multiply-segment-sum with torch ops (CPU default,
  reference for the Triton kernels);
* :mod:`.triton_backend` — Triton kernels, one launch per scan step per primitive:
  :mod:`.spgemm` (numeric SpGEMM from planned pair lists), :mod:`.spmv` (batched ``J^T g`` with
  the affine term), :mod:`.gemm` / :mod:`.gemv` (batched small dense nodes, ``tl.dot`` from 16),
  :mod:`.linear_run` (the linear-scan middle as one persistent launch).

Launch parameters come from :mod:`.launch` only (``allow_tf32`` lives there too);
:mod:`.segments` lays out a step's segments long-first; :mod:`.aot` compiles recorded
launches for CUDA targets without a GPU. :mod:`.chain` holds torch products used outside a scan.
"""
