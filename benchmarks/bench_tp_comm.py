"""Tensor parallel's communication costs: the all-reduce at decode sizes, and the step plan.

    python -m benchmarks.bench_tp_comm [--world N] [--hidden 4096]

* All-reduce (GPU, one process per GPU, ``--world`` of them, default all visible): the latency of
  one all-reduce of ``[batch, hidden]`` bf16 for decode batches 1..256 (the peer paths' kernels
  have no fp16), through
  ``torch.distributed`` (NCCL) and through the peer-read paths (``engine/peer_all_reduce.py``:
  one_shot, two_shot; their sums checked against NCCL's), each eagerly and replayed inside a
  CUDA graph (100 captured back to back, the way the decode graphs hold them), and with
  ``--cupy`` through cupy's NCCL bindings eagerly. The engine uses ``torch.distributed`` unless
  ``EngineConfig.tp_all_reduce`` picks a peer path for small tensors. Also the layer's tail both
  ways: NCCL's all-reduce then the residual add + RMSNorm, against ``tp_all_reduce="fused"``'s one
  kernel (``kernels/peer_norm.py``), checked to give the same bits. Rank 0 prints each batch's row
  as soon as it is measured.
* Step plan (CPU): what rank 0 pays per step to hand a decode plan of ``batch`` sequences to
  another rank: msgpack encode + ZeroMQ ipc send + receive + decode, measured as half a
  ping-pong round trip between two processes; against the same bytes sent by a gloo broadcast
  (length, then payload: two collectives). An NCCL broadcast is not a candidate: the rank would
  have to copy the plan back to the host, a sync that stalls it until its GPU drains.

Prints a table and saves one record per case (``bench_tp_comm_w<world>``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

BATCHES = (1, 8, 32, 64, 128, 256)
# bf16: torch's symmetric-memory kernels (the peer paths) have no fp16; NCCL costs the same per byte.
DTYPE = torch.bfloat16


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, queue, with_cupy: bool) -> None:
    import torch.distributed as dist

    from benchmarks.common import cuda_time_us

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    comm = None
    try:
        if not with_cupy:
            raise RuntimeError("not asked for (--cupy)")
        from cupy.cuda import nccl

        uid = nccl.get_unique_id() if rank == 0 else None
        box = [uid]
        dist.broadcast_object_list(box, src=0)
        comm = nccl.NcclCommunicator(world, box[0], rank)
    except Exception as exc:  # noqa: BLE001 - cupy's NCCL is optional here
        comm = None
        if rank == 0 and with_cupy:
            print(f"cupy NCCL unavailable: {exc}")
    peers = {}
    for kind in ("one_shot", "two_shot"):
        try:
            from conveyor.engine.peer_all_reduce import PeerAllReduce

            peers[kind] = PeerAllReduce(kind, dist.group.WORLD, dev)
        except Exception as exc:  # noqa: BLE001 - report, time the rest
            if rank == 0:
                print(f"{kind} peer all-reduce unavailable: {type(exc).__name__}: {exc}", flush=True)

    fused = None
    try:
        from conveyor.engine.peer_all_reduce import FusedNormAllReduce

        fused = FusedNormAllReduce(dist.group.WORLD, dev, max_rows=256)  # past the engine's limit: the crossover
    except Exception as exc:  # noqa: BLE001 - report, time the rest
        if rank == 0:
            print(f"fused all-reduce + norm unavailable: {type(exc).__name__}: {exc}", flush=True)

    def timed(all_reduce, x):
        """(eager µs, µs each of 100 replayed from one CUDA graph) of ``all_reduce(x)``."""
        for _ in range(20):
            all_reduce(x)
        eager = cuda_time_us(lambda: all_reduce(x), 1, calls=200)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(100):
                all_reduce(x)
        graph.replay()
        return eager, cuda_time_us(graph.replay, 1, calls=10) / 100

    for batch in BATCHES:
        x = torch.randn(batch, hidden, dtype=DTYPE, device=dev)
        row = dict(batch=batch, bytes=x.numel() * 2)
        row["torch_eager_us"], row["torch_graph_us"] = timed(lambda t: dist.all_reduce(t), x)
        for kind, peer in peers.items():
            if not peer.fits(x):
                continue
            # The same sum as NCCL's, within bf16 rounding of a different order of adds.
            a = torch.randn(batch, hidden, dtype=DTYPE, device=dev)
            want = a.clone()
            dist.all_reduce(want)
            got = peer(a.clone())  # the returned tensor holds the sum (one_shot leaves its input)
            row[f"{kind}_max_err"] = float((got.float() - want.float()).abs().max())
            row[f"{kind}_eager_us"], row[f"{kind}_graph_us"] = timed(peer, x)
        if fused is not None and fused.fits(x):
            _time_fused(fused, x, row, timed)
        row["cupy_eager_us"] = None
        if comm is not None:
            s = torch.cuda.current_stream().cuda_stream

            bf16 = getattr(nccl, "NCCL_BFLOAT16", 9)  # ncclBfloat16 in nccl.h, for a cupy without the name

            def cupy_allreduce():
                comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), bf16, nccl.NCCL_SUM, s)

            for _ in range(20):
                cupy_allreduce()
            row["cupy_eager_us"] = cuda_time_us(cupy_allreduce, 1, calls=200)
        if rank == 0:  # each row as soon as measured: a hang later loses nothing
            queue.put(row)
    if rank == 0:
        queue.put(None)
    dist.barrier()
    from conveyor.engine.distributed import abort_tp

    abort_tp()  # NCCL's collective destroy can wait forever (engine/distributed.close_tp)


def _time_fused(fused, x: torch.Tensor, row: dict, timed) -> None:
    """The layer's tail both ways: NCCL's all-reduce then ``add_rms_norm`` (two launches), and
    the fused kernel (``FusedNormAllReduce``: the part staged into a slot, then one kernel). Both
    give the same bits (checked); consecutive fused calls alternate two slots, as the engine's ring."""
    import torch.distributed as dist

    from conveyor.kernels import add_rms_norm

    gen = torch.Generator(device=x.device).manual_seed(int(x.shape[0]))
    residual = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=gen)
    weight = 1 + 0.1 * torch.randn(x.shape[-1], dtype=x.dtype, device=x.device, generator=gen)
    calls = [0]

    def nccl_then_norm(t):
        dist.all_reduce(t)
        return add_rms_norm(t, residual, weight, 1e-5)

    def fused_norm(t):
        calls[0] += 1
        return fused.add_rms_norm(fused.stage(calls[0] % 2, t), residual, weight, 1e-5)

    part = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=gen)
    want = nccl_then_norm(part.clone())
    got = fused_norm(part.clone())
    row["fused_same_bits"] = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    row["nccl_norm_eager_us"], row["nccl_norm_graph_us"] = timed(nccl_then_norm, x)
    row["fused_norm_eager_us"], row["fused_norm_graph_us"] = timed(fused_norm, x)


