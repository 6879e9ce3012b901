"""Memory the plan holds and the peak of one ``backward`` call, from the symbolic plan alone."""

from __future__ import annotations

from dataclasses import dataclass

from .planning import INDEX_BYTES, ScanPlan, linear_run_kind

__all__ = ["MemoryEstimate", "estimate_memory"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, assuming every input is per sample (the worst case) and no ``extra`` terms."""

    plan_bytes: int  # pair lists and patterns kept by the plan
    values_per_sample: int  # matrix entries (inputs + products) per sample
    vectors_per_sample: int  # vector entries per sample
    temp_per_sample: int  # largest per-step temporary, per sample
    elem_bytes: int

    def backward_peak(self, batch: int) -> int:
        """Peak bytes allocated by ``backward`` for batch size ``batch`` (index tables excluded)."""
        per = self.values_per_sample + self.vectors_per_sample + self.temp_per_sample
        return batch * per * self.elem_bytes

    def total(self, batch: int) -> int:
        return self.plan_bytes + self.backward_peak(batch)


def estimate_memory(plan: ScanPlan) -> MemoryEstimate:
    mats = plan.mats
    sched = plan.schedule
    plan_bytes = sum((p.indptr.nbytes + p.indices.nbytes) for p in {id(p): p for p in plan.patterns}.values())
    values = sum(p.nnz for p in plan.patterns)
    temp = 0
    run_patterns: set[str] = set()
    for st in sched.steps:
        step_pairs = 0
        for op in st.mm:
            info = mats[op.out]
            values += info.pattern.nnz
            if info.algo == "pairs":
                # padded bins hold at most twice the pairs; two index arrays each
                plan_bytes += 2 * 2 * INDEX_BYTES * info.sym.npairs + INDEX_BYTES * info.pattern.nnz
                step_pairs += 2 * info.sym.npairs
            elif info.algo == "rows":
                # O(nnz) tables; pairs are generated per block of output rows (at most ~2**20 pairs
                # and a 2**22-entry row accumulator per sample at a time)
                plan_bytes += info.rw.index_bytes
                step_pairs += min(info.rw.npairs, 1 << 20) + min(info.pattern.rows * info.pattern.cols, 1 << 22)
            else:
                step_pairs += info.pattern.nnz
        vec = 0
        in_run = st.phase == "mid" and len(st.mv) == 1 and linear_run_kind(mats[st.mv[0].mat].pattern) == "sparse"
        for op in st.mv:
            p = mats[op.mat].pattern
            vec += p.rows
            if in_run:
                # a CSR step of a fused linear run: its pattern's tables once per distinct pattern (a long
                # RNN chain repeats a few): columns, row starts and the CPU loop's padded gather (<= 2 nnz)
                if p.key not in run_patterns:
                    run_patterns.add(p.key)
                    plan_bytes += 3 * INDEX_BYTES * p.nnz + 2 * INDEX_BYTES * (p.rows + 1)
                step_pairs += 2 * p.nnz
            elif not p.is_full:
                plan_bytes += 2 * 2 * INDEX_BYTES * p.nnz + 2 * INDEX_BYTES * p.rows
                step_pairs += 2 * p.nnz
            else:
                step_pairs += p.rows
        temp = max(temp, 2 * step_pairs)
    vectors = plan.patterns[-1].cols + sum(p.rows for p in plan.patterns)
    vectors += sum(mats[op.mat].pattern.rows for st in sched.steps for op in st.mv)
    return MemoryEstimate(int(plan_bytes), int(values), int(vectors), int(temp), plan.elem_bytes)
