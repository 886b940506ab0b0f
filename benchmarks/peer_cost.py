"""What a peer costs its own process: event-loop lag, peak memory and θ hashing, on real `swarmtrain` processes.

A coordinator and two peers on CPU (each peer `train.threads=1`) run a few short DiLoCo rounds of a
model preset (default `gpt2-124m`, ~86M parameters with the byte vocabulary). Each peer runs in a
launcher (this file, `_probed-peer` mode) that builds the Peer exactly as `swarmtrain peer` does and
adds, inside the same process and event loop:
  * a lag probe: an asyncio task that sleeps PROBE_INTERVAL_S and records how late it wakes, tagged
    with the peer's phase; a watchdog thread samples the loop thread's stack while a wake-up is more
    than STALL_CAPTURE_S overdue, so the report says what held the loop;
  * a wrapper around `swarmtrain.diloco.worker.flat_hash` that times every θ_global hash and notes
    whether it ran on the event-loop thread;
  * peak RSS (VmHWM) of the peer process at exit;
  * at its first round line, its threads (by name, numbers folded) and the event loops running in it.
The parent also samples the RSS of each peer's whole process group (its DHT daemon and p2pd too),
times `flat_hash` on a tensor of the model's size, and checks that every round committed on both
peers carries one θ_global hash. Lag is summarised from READY to the last round line, split into
commit windows (from the peer entering `averaging` to its round line) and the time between them
(inner steps, heartbeats); stalls of 100 ms or more are grouped by the code the loop thread was in.
It measures the swarmtrain that Python imports; the results record its commit.

  python benchmarks/peer_cost.py                          # gpt2-124m, 2 peers, 4 rounds of 2 inner steps
  python benchmarks/peer_cost.py --preset small --rounds 3    # a quick look
  PEER_COST_CENSUS=light python benchmarks/peer_cost.py --keep-dir DIR  # + glibc heap, pool and anonymous RSS
                                                      # in each peer's report (=full: also live tensors)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import math
import os
import platform
import re
import resource
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROBED_PEER = "_probed-peer"
PROBE_INTERVAL_S = 0.02
CENSUS_STEP_BYTES = 100 << 20
STALL_CAPTURE_S = 0.05  # a wake-up this overdue gets the loop thread's stack sampled
STACK_EVERY_S = 0.1  # during one stall, at most one stack per this long ...
STACKS_PER_STALL = 4  # ... and at most this many
RSS_EVERY_S = 0.1  # the peer process's RSS timeline (VmHWM at exit is the exact peak)
START_S, RUN_S, EXIT_S = 600.0, 1800.0, 120.0
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------- inside a peer process


class LagProbe:
    """Sleeps `interval_s` on the running loop and records how late each wake-up is; see the module doc."""

    def __init__(self, *, interval_s: float, phase: Callable[[], str]) -> None:
        self.interval_s = interval_s
        self.phase = phase
        self.samples: list[tuple[float, float, str]] = []  # (monotonic wake time, lag s, phase)
        self.stalls: list[dict[str, Any]] = []
        self.rss: list[tuple[float, int, str]] = []  # (monotonic time, RSS bytes, phase)
        self._tick = 0
        self._slept_at = time.monotonic()
        self._stacks: dict[int, list[str]] = {}
        self._busy: dict[int, list[str]] = {}  # other threads running Python while the loop shows no frame
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="lag-watchdog", daemon=True)
        self.census: Census | None = None
        # with PEER_COST_CENSUS set: (time, mallinfo, pool idle, anon)
        self.heap: list[tuple[float, dict[str, int], int, int]] = []

    async def run(self) -> None:
        self._loop_thread = threading.get_ident()
        self._watchdog.start()
        try:
            while True:
                self._slept_at = time.monotonic()
                await asyncio.sleep(self.interval_s)
                woke = time.monotonic()
                lag_s = max(0.0, woke - self._slept_at - self.interval_s)
                phase = self.phase()
                self.samples.append((woke, lag_s, phase))
                stacks = self._stacks.pop(self._tick, None)
                if stacks is not None:
                    self.stalls.append({"t": woke, "lag_s": lag_s, "phase": phase, "stacks": stacks,
                                        "busy_threads": self._busy.pop(self._tick, [])})
                self._tick += 1
        finally:
            self._stop.set()
            self._watchdog.join(timeout=1.0)

    def _watch(self) -> None:
        last_capture = last_rss = 0.0
        page_bytes = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.01):
            tick, slept_at = self._tick, self._slept_at
            now = time.monotonic()
            if now - last_rss >= RSS_EVERY_S:
                rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
                self.rss.append((now, rss_pages * page_bytes, self.phase()))
                last_rss = now
                if self.census is not None:
                    self.heap.append((now, _mallinfo(), self.census.pool_idle(), _smaps_anon()))
                    if os.environ.get("PEER_COST_CENSUS") == "full":
                        self.census.maybe_take(rss_pages * page_bytes, self.phase())
            if now - slept_at - self.interval_s < STALL_CAPTURE_S or now - last_capture < STACK_EVERY_S:
                continue
            self._capture(tick)
            last_capture = now

    def _capture(self, tick: int) -> None:
        """Sample the loop thread's stack (and, when it shows no Python frame, the busy threads').

        A method of its own so that the frame objects die with it: a frame kept in a local of the
        watchdog's loop would keep a finished function's locals (a Δ, a mean) alive, and this
        benchmark would count them in the peer's peak memory."""
        stacks = self._stacks.setdefault(tick, [])
        if len(stacks) >= STACKS_PER_STALL:
            return
        frames = sys._current_frames()
        frame = frames.get(self._loop_thread)
        if frame is None:
            return
        stack = _frame_names(frame)
        if not stacks or stacks[-1] != " <- ".join(stack):
            stacks.append(" <- ".join(stack))
        if stack[0].startswith("asyncio/runners.py"):  # the loop runs C code or waits for the GIL
            busy = self._busy.setdefault(tick, [])
            busy.extend(b for b in _busy_threads(frames, skip=(self._loop_thread, threading.get_ident()))
                        if b not in busy)