def _plan_echo(address: str) -> None:
    import zmq

    from conveyor.protocol.codec import Codec
    from conveyor.protocol.tp import RankIn

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    codec = Codec(RankIn)
    while True:
        plan = codec.recv(sock)
        sock.send(b"")
        if plan.kind == 3:
            break


def _decode_plan(batch: int):
    """A decode step's plan for ``batch`` sequences of ~1k tokens (64-token blocks), as rank 0 sends it."""
    from conveyor.protocol.tp import StepKind, StepPlan

    return StepPlan(StepKind.GRAPH, input_ids=list(range(batch)), positions=[1000 + i for i in range(batch)],
                    block_tables=[list(range(i * 40, i * 40 + 16)) for i in range(batch)],
                    pending=[(i, i) for i in range(batch)], logit_rows=list(range(batch)), num_sampled=batch)


def plan_cost_us(batch: int, iters: int = 2000) -> float:
    """Half a round trip: encode a decode plan of ``batch`` sequences, send it over ipc, the other
    process decodes it and answers with an empty frame."""
    import zmq

    from conveyor.protocol.codec import Codec
    from conveyor.protocol.tp import RankIn, StepKind, StepPlan

    path = tempfile.mkdtemp(prefix="conveyor-plan-")
    address = f"ipc://{path}/plan"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    echo = mp.get_context("spawn").Process(target=_plan_echo, args=(address,), daemon=True)
    echo.start()
    codec = Codec(RankIn)
    plan = _decode_plan(batch)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        codec.send(sock, plan)
        sock.recv()
        times.append(time.perf_counter() - t)
    codec.send(sock, StepPlan(StepKind.STOP))
    sock.recv()
    echo.join(5)
    sock.close(linger=0)
    ctx.term()
    return statistics.median(times[iters // 10:]) * 1e6 / 2


def _gloo_echo(rank: int, port: int, rounds: int) -> None:
    import torch.distributed as dist

    from conveyor.protocol.codec import Codec
    from conveyor.protocol.tp import RankIn

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    codec = Codec(RankIn)
    size = torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        dist.broadcast(size, 0)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, 0)
        codec.decode(payload.numpy().tobytes())
        dist.broadcast(size, 1)  # the answer, as the ipc ping-pong's empty frame
    dist.destroy_process_group()


def gloo_plan_cost_us(batch: int, iters: int = 1000) -> float:
    """The same plan as ``plan_cost_us`` sent by gloo broadcasts (size, payload), half a round trip."""
    import torch.distributed as dist

    from conveyor.protocol.addresses import free_port
    from conveyor.protocol.codec import Codec
    from conveyor.protocol.tp import RankIn

    port = free_port()
    peer = mp.get_context("spawn").Process(target=_gloo_echo, args=(1, port, iters), daemon=True)
    peer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    codec = Codec(RankIn)
    plan = _decode_plan(batch)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        data = torch.frombuffer(bytearray(codec.encode(plan)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0)
        dist.broadcast(data, 0)
        dist.broadcast(torch.zeros(1, dtype=torch.int64), 1)
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    peer.join(10)
    return statistics.median(times[iters // 10:]) * 1e6 / 2


def main() -> None:
    from benchmarks.common import record, save
    from conveyor.protocol.addresses import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=None, help="GPUs (default: all visible; 0: skip the all-reduce)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--name", default=None)
    ap.add_argument("--cupy", action="store_true", help="also time cupy's NCCL bindings (eager)")
    args = ap.parse_args()
    world = args.world if args.world is not None else torch.cuda.device_count()
    records = []
    for batch in BATCHES:
        us, gloo_us = plan_cost_us(batch), gloo_plan_cost_us(batch)
        print(f"step plan, batch {batch:4d}: ZeroMQ ipc {us:7.1f} us, gloo broadcast {gloo_us:7.1f} us "
              "(encode + send + decode, one way)")
        records.append(record(benchmark="tp_step_plan", batch=batch, latency_us=us, gloo_latency_us=gloo_us,
                              tp=world or 1))
    if world:
        spawn = mp.get_context("spawn")
        queue = spawn.Queue()
        port = free_port()
        procs = [spawn.Process(target=_allreduce_rank, daemon=True,
                               args=(r, world, port, args.hidden, queue, args.cupy)) for r in range(world)]
        for p in procs:
            p.start()
        print(f"all-reduce over {world} GPU(s), [batch, {args.hidden}] bf16, µs eager / in a CUDA graph: NCCL "
              "(torch.distributed), one_shot and two_shot (peer reads, max |error| against NCCL), cupy eager",
              flush=True)
        while (row := queue.get(timeout=300)) is not None:
            cells = [f"NCCL {row['torch_eager_us']:6.1f} / {row['torch_graph_us']:6.1f}"]
            for kind in ("one_shot", "two_shot"):
                if f"{kind}_graph_us" in row:
                    cells.append(f"{kind} {row[f'{kind}_eager_us']:6.1f} / {row[f'{kind}_graph_us']:6.1f} "
                                 f"(err {row[f'{kind}_max_err']:.3g})")
            if "fused_norm_graph_us" in row:
                cells.append(f"NCCL+norm {row['nccl_norm_eager_us']:6.1f} / {row['nccl_norm_graph_us']:6.1f}, "
                             f"fused {row['fused_norm_eager_us']:6.1f} / {row['fused_norm_graph_us']:6.1f}"
                             f"{'' if row['fused_same_bits'] else ' (DIFFERENT BITS)'}")
            if row["cupy_eager_us"] is not None:
                cells.append(f"cupy {row['cupy_eager_us']:6.1f}")
            print(f"  batch {row['batch']:4d} ({row['bytes'] / 1024:7.1f} KiB): " + "; ".join(cells), flush=True)
            records.append(record(benchmark="tp_allreduce", tp=world, model_format="hf", **row))
        for p in procs:
            p.join(30)
            if p.is_alive():
                print(f"all-reduce rank (pid {p.pid}) still running 30 s after the last row: killed")
                p.kill()
    save(records, args.name or f"bench_tp_comm_w{world}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device notes: leave NVLink multicast off
    main()
