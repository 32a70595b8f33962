"""The distributed self-test that `prefect-accelerate test` launches on every process.

It runs under any launcher (one process, torchrun, DeepSpeed's runner) and needs only torch;
`accelerate` is used when installed. Every check runs on every rank; rank 0 gathers the outcomes and
prints one line per check:

    [selftest] PASS <check>: <detail>
    [selftest] FAIL <check> on rank(s) <r>: <reason>

and finally `[selftest] SUCCESS ...` (exit 0) or `[selftest] FAILED ...` (exit 3).
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

PREFIX = "[selftest]"
FAILED_EXIT_CODE = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _on_cpu() -> bool:
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()


def init_group() -> str:
    backend = "gloo" if _on_cpu() else "nccl"
    timeout = datetime.timedelta(seconds=int(os.environ.get("SELFTEST_TIMEOUT", "120")))
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # a single process started without torchrun: a group of one on a private port
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return backend


def device() -> torch.device:
    return torch.device("cpu") if _on_cpu() else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


# --------------------------------------------------------------------------------------------------
# checks: each returns a detail string, or raises AssertionError with the reason


def check_ranks() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    env_rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    assert world == env_world, f"process group has {world} ranks but WORLD_SIZE is {env_world}"
    assert rank == env_rank, f"group rank {rank} but RANK is {env_rank}"
    assert 0 <= local < local_world, f"LOCAL_RANK {local} outside 0..{local_world - 1}"
    everyone = [None] * world
    dist.all_gather_object(everyone, (rank, local))
    assert sorted(r for r, _ in everyone) == list(range(world)), f"ranks seen: {everyone}"
    return f"{world} process(es), ranks 0..{world - 1} each seen once"


def check_all_reduce() -> str:
    world = dist.get_world_size()
    value = torch.tensor([float(dist.get_rank() + 1)], device=device())
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    assert value.item() == expected, f"sum {value.item()} != {expected}"
    return f"sum of 1..{world} = {expected:g}"


def check_broadcast() -> str:
    value = torch.arange(4, dtype=torch.float32, device=device()) * (dist.get_rank() + 7)
    dist.broadcast(value, src=0)
    expected = torch.arange(4, dtype=torch.float32, device=device()) * 7
    assert torch.equal(value, expected), f"got {value.tolist()}"
    return "rank 0's tensor reached every rank"


def check_all_gather() -> str:
    world = dist.get_world_size()
    mine = torch.full((2,), float(dist.get_rank()), device=device())
    gathered = [torch.empty(2, device=device()) for _ in range(world)]
    dist.all_gather(gathered, mine)
    assert [t[0].item() for t in gathered] == [float(r) for r in range(world)], [t.tolist() for t in gathered]
    return f"{world} tensors gathered in rank order"


BARRIER_LATE_SECONDS = 0.3


def check_barrier() -> str:
    # Every rank but 0 arrives late and, just before the barrier, writes an arrival key into the group's
    # rendezvous store. A barrier that lets a rank through before the others arrive leaves it looking at
    # missing keys, so this check fails instead of passing (or hanging) on a broken barrier.
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _group_store()
    if store is None:
        dist.barrier()
        return "every rank reached the barrier (arrival order not verified: no rendezvous store)"
    if rank > 0:
        time.sleep(BARRIER_LATE_SECONDS)
    store.set(f"selftest/barrier/{rank}", "arrived")
    dist.barrier()
    missing = [r for r in range(world) if not store.check([f"selftest/barrier/{r}"])]
    assert not missing, f"left the barrier before rank(s) {missing} arrived"
    if world == 1:
        return "one process: the barrier returned"
    return f"no rank left the barrier before all {world} arrived (ranks 1..{world - 1} came {BARRIER_LATE_SECONDS:g} s late)"


def _group_store():
    """The default group's key-value store, or None where this torch does not expose it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def check_rng_sync() -> str:
    world = dist.get_world_size()

    def gathered_draws() -> list:
        draw = torch.rand(3, device="cpu").to(device())
        draws = [torch.empty(3, device=device()) for _ in range(world)]
        dist.all_gather(draws, draw)
        return draws

    torch.manual_seed(1234 + dist.get_rank())  # deliberately different per rank
    state = torch.get_rng_state()
    before = gathered_draws()
    if world > 1:  # otherwise the check below would pass without any synchronisation
        assert not all(torch.equal(d, before[0]) for d in before), "ranks seeded differently drew the same numbers"
    torch.set_rng_state(state)
    shared = state.to(device())
    dist.broadcast(shared, src=0)
    torch.set_rng_state(shared.cpu())
    after = gathered_draws()
    assert all(torch.equal(d, after[0]) for d in after), "random draws differ after syncing rank 0's RNG state"
    assert torch.equal(after[0], before[0]), "the synchronised state is not rank 0's"
    return "ranks seeded apart drew apart; after broadcasting rank 0's RNG state every rank draws rank 0's numbers"


def check_sampler() -> str:
    from torch.utils.data import DistributedSampler

    world, rank = dist.get_world_size(), dist.get_rank()
    dataset = list(range(37))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=False)
    mine = list(iter(sampler))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    flat = [i for part in everyone for i in part]
    padded = len(flat) - len(dataset)
    assert set(flat) == set(dataset), "some samples were never assigned"
    assert padded < world, f"{padded} samples repeated; expected padding below {world}"
    overlap = len(flat) - len(set(flat))
    assert overlap == padded, f"{overlap} duplicated samples beyond the {padded} of padding"
    return f"{len(dataset)} samples split {len(mine)} per rank with no overlap (padding {padded})"


