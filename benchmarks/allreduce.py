"""All-reduce benchmark: one payload among N local peers (one process each, 1 torch thread) through
swarmtrain's butterfly (fp32 / fp16 / int8 over the bulk TCP port; fp32 over gRPC streams as
"ours-grpc"; both again with rpc.tls as "ours-tls" and "ours-grpc-tls"), hivemind's DecentralizedAverager
and torch.distributed gloo all_reduce, arms interleaved and repeated; prints seconds, effective GB/s,
bytes sent and ratios.

    python benchmarks/allreduce.py --numel 25000000 100000000 --peers 2 4 --repeats 3

Timing: every arm's peers wait at a barrier (the parent), then each times one averaging of its
payload; a round takes the slowest peer's time. hivemind is timed from `allow_allreduce()` (after its
matchmaking), gloo around `all_reduce` + the division. Effective GB/s = payload bytes / seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("ours", "ours-fp16", "ours-int8", "ours-grpc", "ours-tls", "ours-grpc-tls", "hivemind", "gloo")


def payload(rank: int, numel: int) -> torch.Tensor:
    """A deterministic, cheap-to-recompute payload (so any slice's expected mean is known)."""
    k = torch.arange(numel, dtype=torch.float64)
    return (torch.remainder(k * (rank + 7), 1000.0) / 1000.0 - 0.5).float()


def expected_head(world: int, head: int) -> torch.Tensor:
    return torch.stack([payload(r, head) for r in range(world)]).mean(0)


# ---------------------------------------------------------------------------------- worker side


def _say(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def _wait_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"worker: expected GO, got {line!r}")


def _rounds(args: argparse.Namespace, one_round: Any, prepare: Any = None) -> None:
    for r in range(args.warmup + args.repeats):
        if prepare is not None:
            prepare()
        _say("WAIT", round=r)
        _wait_go()
        t0, c0 = time.perf_counter(), time.process_time()
        info = one_round(r)
        _say("DONE", round=r, seconds=time.perf_counter() - t0, cpu_s=time.process_time() - c0, **info)
    _say("WAIT", round=-1)  # keep serving means until every peer has fetched them
    _wait_go()


def worker_ours(args: argparse.Namespace) -> None:
    from swarmtrain.averaging.network import NetworkAverager
    from swarmtrain.compress import get_codec
    from swarmtrain.config import AveragingConfig, RpcConfig
    from swarmtrain.round.group import Group, Member
    from swarmtrain.rpc.node import RpcNode
    from swarmtrain.trust.identity import Ed25519Identity, registry_binding

    codec = {"ours-fp16": "fp16", "ours-int8": "int8"}.get(args.arm, "fp32")
    rpc = RpcConfig(run_key="bench", chunk_bytes=args.chunk_bytes, max_message_bytes=4 * args.chunk_bytes,
                    call_timeout_s=300.0, bulk_transport="grpc" if "grpc" in args.arm else "tcp",
                    tls=args.arm.endswith("-tls"), buffer_pool_mib=1024)  # the pool its figures were measured with
    avg = AveragingConfig(min_peers=2, allreduce_timeout_s=300.0, contribution_window_s=240.0, max_retries=0)
    node = RpcNode(rpc, peer_id=f"p{args.rank}")
    group: list[Group] = []
    # Each peer's identity key from a seed every process knows: the round's voters sign grants with them.
    keys = {f"p{i}": Ed25519Identity.from_seed(f"p{i}", f"bench-{i}".encode()) for i in range(args.world)}
    averager = NetworkAverager(node, run_id="bench", group_provider=lambda r: Group("bench", r, group[0].members),
                               codec=get_codec(codec), cfg=avg, identity=keys[f"p{args.rank}"],
                               key_binding=registry_binding({k: v.public_key for k, v in keys.items()}),
                               numel=args.numel, incarnation=0)
    node.start()
    _say("READY", endpoint=node.endpoint)
    endpoints = json.loads(sys.stdin.readline())
    group.append(Group("bench", 0, tuple(Member(f"p{i}", e) for i, e in enumerate(endpoints))))
    delta = payload(args.rank, args.numel)
    mean = torch.empty(args.numel)  # reused every round, as an outer step's buffers are

    def one_round(r: int) -> dict[str, Any]:
        res = averager.average(r, delta)
        assert res.committed and res.mean is not None, res.reason
        # Read the mean once, piece by piece, as the outer step does (gloo's arm leaves it in its own tensor).
        if isinstance(res.mean, torch.Tensor):
            mean.copy_(res.mean)
        else:
            for lo, values in res.mean.pieces():
                mean[lo:lo + values.numel()].copy_(values)
        err = (mean[:1000] - expected_head(args.world, 1000)).abs().max().item()
        return {"bytes_sent": res.bytes_sent, "max_err": err, "reason": res.reason}

    _rounds(args, one_round)
    node.close()


def worker_gloo(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    _say("READY", endpoint="")
    sys.stdin.readline()
    fresh = payload(args.rank, args.numel)
    t = fresh.clone()

    def one_round(r: int) -> dict[str, Any]:
        dist.all_reduce(t)
        t.div_(args.world)
        return {"bytes_sent": 0, "max_err": (t[:1000] - expected_head(args.world, 1000)).abs().max().item()}

    _rounds(args, one_round, prepare=lambda: t.copy_(fresh))  # all_reduce works in place: refill untimed
    dist.destroy_process_group()


def worker_hivemind(args: argparse.Namespace) -> None:
    import hivemind
    from hivemind.averaging.control import AveragingStage

    dht = hivemind.DHT(initial_peers=args.initial_peers or None, start=True, nat_port_map=False,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    handler = signal.getsignal(signal.SIGINT)
    t = payload(args.rank, args.numel)
    averager = hivemind.averaging.DecentralizedAverager(
        [t], dht, start=True, prefix="bench", target_group_size=args.world, min_group_size=args.world,
        min_matchmaking_time=2.0, request_timeout=10.0, allreduce_timeout=300.0)
    signal.signal(signal.SIGINT, handler)  # creating the averager sets SIGINT to ignored
    _say("READY", endpoint=json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    sys.stdin.readline()

    for r in range(args.warmup + args.repeats):
        with averager.get_tensors() as tensors:
            tensors[0].copy_(payload(args.rank, args.numel))
        control = averager.step(wait=False, require_trigger=True, timeout=300.0)
        deadline = time.monotonic() + 120
        while control.stage != AveragingStage.AWAITING_TRIGGER:
            if time.monotonic() > deadline or control.done():
                raise SystemExit(f"hivemind matchmaking failed: {control.exception() if control.done() else 'timeout'}")
            time.sleep(0.01)
        _say("WAIT", round=r)
        _wait_go()
        t0 = time.perf_counter()
        control.allow_allreduce()
        control.result()
        seconds = time.perf_counter() - t0
        with averager.get_tensors() as tensors:
            err = (tensors[0][:1000] - expected_head(args.world, 1000)).abs().max().item()
        _say("DONE", round=r, seconds=seconds, cpu_s=0.0, bytes_sent=0, max_err=err)
    _say("WAIT", round=-1)
    _wait_go()
    averager.shutdown()
    dht.shutdown()


# ---------------------------------------------------------------------------------- parent side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(arm: str, rank: int, world: int, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--worker", arm, "--rank", str(rank), "--world", str(world),
           "--numel", str(args.numel[0]), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
           "--chunk-bytes", str(args.chunk_bytes), *extra]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _read(proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (rc={proc.wait()}) while waiting for {kind}")
        if line.startswith("{"):
            msg = json.loads(line)
            if msg["kind"] == kind:
                return msg


def _send(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


def run_arm(arm: str, world: int, numel: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start `world` workers of one arm, run warmup + repeats rounds; the rounds' slowest-peer times."""
    sub = argparse.Namespace(**{**vars(args), "numel": [numel]})
    port = _free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        endpoints = []
        for rank in range(world):
            extra = ["--port", str(port)]
            if arm == "hivemind" and rank:
                extra += ["--initial-peers", *json.loads(endpoints[0])]
            procs.append(_spawn(arm, rank, world, sub, extra))
            if arm != "gloo":
                endpoints.append(_read(procs[-1], "READY")["endpoint"])
        if arm == "gloo":
            endpoints = [_read(p, "READY")["endpoint"] for p in procs]
        for p in procs:
            _send(p, json.dumps(endpoints))
        rounds = []
        for r in range(args.warmup + args.repeats):
            for p in procs:
                _read(p, "WAIT")
            for p in procs:
                _send(p, "GO")
            done = [_read(p, "DONE") for p in procs]
            if r >= args.warmup:
                rounds.append({"seconds": max(d["seconds"] for d in done),
                               "bytes_sent_per_peer": statistics.mean(d["bytes_sent"] for d in done),
                               "max_err": max(d["max_err"] for d in done),
                               "cpu_s_per_peer": statistics.mean(d["cpu_s"] for d in done)})
        for p in procs:
            _read(p, "WAIT")
        for p in procs:
            _send(p, "GO")
        for p in procs:
            p.wait(timeout=60)
        return rounds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, nargs="+", default=[25_000_000, 100_000_000], help="fp32 values per peer")
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per arm and pass")
    ap.add_argument("--passes", type=int, default=2, help="times the whole arm sequence runs (interleaving)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "allreduce.json"))
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                            format=f"%(relativeCreated)6.0f {args.worker}[{args.rank}] %(name)s: %(message)s")
        args.arm, args.numel = args.worker, args.numel[0]
        {"hivemind": worker_hivemind, "gloo": worker_gloo}.get(args.worker, worker_ours)(args)
        return
    results: list[dict[str, Any]] = []
    for numel in args.numel:
        for world in args.peers:
            times: dict[str, list[dict[str, Any]]] = {a: [] for a in args.arms}
            for _ in range(args.passes):
                for arm in args.arms:
                    times[arm] += run_arm(arm, world, numel, args)
            results.append(_report(numel, world, times))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))
    print(f"saved {args.out}")


def _report(numel: int, world: int, times: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    size_gb = numel * 4 / 1e9
    row: dict[str, Any] = {"numel": numel, "peers": world, "arms": {}}
    print(f"\n{numel / 1e6:.0f}M fp32 ({size_gb * 1e3:.0f} MB) on {world} peers "
          f"(median of {len(next(iter(times.values())))})")
    for arm, rounds in times.items():
        med = statistics.median(r["seconds"] for r in rounds)
        sent = statistics.median(r["bytes_sent_per_peer"] for r in rounds)
        err = max(r["max_err"] for r in rounds)
        cpu = statistics.median(r["cpu_s_per_peer"] for r in rounds)
        row["arms"][arm] = {"median_s": med, "all_s": [r["seconds"] for r in rounds], "gb_per_s": size_gb / med,
                            "bytes_sent_per_peer": sent, "max_err": err, "cpu_s_per_peer": cpu}
        print(f"  {arm:10s} {med:7.3f} s  {size_gb / med:6.2f} GB/s  sent/peer {sent / 1e6:8.1f} MB  "
              f"cpu/peer {cpu:6.3f} s  max|err| {err:.2e}")
    if "ours" in times:
        ours = row["arms"]["ours"]["median_s"]
        for other in ("hivemind", "gloo", "ours-fp16", "ours-int8", "ours-grpc"):
            if other in row["arms"]:
                ratio = ours / row["arms"][other]["median_s"]
                row[f"ours_over_{other}"] = ratio
                print(f"  ours / {other}: {ratio:.2f}x")
    for plain, tls in (("ours", "ours-tls"), ("ours-grpc", "ours-grpc-tls")):  # what rpc.tls costs
        if plain in row["arms"] and tls in row["arms"]:
            ratio = row["arms"][tls]["median_s"] / row["arms"][plain]["median_s"]
            row[f"{tls}_over_{plain}"] = ratio
            print(f"  {tls} / {plain}: {ratio:.2f}x")
    return row


if __name__ == "__main__":
    main()