IDLE_FRAMES = ("threading.py", "queue.py", "selectors.py", "socket.py", "concurrent/futures/thread.py",
               "multiprocessing/connection.py")


def _busy_threads(frames: dict[int, Any], *, skip: Sequence[int]) -> list[str]:
    """`thread-name: innermost frames` of each thread not parked in a queue, lock or selector."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        stack = _frame_names(frame, depth=4)
        if ident in skip or stack[0].startswith(IDLE_FRAMES):
            continue
        out.append(f"{names.get(ident, ident)}: {' <- '.join(stack)}")
    return out


def _frame_names(frame: Any, *, depth: int = 7) -> list[str]:
    """The innermost `depth` frames, innermost first, as `path:line function` with short paths."""
    names = []
    for fs in reversed(traceback.extract_stack(frame)[-depth:]):
        path = re.sub(r"^.*/(?:site-packages|lib/python3\.\d+)/", "", fs.filename)
        path = re.sub(r"^.*/(?=(?:swarmtrain|benchmarks)/)", "", path)
        names.append(f"{path}:{fs.lineno} {fs.name}")
    return names


class Census:
    """`PEER_COST_CENSUS=full`: at every new RSS high (by CENSUS_STEP_BYTES), what the live tensors and pooled
    buffers hold.

    Walks the garbage collector's objects (seconds at 100M+ parameters, holding the GIL): a diagnosis of
    where a peak comes from; a census run's lag figures are not comparable with a plain run's."""

    def __init__(self, labels: Callable[[], dict[int, str]], pool_idle: Callable[[], int]) -> None:
        self.samples: list[dict[str, Any]] = []
        self._labels = labels
        self.pool_idle = pool_idle
        self._high = 0

    def maybe_take(self, rss: int, phase: str) -> None:
        if rss < self._high + CENSUS_STEP_BYTES:
            return
        self._high = rss
        import gc

        import numpy as np
        import torch

        labels = self._labels()
        heap = _mallinfo()
        seen: dict[int, tuple[int, str]] = {}
        arrays = 0
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                with contextlib.suppress(Exception):
                    storage = obj.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr and ptr not in seen:
                        seen[ptr] = (storage.nbytes(), labels.get(ptr, ""))
            elif isinstance(obj, np.ndarray) and obj.base is None and obj.nbytes >= 1 << 20:
                arrays += obj.nbytes
        holders = []
        for obj in gc.get_objects():
            if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu"
                    and obj.numel() * obj.element_size() >= 100 << 20):
                with contextlib.suppress(Exception):
                    if labels.get(obj.untyped_storage().data_ptr()):
                        continue
                    chain = []
                    for ref in gc.get_referrers(obj)[:6]:
                        if isinstance(ref, dict):
                            chain.append("dict:" + ",".join(str(k) for k, v in list(ref.items())[:40] if v is obj))
                        elif hasattr(ref, "f_code"):
                            chain.append(f"frame:{ref.f_code.co_filename.split('/')[-1]}:{ref.f_code.co_name}:{ref.f_lineno}")
                        else:
                            chain.append(type(ref).__name__)
                    holders.append({"bytes": obj.numel() * obj.element_size(), "shape": list(obj.shape),
                                    "base": obj._base is not None, "by": chain})
        named: dict[str, int] = {}
        other: list[int] = []
        for nbytes, label in seen.values():
            if label:
                named[label] = named.get(label, 0) + nbytes
            elif nbytes >= 1 << 20:
                other.append(nbytes)
        self.samples.append({"rss": rss, "phase": phase, "named": named, "other_tensors": sorted(other)[::-1][:40],
                             "other_tensor_bytes": sum(other), "numpy_owned_bytes": arrays,
                             "pool_idle_bytes": self.pool_idle(), "holders": holders, "heap": heap})


class _HashTimer:
    """Replaces `swarmtrain.diloco.worker.flat_hash` with a timed call that records where it ran."""

    def __init__(self, loop_thread: Callable[[], int | None], worker_round: Callable[[], int | None]) -> None:
        import swarmtrain.diloco.worker as worker_module

        self.calls: list[dict[str, Any]] = []
        self._inner = worker_module.flat_hash
        self._loop_thread = loop_thread
        self._round = worker_round
        worker_module.flat_hash = self  # `global_hash` looks it up in its module at every call

    def __call__(self, flat: Any) -> str:
        start = time.monotonic()
        digest = self._inner(flat)
        self.calls.append({"t": start, "seconds": time.monotonic() - start, "numel": int(flat.numel()),
                           "on_loop_thread": threading.get_ident() == self._loop_thread(),
                           "worker_round": self._round()})
        return digest


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> dict[str, int]:
    """glibc's heap figures (mallinfo2): `arena` bytes from sbrk/arenas, of them `uordblks` in use and
    `fordblks` free but kept; `hblkhd` bytes in mmapped chunks. Empty where glibc has no mallinfo2."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {name: int(getattr(info, name)) for name in ("arena", "hblkhd", "uordblks", "fordblks")}


