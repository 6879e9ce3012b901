"""Compiled CPU loops (numba, loaded on first use by :mod:`.jit`): the linear scan's run (:mod:`.chain`, its
loops in :mod:`.chain_tiles` and :mod:`.chain_narrow`, their tables in :mod:`.chain_tables`), recurrence
forwards (:mod:`.recurrence`), long-reduction products (:mod:`.nt`), the max-pool forward (:mod:`.pool`),
and their vector helpers (:mod:`.simd`) and floating-point environment (:mod:`.fpenv`)."""
