"""What a run hands back: the gradients (or a reduction's composite) as views of one buffer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import torch

from spscan.planner.program import Program

__all__ = ["Gradients", "ScanResult"]


class ScanResult:
    """The output of one :meth:`~spscan.runtime.BoundPlan.run`.

    For a scan: ``result[i]`` is ``dl/dx_i`` ``(B, d_i)``, ``result.grads`` the contract's list of
    ``n+1`` tensors, ``result.stacked(idx)`` a ``(len(idx), B, d)`` block of equally sized
    gradients (a strided view where the engine wrote them evenly spaced). For a reduction:
    ``result.composite`` (the composite matrix's values, ``(nnz,)`` or ``(B, nnz)``, in the order
    of the plan's ``composite_pattern``) and ``result.composite_vector`` (its affine term
    ``(B, d_0)`` or ``None``). Every tensor views storage owned by the result, unless the run was
    made with ``scratch=True``: then they view the bound plan's working buffer, valid until its
    next run.
    """

    def __init__(self, vectors: torch.Tensor, program: Program, composite: Optional[torch.Tensor] = None,
                 index_cache: Optional[dict] = None, kept: Optional[Sequence[bool]] = None) -> None:
        self._vectors = vectors
        self._program = program
        self._kept = None if kept is None else np.asarray(kept, dtype=bool)  # None: every gradient (run(keep=...))
        # the bound plan's: device column indices of irregular ``stacked`` blocks, uploaded once
        self._index_cache = {} if index_cache is None else index_cache
        self._grads: Optional[list[torch.Tensor]] = None
        self.composite = composite

    def __len__(self) -> int:
        return len(self._program.outputs)

    def __getitem__(self, i: int) -> torch.Tensor:
        off, d = self._program.outputs[i]
        if off < 0:
            raise ValueError(f"dl/dx_{i} was not computed: the plan was bound without it (first_output=False)")
        if self._kept is not None and not self._kept[i]:
            raise ValueError(f"dl/dx_{i} was not kept: the run was asked for others only (keep=...)")
        return self._vectors[:, off : off + d]

    @property
    def grads(self) -> list[torch.Tensor]:
        """``[dl/dx_0, ..., dl/dx_n]`` as views made by one ``tensor_split`` (cheap for long chains);
        ``None`` where not computed (bound without ``dl/dx_0``) or not kept (``run(keep=...)``)."""
        if self._grads is None:
            cuts, pick = self._program.output_split
            pieces = self._vectors.tensor_split(cuts, dim=1)
            kept = self._kept
            self._grads = [pieces[k] if k >= 0 and (kept is None or kept[i]) else None for i, k in enumerate(pick)]
        return list(self._grads)

    def stacked(self, idx: range, copy: bool = False) -> torch.Tensor:
        """``(len(idx), B, d)`` for chain indices whose gradients all have size ``d``.

        The linear scan writes its outputs at evenly spaced offsets, so this is usually one
        strided view (no copy; a reversed run: one copy); otherwise one gather of the columns.
        ``copy=True`` always returns a new, contiguous tensor (one copy, two after a gather).
        The layout of each ``idx`` is worked out once per bound plan (and its gather indices
        uploaded once), so a repeated call does no host work proportional to ``len(idx)``.
        """
        if self._kept is not None and not self._kept[np.arange(idx.start, idx.stop, idx.step)].all():
            raise ValueError(f"stacked: some gradients at {idx} were not kept (keep=...)")
        key = (idx.start, idx.stop, idx.step)
        layout = self._index_cache.get(key)
        if layout is None:
            layout = self._index_cache[key] = self._stacked_layout(idx)
        v = self._vectors
        if layout[0] == "view":
            _, count, first, step, d = layout
            view = v.as_strided((count, v.shape[0], d), (abs(step) * v.stride(1), v.stride(0), v.stride(1)),
                                v.storage_offset() + first * v.stride(1))
            if step < 0:
                # flip copies; with copy=True the copy is contiguous (a plain flip keeps the batch-major
                # layout of the view, and a reshape of it would copy again)
                if copy:
                    return view.index_select(0, torch.arange(count - 1, -1, -1, device=v.device))
                return view.flip(0)
            return view.clone(memory_format=torch.contiguous_format) if copy else view
        # irregular offsets: one gather of all the columns ((B, K*d), the batch outermost), not K slices
        _, count, cols, d = layout
        out = v.index_select(1, cols).view(v.shape[0], count, d).transpose(0, 1)
        return out.contiguous() if copy else out

    def _stacked_layout(self, idx: range) -> tuple:
        """``("view", K, first, step, d)`` for evenly spaced outputs, else ``("gather", K, cols, d)``."""
        outs = self._program.outputs
        offs = np.fromiter((outs[i][0] for i in idx), dtype=np.int64, count=len(idx))
        dims = {outs[i][1] for i in idx}
        if len(dims) != 1:
            raise ValueError(f"stacked: the gradients at {idx} have different sizes {sorted(dims)}")
        d = dims.pop()
        if offs.size > 1:
            step = int(offs[1] - offs[0])
            if step != 0 and abs(step) >= d and bool(np.all(np.diff(offs) == step)):
                return ("view", int(offs.size), int(offs.min()), step, d)
        cols = torch.as_tensor((offs[:, None] + np.arange(d)).reshape(-1), device=self._vectors.device)
        return ("gather", int(offs.size), cols, d)

    @property
    def composite_vector(self) -> Optional[torch.Tensor]:
        root = self._program.root_vec
        if root is None:
            return None
        off, d = root
        return self._vectors[:, off : off + d]


class _ListResult(ScanResult):
    """A :class:`ScanResult` whose gradients are separate tensors (a linear scan of structured operators)."""

    def __init__(self, grads: list[Optional[torch.Tensor]]) -> None:
        self._list = grads
        self.composite = None

    def __len__(self) -> int:
        return len(self._list)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = self._list[i]
        if g is None:
            raise ValueError(f"dl/dx_{i} was not computed: the plan was bound without it (first_output=False)")
        return g

    @property
    def grads(self) -> list[torch.Tensor]:
        return list(self._list)

    def stacked(self, idx: range, copy: bool = False) -> torch.Tensor:
        return torch.stack([self[i] for i in idx])

    @property
    def composite_vector(self) -> Optional[torch.Tensor]:
        return None


class Gradients(Sequence):
    """``[dl/dx_0, ..., dl/dx_n]`` of one run, as views of the buffer the run wrote (what
    :func:`spscan.backward` returns).

    A sequence (``len``, indexing, negative indices, slices, iteration) that makes a tensor only for the
    element asked for, so a chain of tens of thousands of layers costs the scan, not one tensor object
    per layer. ``grads[i]`` is ``(B, d_i)``; :meth:`stacked` gives all of them as one ``(n+1, B, d)``
    tensor when every ``d_i`` is equal (a strided view where the engine wrote them evenly spaced).
    ``list(grads)`` makes the plain list (``torch.stack`` takes lists and tuples only:
    ``torch.stack(list(grads))``, or ``grads.stacked()`` without the per-element tensors).
    """

    __slots__ = ("_result", "_n")

    def __init__(self, result: ScanResult) -> None:
        self._result = result
        self._n = len(result)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._result[j] for j in range(*i.indices(self._n))]
        try:
            k = i.__index__()
        except AttributeError:
            raise TypeError(f"gradient indices must be integers or slices, not {type(i).__name__}") from None
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(f"gradient index {i} out of range for {self._n} gradients (dl/dx_0 .. dl/dx_{self._n - 1})")
        return self._result[k]

    def __iter__(self) -> Iterator[torch.Tensor]:
        result = self._result
        return (result[k] for k in range(self._n))

    def stacked(self, copy: bool = False) -> torch.Tensor:
        """All ``n+1`` gradients as one ``(n+1, B, d)`` tensor (every ``d_i`` must be equal); a view of the
        run's buffer where it can be, a new contiguous tensor with ``copy=True``."""
        return self._result.stacked(range(self._n), copy=copy)

    def __repr__(self) -> str:
        return f"Gradients(n+1={self._n}: dl/dx_0 .. dl/dx_{self._n - 1} as views of one buffer)"
