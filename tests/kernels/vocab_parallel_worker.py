"""Two gloo processes: vocab-parallel cross-entropy (Triton under the interpreter, and the torch
reference) against the single-process loss and gradients. Run by test_kernels_dist.py; exits
non-zero on any mismatch."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
N, HIDDEN, V_LOCAL = 21, 24, 383  # vocab 766 over 2 ranks; 21 rows in chunks of 8


def _close(name, actual, expected, rtol=1e-5, atol=1e-5):
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"rank {dist.get_rank()}: {name}: {exc}") from None


def _run(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from autoplan import kernels
        from autoplan.kernels.cross_entropy import cross_entropy_reference
        from autoplan.kernels.modules import FusedLinearCrossEntropy

        gen = torch.Generator().manual_seed(0)  # same problem on every rank
        hidden = torch.randn(N, HIDDEN, generator=gen)
        weight = torch.randn(WORLD * V_LOCAL, HIDDEN, generator=gen) * 0.3
        target = torch.randint(0, WORLD * V_LOCAL, (N,), generator=gen)
        target[[2, 9]] = -100
        shard = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)

        h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss_ref = cross_entropy_reference(h_ref, w_ref, target)
        loss_ref.backward()

        op = kernels.get("vocab_parallel_cross_entropy")
        assert op.impl_for(hidden) == "triton", "TRITON_INTERPRET=1 must route CPU tensors to Triton"
        for impl in ("triton", "torch"):
            fn = kernels.get("vocab_parallel_cross_entropy", impl=impl)
            h, w = hidden.clone().requires_grad_(True), weight[shard].clone().requires_grad_(True)
            loss = fn(h, w, target, dist.group.WORLD, chunk_size=8)
            loss.backward()
            _close(f"{impl} loss", loss.detach(), loss_ref.detach())
            _close(f"{impl} dhidden", h.grad, h_ref.grad, rtol=1e-4, atol=1e-5)
            _close(f"{impl} dweight shard", w.grad, w_ref.grad[shard], rtol=1e-4, atol=1e-5)

            # reduce_grad_input=False: each rank keeps its partial input gradient; their sum is the full one
            h = hidden.clone().requires_grad_(True)
            fn(h, weight[shard], target, dist.group.WORLD, reduce_grad_input=False).backward()
            partial = h.grad.clone()
            dist.all_reduce(partial)
            _close(f"{impl} summed partial dhidden", partial, h_ref.grad, rtol=1e-4, atol=1e-5)

        # the module form, sum reduction
        module = FusedLinearCrossEntropy(reduction="sum", chunk_size=5, group=dist.group.WORLD)
        loss_sum = module(hidden, weight[shard], target)
        _close("module sum loss", loss_sum, cross_entropy_reference(hidden, weight, target, reduction="sum"),
               rtol=1e-5, atol=1e-4)
    finally:
        dist.destroy_process_group()
    from autoplan.runtime.train import (
        exit_process,  # a spawned child finalises like a script: see exit_process
    )

    exit_process(0)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
    print("vocab-parallel cross-entropy: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