def _smaps_anon() -> int:
    """Anonymous resident bytes of this process (heap, mmapped tensors), without mapped files."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    return -1


def _worker_labels(peer: Any) -> dict[int, str]:
    """storage address -> which of the worker's own tensors it is."""
    worker = peer.worker
    if worker is None:
        return {}
    out = {p.untyped_storage().data_ptr(): "params" for p in worker.params}
    out.update({p.grad.untyped_storage().data_ptr(): "grads" for p in worker.params if p.grad is not None})
    out[worker.theta_global.untyped_storage().data_ptr()] = "theta_global"
    for name, t in worker.outer.state_tensors().items():
        out[t.untyped_storage().data_ptr()] = f"outer.{name}"
    for state in worker.inner.state.values():
        for name, t in state.items():
            if hasattr(t, "untyped_storage") and t.numel() > 1:
                out[t.untyped_storage().data_ptr()] = f"inner.{name}"
    if worker.residual is not None:
        out[worker.residual.untyped_storage().data_ptr()] = "residual"
    return out


def _pool_idle(peer: Any) -> int:
    plane = peer.plane
    node = getattr(plane, "node", None)
    return node.buffers.idle_bytes if node is not None else -1


def _peak_rss_bytes() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"vm_hwm_bytes": int(fields["VmHWM"].split()[0]) * 1024,
            "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def thread_census() -> dict[str, Any]:
    """The process's threads now: Python threads by name (numbers folded: "stage_0", "stage_1" -> "stage_N"),
    OS threads (/proc/self/task: native ones too), and how many asyncio event loops are running."""
    import gc

    names: dict[str, int] = {}
    for t in threading.enumerate():
        name = re.sub(r"\d+", "N", t.name)
        names[name] = names.get(name, 0) + 1
    loops = sum(1 for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running())
    return {"python_threads": dict(sorted(names.items())), "os_threads": len(os.listdir("/proc/self/task")),
            "event_loops": loops}


