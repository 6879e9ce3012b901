"""Triton kernels and their launchers (:mod:`.backend` runs a lowered program with them; launch parameters
in :mod:`.launch` only; :mod:`.aot` compiles recorded launches for CUDA targets without a GPU)."""
