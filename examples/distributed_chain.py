"""Model-parallel BPPSA: one slice of a chain per process, gradients by a ceil(log2 p)-round scan.

Every process plans the whole chain (patterns only; deterministic, so all ranks agree), owns a
contiguous slice of layers balanced by FLOPs, fills the values of its own transposed Jacobians,
and calls :func:`spscan.distributed.backward`, which exchanges only CSR values of the planned
composites. Rank 0 prints the slices, the per-step time and each rank's communication.

Usage (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT):

    # several GPUs on one host (NCCL, one GPU per process)
    torchrun --standalone --nproc_per_node=4 examples/distributed_chain.py --backend nccl --layers 64 --width 1024

    # several hosts, 8 GPUs each: run the same line on every host
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=bppsa --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST0:29500 examples/distributed_chain.py --backend nccl --layers 256

    # CPU processes (Gloo), e.g. to try it on a laptop
    torchrun --standalone --nproc_per_node=2 examples/distributed_chain.py --backend gloo --check

    # an nn.Sequential cut into slices by FLOPs (every rank runs this small model's forward
    # for the demo and keeps its own layers' Jacobians)
    torchrun --standalone --nproc_per_node=2 examples/distributed_chain.py --model mlp --check

Options: ``--backend {auto,nccl,gloo}`` (nccl refuses without GPUs; auto: NCCL when CUDA is available,
else Gloo, saying so), ``--kernels
{auto,torch,triton}`` (the local scan backend), ``--batch``, ``--steps``, ``--dtype``,
``--check`` (compare each rank's gradients with the float64 reference; small chains only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

import spscan
import spscan.distributed as sd
from spscan.reference import reference_backward


def conv1d_chain(layers: int, width: int, taps: int = 5) -> list[sp.csr_array]:
    """Transposed Jacobians of a stack of 1-D convolutions with ``taps`` taps (banded, ``width`` wide)."""
    half = taps // 2
    band = sp.diags([np.ones(width - abs(o)) for o in range(-half, half + 1)], list(range(-half, half + 1)),
                    shape=(width, width), format="csr")
    band = sp.csr_array(band)
    band.sort_indices()
    return [band] * layers


def layer_values(pattern: sp.csr_array, layer: int, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Values of ``J_layer^T`` for the demo: seeded by the layer index, so only the owner makes them."""
    g = torch.Generator().manual_seed(1000 + layer)
    v = torch.randn(batch, pattern.nnz, generator=g, dtype=torch.float64) / np.sqrt(pattern.nnz / pattern.shape[0])
    return v.to(dtype=dtype, device=device)


def mlp(width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    ap.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--model", choices=["conv1d", "mlp"], default="conv1d")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    backend = args.backend
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs CUDA GPUs (one per process) and this machine has none; "
                         "run CPU processes with --backend gloo")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "gloo" and int(os.environ.get("RANK", 0)) == 0:
            print("distributed_chain: no CUDA device, so the ranks are CPU processes over Gloo "
                  "(--backend nccl refuses instead)", file=sys.stderr, flush=True)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    rank, p = dist.get_rank(), dist.get_world_size()
    dtype = torch.float64 if args.dtype == "float64" else torch.float32

    try:
        if args.model == "mlp":
            # plan the model once for its patterns; the full forward here only feeds the demo
            model = mlp(args.width).to(dtype)
            x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0)).to(dtype)
            mplan = spscan.plan(model, x, levels=0, backend="torch")
            patterns = mplan.patterns
            _, jac = spscan.forward(mplan, x)
            all_values = [v.to(device) for v in jac]
            names = mplan.layer_names
        else:
            patterns = conv1d_chain(args.layers, args.width)
            all_values = None
            names = [f"conv{i}" for i in range(len(patterns))]

        bounds = sd.balanced_slices(patterns, p)
        dplan = sd.plan(patterns, p, slices=bounds, rank=rank, backend=args.kernels, device=device, dtype=dtype)
        lo, hi = dplan.slices[rank]
        if all_values is not None:
            mine = all_values[lo:hi]
        else:
            mine = [layer_values(patterns[i], i, args.batch, dtype, device) for i in range(lo, hi)]
        d_n = dplan.dims[-1]
        grad = torch.randn(args.batch, d_n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        grad = grad.to(dtype=dtype, device=device) if rank == p - 1 else None
        if rank == 0:
            print(f"{p} ranks ({backend}), {dplan.n} Jacobians, {dplan.rounds} rounds per backward")
            for r, (a, b) in enumerate(dplan.slices):
                print(f"  rank {r}: layers {a + 1}..{b} ({names[a]} .. {names[b - 1]})")

        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            grads = sd.backward(dplan, mine, grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        st = grads.stats
        line = (f"rank {rank:>2}: dl/dx_{grads.start}..dl/dx_{grads.stop - 1}, rounds {st.rounds}, "
                f"sent {st.bytes_sent} B in {st.messages_sent} msgs (planned {st.planned_bytes_sent} B), "
                f"received {st.bytes_received} B")
        if args.check:
            ref_vals = all_values if all_values is not None else [
                layer_values(patterns[i], i, args.batch, dtype, "cpu") for i in range(len(patterns))]
            g_full = torch.randn(args.batch, d_n, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            ref = reference_backward(patterns, [v.cpu() for v in ref_vals], g_full.to(dtype))
            err = max(float((a.cpu().double() - b).abs().max() / b.abs().max().clamp_min(1e-300))
                      for a, b in zip(grads, ref[lo: hi + 1]))
            line += f", max rel. error vs float64 reference {err:.2e}"
        lines = [None] * p
        dist.all_gather_object(lines, line)
        if rank == 0:
            print("\n".join(lines))
            print(f"backward: median {1e3 * float(np.median(times)):.3f} ms over {args.steps} steps")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