def probed_peer_main(argv: Sequence[str]) -> int:
    """`peer_cost.py _probed-peer REPORT.json PEER_ARGS...`: `swarmtrain peer PEER_ARGS` with the probes."""
    import uvloop

    from swarmtrain.daemon import cmd_peer
    from swarmtrain.daemon.cli import build_parser
    from swarmtrain.daemon.options import config_from_args
    from swarmtrain.peer.network import NetworkServices
    from swarmtrain.telemetry import EventWriter

    try:
        from swarmtrain.roles import Peer
        from swarmtrain.roles import process as peer_process
    except ImportError:  # a tree from before the roles package (a side-by-side run against an older commit)
        from swarmtrain.peer import Peer  # type: ignore[attr-defined,no-redef]
        from swarmtrain.peer import process as peer_process  # type: ignore[attr-defined,no-redef]

    report_path, peer_args = Path(argv[0]), list(argv[1:])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(["peer", *peer_args])
    local = config_from_args(args, extra=cmd_peer.local_overrides(args))
    lines: list[tuple[float, str, dict[str, Any]]] = []
    census: list[dict[str, Any]] = []

    class TimedWriter(EventWriter):
        def ready(self, info: dict[str, Any]) -> None:
            lines.append((time.monotonic(), "ready", {}))
            super().ready(info)

        def emit(self, event: Any) -> None:
            if event.event == "round" and not census:
                census.append(thread_census())
            lines.append((time.monotonic(), event.event, {"round": getattr(event, "round", None),
                                                          "committed": getattr(event, "committed", None)}))
            super().emit(event)

    peer = Peer(local, writer=TimedWriter(sys.stdout), services=NetworkServices(), local_overrides=args.overrides,
                coordinator_id=args.coordinator_id)
    probe = LagProbe(interval_s=PROBE_INTERVAL_S, phase=lambda: peer.phase)
    if os.environ.get("PEER_COST_CENSUS"):
        probe.census = Census(lambda: _worker_labels(peer), lambda: _pool_idle(peer))
    loop_thread: list[int] = []
    hashes = _HashTimer(lambda: loop_thread[0] if loop_thread else None,
                        lambda: peer.worker.round if peer.worker is not None else None)

    async def main() -> int:
        loop_thread.append(threading.get_ident())
        task = asyncio.create_task(probe.run())
        try:  # the daemon's own body (signals, start, run, aclose), so the peer runs as `swarmtrain peer` does
            return await peer_process.run_role(peer, leaving="leaving gracefully at the next round boundary")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    rc, error = 1, ""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            rc = runner.run(main())
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        worker = peer.worker
        report = {"pid": os.getpid(), "rc": rc, "error": error, "lines": lines, "lag": probe.samples,
                  "stalls": probe.stalls, "census": probe.census.samples if probe.census else None, "heap": probe.heap,
                  "rss_timeline": probe.rss, "hash_calls": hashes.calls, "rss": _peak_rss_bytes(),
                  "num_params": worker.numel if worker is not None else None,
                  "threads": census[0] if census else None}
        report_path.write_text(json.dumps(report))
    return rc


# ---------------------------------------------------------------------- the benchmark (parent)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--inner-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--codec", default="int8")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra run-wide override for the coordinator (repeatable)")
    p.add_argument("--keep-dir", metavar="DIR", help="keep peer logs and raw probe reports here")
    p.add_argument("--out", help="results JSON (default: benchmarks/results/peer-cost-PRESET.json)")
    return p.parse_args(argv)


