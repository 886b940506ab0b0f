"""Pipeline transport benchmark: one Forward call's round trip with its tensor inside the gRPC messages
against over the stage server's bulk port (pipeline.bulk_min_bytes), side by side, on 127.0.0.1.

    python benchmarks/pipeline_transport.py --sizes-mb 0.25,1,4,16 --calls 20 --repeats 3

The server echoes the tensor (no model), so a call's time is the wire path alone: gRPC (message
serialization, HTTP/2 framing, the per-call MAC) against an Upload call, the bytes over the bulk port,
the call itself and a download of the reply. Arms alternate call by call at each size, with and
without `rpc.tls`; the figure is the median round trip and inline/bulk ratio per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(sizes_mb: list[float], calls: int, *, tls: bool) -> list[dict[str, Any]]:
    from swarmtrain.config import load_config
    from swarmtrain.rpc.node import RpcNode
    from swarmtrain.rpc.pipeline_wire import PipelineClient, serve_pipeline
    from swarmtrain.wire import pipeline_pb2 as pb

    largest = int(max(sizes_mb) * (1 << 20)) + 4096
    cfg = load_config(overrides=["rpc.run_key='transport benchmark'", f"rpc.tls={str(tls).lower()}",
                                 f"rpc.max_message_bytes={largest + (1 << 20)}"])

    async def echo(method: str, caller: str, call: pb.StageCall) -> pb.StageReply:
        return pb.StageReply(shape=call.shape, tensor=call.tensor)

    server = RpcNode(cfg.rpc, peer_id="server")
    serve_pipeline(server, echo, max_bytes=largest)
    client_node = RpcNode(cfg.rpc, peer_id="trainer", serve=False)
    out = []
    with server, client_node:
        inline = PipelineClient(client_node, bulk_min_bytes=0, max_bytes=largest)
        bulk = PipelineClient(client_node, bulk_min_bytes=1, max_bytes=largest)
        for mb in sizes_mb:
            size = int(mb * (1 << 20))
            payload = bytes(range(256)) * (size // 256)
            seconds: dict[str, list[float]] = {"inline": [], "bulk": []}
            for i in range(calls + 2):  # the first two of each arm warm the connections up
                for name, client in (("inline", inline), ("bulk", bulk)):
                    call = pb.StageCall(stage=0, microbatch=f"{name}{i}", shape=[1, 1, len(payload) // 4],
                                        tensor=payload)
                    start = time.perf_counter()
                    reply = client_node.run(client.call(server.endpoint, "Forward", call, timeout_s=60), timeout_s=90)
                    took = time.perf_counter() - start
                    if reply.tensor != payload:
                        raise RuntimeError(f"{name} call of {mb} MB came back altered")
                    if i >= 2:
                        seconds[name].append(took)
            row = {"size_mb": mb, "tls": tls, "inline_s": statistics.median(seconds["inline"]),
                   "bulk_s": statistics.median(seconds["bulk"])}
            row["inline_over_bulk"] = row["inline_s"] / row["bulk_s"]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="0.25,1,4,16")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline-transport.json"))
    args = ap.parse_args()
    sizes = [float(x) for x in args.sizes_mb.split(",")]
    rows = [row for r in range(args.repeats) for tls in (False, True)
            for row in [{**x, "repeat": r} for x in measure(sizes, args.calls, tls=tls)]]
    summary = []
    for tls in (False, True):
        for mb in sizes:
            ratios = [x["inline_over_bulk"] for x in rows if x["tls"] == tls and x["size_mb"] == mb]
            summary.append({"size_mb": mb, "tls": tls, "inline_over_bulk": statistics.median(ratios),
                            "range": [min(ratios), max(ratios)]})
            print(f"{mb:6.2f} MB tls={tls!s:5}: inline/bulk {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, "summary": summary}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