def check_training() -> str:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device())
    ddp = DistributedDataParallel(model) if dist.get_world_size() > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batch
    for _ in range(3):
        inputs = torch.randn(8, 4, generator=generator).to(device())
        targets = inputs.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    worst = max(float((c - copies[0]).abs().max()) for c in copies)
    assert worst == 0.0, f"weights differ across ranks by up to {worst:g}"
    return f"3 steps on different batches, identical weights on every rank (last loss {loss.item():.4f})"


def check_precision() -> str:
    mode = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mode == "no":
        return "no mixed precision requested"
    if mode == "fp8":
        import importlib.util

        found = [name for name in ("transformer_engine", "torchao") if importlib.util.find_spec(name)]
        assert found, "fp8 requested but neither transformer_engine nor torchao is installed"
        return f"fp8 backend available ({', '.join(found)})"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    where = device().type
    if where == "cuda" and mode == "bf16":
        assert torch.cuda.is_bf16_supported(), "bf16 requested but this GPU does not support it"
    with torch.autocast(device_type=where, dtype=dtype):
        out = torch.nn.Linear(4, 4).to(device())(torch.randn(2, 4, device=device()))
    assert out.dtype == dtype, f"autocast produced {out.dtype}, not {dtype}"
    return f"{mode} autocast works on {where}"


def expected_distributed_type() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "DEEPSPEED"  # DeepSpeed runs on its CPU accelerator too
    if not _on_cpu():
        for variable, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_MEGATRON_LM", "MEGATRON_LM")):
            if os.environ.get(variable, "").lower() == "true":
                return kind
    # on a CPU host Accelerate runs an FSDP or Megatron-LM config as plain MULTI_CPU (measured with 1.16.0)
    if world <= 1:
        return "NO"
    return "MULTI_CPU" if _on_cpu() else "MULTI_GPU"


def check_accelerator() -> str:
    try:
        from accelerate import Accelerator
    except ImportError:
        return "skipped: accelerate is not installed"
    accelerator = Accelerator()
    state = accelerator.state
    expected_type = expected_distributed_type()
    expected_mp = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    got_type = str(state.distributed_type).rsplit(".", 1)[-1]
    assert got_type == expected_type, f"Accelerator says {got_type}, expected {expected_type}"
    assert state.num_processes == dist.get_world_size(), f"Accelerator counts {state.num_processes} processes"
    assert str(state.mixed_precision) == expected_mp, f"Accelerator precision {state.mixed_precision}, expected {expected_mp}"
    return f"Accelerator(): {got_type}, {state.num_processes} process(es), mixed precision {state.mixed_precision}"


CHECKS = [
    ("process-group", check_ranks),
    ("all-reduce", check_all_reduce),
    ("broadcast", check_broadcast),
    ("all-gather", check_all_gather),
    ("barrier", check_barrier),
    ("rng-sync", check_rng_sync),
    ("distributed-sampler", check_sampler),
    ("training-steps", check_training),
    ("mixed-precision", check_precision),
    ("accelerator", check_accelerator),
]


def main() -> int:
    try:
        backend = init_group()
    except Exception as error:
        print(f"{PREFIX} FAIL process-group on rank {os.environ.get('RANK', '0')}: {error}", flush=True)
        return FAILED_EXIT_CODE
    rank = dist.get_rank()
    if rank == 0:
        print(f"{PREFIX} START {dist.get_world_size()} process(es), backend {backend}", flush=True)
    failures = 0
    # SELFTEST_BREAK=<rank>:<check> makes one check fail on one rank, to exercise the failure report
    broken = os.environ.get("SELFTEST_BREAK", "")
    for name, check in CHECKS:
        try:
            detail = check()
            if broken == f"{rank}:{name}":  # after the check, so its collectives still line up
                raise AssertionError("broken on purpose by SELFTEST_BREAK")
            outcome = (True, detail)
        except Exception as error:
            reason = str(error) or type(error).__name__
            if not isinstance(error, AssertionError):
                reason = f"{type(error).__name__}: {reason}"
                traceback.print_exc()
            outcome = (False, reason)
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        if rank == 0:
            bad = [r for r, (ok, _) in enumerate(outcomes) if not ok]
            if bad:
                failures += 1
                print(f"{PREFIX} FAIL {name} on rank(s) {','.join(map(str, bad))}: {outcomes[bad[0]][1]}", flush=True)
            else:
                print(f"{PREFIX} PASS {name}: {outcome[1]}", flush=True)
    failed = [False]
    if rank == 0:
        failed = [failures > 0]
    dist.broadcast_object_list(failed, src=0)
    if rank == 0:
        if failed[0]:
            print(f"{PREFIX} FAILED {failures} check(s) failed.", flush=True)
        else:
            print(f"{PREFIX} SUCCESS Test is a success! You are ready for your distributed training!", flush=True)
    dist.barrier()
    # the training check's DDP module lives on in reference cycles; freed at interpreter shutdown, after the
    # group, gloo's destructors aborted the process now and then (SIGABRT, 2 runs in 15 on a loaded machine).
    # Collected here, while the group is alive: 0 in 50.
    gc.collect()
    dist.destroy_process_group()
    return FAILED_EXIT_CODE if failed[0] else 0


if __name__ == "__main__":
    sys.exit(main())