def run_sets(args: argparse.Namespace) -> list[str]:
    return [
        f"model.preset={args.preset}", f"data.batch_size={args.batch_size}",
        f"data.seq_len={args.seq_len}", "data.max_corpus_bytes=4000000", f"diloco.inner_steps={args.inner_steps}",
        f"diloco.rounds={args.rounds}", "diloco.eval_every_rounds=0", f"compress.codec={args.codec}",
        "averaging.min_peers=2", "averaging.matchmaking_timeout_s=30.0", *args.overrides,
    ]


PEER_SETS = ["train.threads=1"]


class GroupRss:
    """Samples the summed RSS of each peer's process group (peer, DHT daemon, p2pd) on a thread."""

    def __init__(self, pgids: dict[str, int], *, every_s: float = 0.5) -> None:
        self.peak_bytes = dict.fromkeys(pgids, 0)
        self._pgids = pgids
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-rss", daemon=True)

    def __enter__(self) -> GroupRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            totals = dict.fromkeys(self._pgids, 0)
            by_group = {g: name for name, g in self._pgids.items()}
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_text()
                    pgrp = int(stat[stat.rindex(")") + 2:].split()[2])
                    if pgrp in by_group:
                        rss_pages = int((entry / "statm").read_text().split()[1])
                        totals[by_group[pgrp]] += rss_pages * os.sysconf("SC_PAGE_SIZE")
            for name, total in totals.items():
                self.peak_bytes[name] = max(self.peak_bytes[name], total)


def run_swarm(args: argparse.Namespace, work: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Coordinator + 2 probed peers until both leave; their raw reports and round lines, and group peaks."""
    from swarmtrain.process.children import Child
    from swarmtrain.telemetry.events import LeaveEvent, RoundEvent
    from swarmtrain.testing.procs import ProcessSet

    reports: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {"rounds": {}, "leave": {}, "ready": {}}
    with ProcessSet(work) as procs:
        _, join = procs.coordinator(run_sets(args), timeout_s=START_S)
        peers: dict[str, Child] = {}
        for name in ("p0", "p1"):
            sets = [x for s in PEER_SETS for x in ("--set", s)]
            argv = [sys.executable, str(Path(__file__).resolve()), PROBED_PEER, str(work / f"{name}.report.json"),
                    "--join", join, *sets]
            peers[name] = Child(name, argv, log_path=work / f"{name}.log")
            procs.children.append(peers[name])  # closed (SIGTERM, then SIGKILL) with the coordinator
        with GroupRss({n: c.pgid for n, c in peers.items()}) as rss:
            for name, child in peers.items():
                extra["ready"][name] = child.wait_ready(timeout_s=START_S)
            started = time.monotonic()
            for name, child in peers.items():
                _, leave = child.wait_for(lambda x: isinstance(x, LeaveEvent),
                                          timeout_s=max(1.0, RUN_S - (time.monotonic() - started)), what="leave")
                extra["leave"][name] = dataclasses.asdict(leave)
            for child in peers.values():
                child.proc.wait(timeout=EXIT_S)
        extra["group_peak_rss_bytes"] = rss.peak_bytes
        extra["wall_s"] = time.monotonic() - started
        for name, child in peers.items():
            extra["rounds"][name] = [dataclasses.asdict(x) for x in child.snapshot() if isinstance(x, RoundEvent)]
            reports[name] = json.loads((work / f"{name}.report.json").read_text())
    return reports, extra


# ---------------------------------------------------------------------- figures


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def lag_summary(samples: Sequence[Sequence[Any]]) -> dict[str, Any]:
    lags = [s[1] for s in samples]
    if not lags:
        return {"samples": 0}
    return {"samples": len(lags), "p50_ms": round(1e3 * _pct(lags, 50), 2), "p99_ms": round(1e3 * _pct(lags, 99), 2),
            "max_ms": round(1e3 * max(lags), 2)}


def commit_windows(report: dict[str, Any]) -> list[tuple[float, float, int]]:
    """(start, end, round) per committed round: from the peer entering `averaging` to its round line."""
    samples = report["lag"]
    windows = []
    for t, kind, info in report["lines"]:
        if kind != "round" or not info.get("committed"):
            continue
        i = max((k for k, s in enumerate(samples) if s[0] <= t), default=-1)
        while i >= 0 and samples[i][2] != "averaging":  # the apply and the hash run after the phase is reset
            i -= 1
        start = t
        while i >= 0 and samples[i][2] == "averaging":
            start, i = samples[i][0], i - 1
        windows.append((start - PROBE_INTERVAL_S, t + 0.1, info["round"]))
    return windows


def _span(report: dict[str, Any]) -> tuple[float, float]:
    """(READY, last round line) in the peer's monotonic clock: the steady state the lag figures cover."""
    ready_t = next(t for t, kind, _ in report["lines"] if kind == "ready")
    rounds = [t for t, kind, _ in report["lines"] if kind == "round"]
    return ready_t, (rounds[-1] if rounds else ready_t) + 0.1


def _swarmtrain_frames(stack: str) -> str:
    """`file:function` of the swarmtrain frames of one sampled stack (innermost first, at most 4)."""
    frames = [f for f in stack.split(" <- ") if f.startswith("swarmtrain/")]
    return " <- ".join(f"{f.split(' ')[0].rsplit('/', 1)[-1].split(':')[0]}:{f.split(' ')[-1]}" for f in frames[:4])


def stall_cause(stall: dict[str, Any]) -> str:
    """What held the loop, from the stall's first loop-thread stack (and the busy threads when it has none)."""
    own = _swarmtrain_frames(stall["stacks"][0]) if stall["stacks"] else ""
    if own:
        return own
    busy = sorted({_swarmtrain_frames(b.split(": ", 1)[1]) or b.split(": ", 1)[1].split(" <- ")[0]
                   for b in stall.get("busy_threads", [])})
    return "no Python frame on the loop thread; threads running meanwhile: " + ("; ".join(busy) or "none sampled")


def lag_figures(report: dict[str, Any]) -> dict[str, Any]:
    ready_t, end_t = _span(report)
    windows = commit_windows(report)

    def in_commit(t: float) -> bool:
        return any(a <= t <= b for a, b, _ in windows)

    steady = [s for s in report["lag"] if ready_t <= s[0] <= end_t]
    stalls = [s for s in report["stalls"] if ready_t <= s["t"] <= end_t and s["lag_s"] >= 0.1]
    causes: dict[str, dict[str, Any]] = {}
    for s in stalls:
        c = causes.setdefault(stall_cause(s), {"stalls": 0, "total_ms": 0.0, "max_ms": 0.0})
        c["stalls"] += 1
        c["total_ms"] = round(c["total_ms"] + 1e3 * s["lag_s"], 1)
        c["max_ms"] = round(max(c["max_ms"], 1e3 * s["lag_s"]), 1)
    worst = sorted(stalls, key=lambda s: -s["lag_s"])[:5]
    return {
        "lag_ms": {"steady": lag_summary(steady), "commit_windows": lag_summary([s for s in steady if in_commit(s[0])]),
                   "between_commits": lag_summary([s for s in steady if not in_commit(s[0])]),
                   "startup": lag_summary([s for s in report["lag"] if s[0] < ready_t])},
        "commit_window_s": [round(b - a, 2) for a, b, _ in windows],
        "stalls_over_100ms_by_first_stack": dict(sorted(causes.items(), key=lambda kv: -kv[1]["total_ms"])),
        "worst_stalls": [{"t_after_ready_s": round(s["t"] - ready_t, 2), "lag_ms": round(1e3 * s["lag_s"], 1),
                          "phase": s["phase"], "in_commit_window": in_commit(s["t"]), "loop_thread_stacks": s["stacks"],
                          "busy_threads": s.get("busy_threads", [])}
                         for s in worst],
    }


def rss_figures(report: dict[str, Any], *, group_peak_rss_bytes: int) -> dict[str, Any]:
    ready_t, _ = _span(report)
    fp32_bytes = 4 * report["num_params"]
    timeline = report["rss_timeline"]
    at_ready = max((r for r in timeline if r[0] <= ready_t), key=lambda r: r[0], default=None)
    peak = max(timeline, key=lambda r: r[1], default=None)
    windows = commit_windows(report)
    by_phase: dict[str, int] = {}
    for _, rss, phase in timeline:
        by_phase[phase] = max(by_phase.get(phase, 0), rss)
    return {
        "peak_rss_bytes": report["rss"]["vm_hwm_bytes"],
        "peak_rss_over_fp32_model": round(report["rss"]["vm_hwm_bytes"] / fp32_bytes, 2),
        "group_peak_rss_bytes": group_peak_rss_bytes,
        "group_peak_rss_over_fp32_model": round(group_peak_rss_bytes / fp32_bytes, 2),
        "rss_at_ready_bytes": at_ready[1] if at_ready else None,
        "sampled_peak": {"t_after_ready_s": round(peak[0] - ready_t, 2), "bytes": peak[1], "phase": peak[2],
                         "in_commit_window": any(a <= peak[0] <= b for a, b, _ in windows)} if peak else None,
        "sampled_max_bytes_by_phase": by_phase,
    }


def hash_figures(report: dict[str, Any], *, committed: int) -> dict[str, Any]:
    ready_t, end_t = _span(report)
    calls = report["hash_calls"]
    run_calls = [c for c in calls if ready_t <= c["t"] <= end_t]
    on_loop = [c for c in run_calls if c["on_loop_thread"]]
    return {
        "calls_total": len(calls), "calls_ready_to_last_round": len(run_calls),
        "per_committed_round": round(len(run_calls) / committed, 2) if committed else None,
        "on_loop_thread": len(on_loop),
        "seconds_mean": round(sum(c["seconds"] for c in run_calls) / len(run_calls), 4) if run_calls else None,
        "loop_seconds_per_committed_round": round(sum(c["seconds"] for c in on_loop) / committed, 4)
        if committed else None,
        "calls": [{"t_after_ready_s": round(c["t"] - ready_t, 2), "seconds": round(c["seconds"], 4),
                   "on_loop_thread": c["on_loop_thread"], "worker_round": c["worker_round"]} for c in calls],
    }


def peer_figures(report: dict[str, Any], *, group_peak_rss_bytes: int) -> dict[str, Any]:
    rounds = [info for _, kind, info in report["lines"] if kind == "round"]
    committed = [r["round"] for r in rounds if r["committed"]]
    return {
        **lag_figures(report), **rss_figures(report, group_peak_rss_bytes=group_peak_rss_bytes),
        "hashes": hash_figures(report, committed=len(committed)),
        "rounds_committed": committed, "rounds_aborted": [r["round"] for r in rounds if not r["committed"]],
        "rc": report["rc"], "error": report["error"], "threads_at_first_round": report.get("threads"),
    }


def agreement(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Rounds committed on every peer, and whether each of them carries one θ_global hash everywhere."""
    by_round: dict[int, dict[str, str]] = {}
    for name, events in rounds.items():
        for e in events:
            if e["committed"]:
                by_round.setdefault(e["round"], {})[name] = e["hash"]
    on_all = sorted(r for r, h in by_round.items() if len(h) == len(rounds))
    disagreeing = sorted(r for r, h in by_round.items() if len(set(h.values())) > 1)
    return {"rounds_committed_on_all_peers": on_all, "rounds_with_disagreeing_hashes": disagreeing,
            "all_agree": not disagreeing and len(on_all) == len(by_round),
            "hashes": {str(r): h for r, h in sorted(by_round.items())}}


def step_seconds(events: list[dict[str, Any]]) -> float | None:
    timed = [(e["compute_s"], e["steps"]) for e in events if e["steps"]]
    return round(sum(c for c, _ in timed) / sum(s for _, s in timed), 2) if timed else None


def hash_bench(num_params: int, *, repeats: int = 5) -> dict[str, Any]:
    """`flat_hash` on a fresh fp32 vector of the model's size, in this process (no other work running)."""
    import torch

    from swarmtrain.diloco.flat import flat_hash

    flat = torch.randn(num_params)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat_hash(flat)
        times.append(time.perf_counter() - start)
    return {"num_params": num_params, "bytes": 4 * num_params, "repeats": repeats,
            "seconds_best": round(min(times), 4), "seconds_median": round(_pct(times, 50), 4),
            "gb_per_s": round(4 * num_params / min(times) / 1e9, 2)}


def machine() -> dict[str, Any]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def code_version() -> dict[str, Any]:
    """The commit of the swarmtrain package measured, and whether its files differ from it."""
    import subprocess

    import swarmtrain

    root = Path(swarmtrain.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "swarmtrain"],
                                 capture_output=True, text=True, check=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": commit, "swarmtrain_files_changed_since": len([x for x in changed if x.strip()])}


def print_table(peers: dict[str, dict[str, Any]], agree: dict[str, Any], bench: dict[str, Any]) -> None:
    nan = float("nan")
    print(f"\n{'':4} {'event-loop lag ms, READY..last round':^38}  {'peak RSS':^14}  {'θ hashes per commit':^22}")
    print(f"{'peer':4} {'p50':>7} {'p99':>7} {'max':>7} {'commit p99':>10} {'GB':>6} {'x fp32':>7} "
          f"{'calls':>6} {'on loop':>7} {'loop s':>7} {'step s':>7}")
    for name, f in peers.items():
        s, c, h = f["lag_ms"]["steady"], f["lag_ms"]["commit_windows"], f["hashes"]
        on_loop = h["on_loop_thread"] / len(f["rounds_committed"]) if f["rounds_committed"] else nan
        print(f"{name:4} {s['p50_ms']:7.1f} {s['p99_ms']:7.1f} {s['max_ms']:7.0f} {c.get('p99_ms', nan):10.0f} "
              f"{f['peak_rss_bytes'] / 1e9:6.2f} {f['peak_rss_over_fp32_model']:7.1f} "
              f"{h['per_committed_round'] or nan:6.2f} {on_loop:7.2f} "
              f"{h['loop_seconds_per_committed_round'] or 0:7.3f} {f['step_s'] or nan:7.2f}")
    for name, f in peers.items():
        print(f"{name} stalls >= 100 ms by the loop thread's first sampled stack:")
        for cause, c in f["stalls_over_100ms_by_first_stack"].items():
            print(f"  {c['stalls']:3d} x, {c['total_ms'] / 1e3:6.2f} s in all, max {c['max_ms'] / 1e3:5.2f} s: {cause}")
    print(f"flat_hash of {bench['bytes'] / 1e6:.0f} MB in the benchmark process: {bench['seconds_best']:.3f} s best, "
          f"{bench['seconds_median']:.3f} s median ({bench['gb_per_s']} GB/s)")
    for name, f in peers.items():
        t = f["threads_at_first_round"] or {}
        print(f"{name} at its first round: {t.get('event_loops')} event loop(s), {t.get('os_threads')} OS threads, "
              f"Python threads {t.get('python_threads')}")
    print(f"rounds committed on both peers: {agree['rounds_committed_on_all_peers']}; "
          f"one hash per round: {agree['all_agree']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else RESULTS / f"peer-cost-{args.preset}.json"
    with contextlib.ExitStack() as stack:
        work = Path(args.keep_dir) if args.keep_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        reports, extra = run_swarm(args, work)
    peers = {}
    for name, report in reports.items():
        peers[name] = peer_figures(report, group_peak_rss_bytes=extra["group_peak_rss_bytes"][name])
        peers[name]["step_s"] = step_seconds(extra["rounds"][name])
        peers[name]["round_lines"] = extra["rounds"][name]
    num_params = next(iter(reports.values()))["num_params"]
    bench = hash_bench(num_params)
    agree = agreement(extra["rounds"])
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "code": code_version(),
           "config": {"coordinator_sets": run_sets(args), "peer_sets": PEER_SETS, "num_peers": 2,
                      "num_params": num_params, "fp32_model_bytes": 4 * num_params,
                      "probe_interval_s": PROBE_INTERVAL_S, "stall_capture_s": STALL_CAPTURE_S},
           "wall_s_ready_to_exit": round(extra["wall_s"], 1),
           "target": {"lag_p99_ms_at_most": 100.0,
                      "met": all(f["lag_ms"]["steady"].get("p99_ms", 1e9) <= 100.0 for f in peers.values())},
           "peers": peers, "agreement": agree, "flat_hash_in_benchmark_process": bench}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(peers, agree, bench)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == PROBED_PEER:
        sys.exit(probed_peer_main(sys.argv[2:]))
    sys.exit(main())
