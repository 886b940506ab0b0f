"""State transfer: serve the newest committed (round, θ_global, outer momentum, run config); download,
verify (sha256, names, shapes, finite) and hand it to a joining or lagging peer."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import struct
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from swarmtrain.config import ConfigError, RunConfig, from_dict, public_dict
from swarmtrain.round.ballots import Voter, voters_from_json, voters_to_json
from swarmtrain.rpc.node import RpcError, RpcNode
from swarmtrain.rpc.state_wire import StateBlob, StateClient, serve_state

__all__ = ["LiveState", "StateServer", "StateSnapshot", "StateTransferError", "fetch_state", "fetch_state_async",
           "fetch_state_parallel", "fetch_state_parallel_async",
           "split_ranges", "state_size_limit"]

log = logging.getLogger(__name__)

_PARAMS, _MOMENTUM = "params/", "momentum/"
_VOTERS = "swarmtrain.voters"  # safetensors metadata key: the next round's voters, a JSON list of [id, incarnation]
# safetensors header room: the voters (up to 4096 ids of <= 128 chars) and slack, plus a JSON entry per tensor
# (name, dtype, shape, offsets). Certificates are not in the blob: every holder of a state serves the same bytes
# (a joiner fetches ranges of one blob from several), while each keeps its own certificates of it.
_HEADER_BYTES, _HEADER_BYTES_PER_TENSOR = 1 << 20, 1024
UNBOUNDED_STATE_BYTES = 1 << 34  # without the model's shapes: only a sanity bound


class StateTransferError(ValueError):
    """A downloaded state is unusable (checksum, names, shapes, non-finite values, config); or no peer gave one."""


@dataclass(frozen=True)
class StateSnapshot:
    """A peer's committed state after `round` committed rounds. `momentum` may be empty (no step yet)."""

    round: int
    params: Mapping[str, torch.Tensor]
    momentum: Mapping[str, torch.Tensor]
    config: RunConfig
    voters: tuple[Voter, ...] = ()  # the next round's voters (empty: the scope's genesis decides)


def encode_snapshot(snapshot: StateSnapshot) -> StateBlob:
    """Serialize (safetensors) and checksum a snapshot; the blob is a copy, so later updates never leak in."""
    return _state_blob(snapshot, safetensors_blob(_named(snapshot), metadata=_metadata(snapshot)))


def _named(snapshot: StateSnapshot) -> dict[str, torch.Tensor]:
    tensors = {_PARAMS + k: v.detach().cpu() for k, v in snapshot.params.items()}
    tensors.update({_MOMENTUM + k: v.detach().cpu() for k, v in snapshot.momentum.items()})
    return tensors


def _metadata(snapshot: StateSnapshot) -> dict[str, str]:
    return {_VOTERS: json.dumps(voters_to_json(snapshot.voters))}


def _state_blob(snapshot: StateSnapshot, blob: memoryview) -> StateBlob:
    return StateBlob(snapshot.config.train.run_id, snapshot.round, json.dumps(public_dict(snapshot.config)), blob,
                     hashlib.sha256(blob).digest())


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def safetensors_blob(tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str]) -> memoryview:
    """The safetensors format in one buffer, each tensor's bytes copied in once.

    `safetensors.torch.save` builds the same bytes in Rust and then copies them into a Python bytes
    object: two model-sized buffers at once, for a state served after every commit."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors code here")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(text)) + text
    # Allocated by torch, not zero-filled, and filled with torch copies: both release the GIL (a bytearray
    # is zeroed, and a memoryview assignment copies, under the GIL: the peer's event loop would stall).
    out = torch.empty(len(head) + offset, dtype=torch.uint8)
    out[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    at = len(head)
    for t in tensors.values():
        nbytes = t.numel() * t.element_size()
        if nbytes:
            out[at:at + nbytes].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        at += nbytes
    return out.numpy().data


def decode_snapshot(state: StateBlob, *, expected_shapes: Mapping[str, Sequence[int]] | None = None) -> StateSnapshot:
    """Verify and load a downloaded blob; StateTransferError names what is wrong."""
    if hashlib.sha256(state.blob).digest() != state.sha256:
        raise StateTransferError(f"round-{state.round} state: sha256 mismatch (corrupted in transit)")
    try:
        tensors = st_load(state.blob if isinstance(state.blob, bytes) else bytes(state.blob))
    except (SafetensorError, ValueError) as e:
        raise StateTransferError(f"round-{state.round} state: not a safetensors blob ({e})") from None
    params = {k[len(_PARAMS):]: v for k, v in tensors.items() if k.startswith(_PARAMS)}
    momentum = {k[len(_MOMENTUM):]: v for k, v in tensors.items() if k.startswith(_MOMENTUM)}
    if len(params) + len(momentum) != len(tensors):
        raise StateTransferError(f"round-{state.round} state: unexpected tensor names "
                                 f"{sorted(k for k in tensors if not k.startswith((_PARAMS, _MOMENTUM)))}")
    _check_tensors(params, momentum, expected_shapes)
    try:
        config = from_dict(json.loads(state.config_json))
    except (ConfigError, json.JSONDecodeError) as e:
        raise StateTransferError(f"round-{state.round} state: bad run config ({e})") from None
    if state.round < 0:
        raise StateTransferError(f"state round {state.round} is negative")
    return StateSnapshot(state.round, params, momentum, config, _voters_of(state))


def _voters_of(state: StateBlob) -> tuple[Voter, ...]:
    """The voters in the safetensors header's metadata (absent: none)."""
    (size,) = struct.unpack("<Q", state.blob[:8])
    try:
        header = json.loads(bytes(state.blob[8:8 + size]))
        meta = header.get("__metadata__") or {}
        return voters_from_json(json.loads(meta.get(_VOTERS, "[]")), what="state voters")
    except (ValueError, UnicodeDecodeError, AttributeError, TypeError) as e:
        raise StateTransferError(f"round-{state.round} state: unreadable voters ({e})") from None


def _check_tensors(params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
                   expected: Mapping[str, Sequence[int]] | None) -> None:
    if expected is not None:
        if set(params) != set(expected):
            missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
            raise StateTransferError(f"state parameters differ from the model: missing {missing}, unexpected {extra}")
        for name, t in params.items():
            if tuple(t.shape) != tuple(expected[name]):
                raise StateTransferError(f"parameter {name}: shape {tuple(t.shape)}, the model has "
                                         f"{tuple(expected[name])}")
    for name, t in momentum.items():
        if name not in params or t.shape != params[name].shape:
            raise StateTransferError(f"momentum {name} has no parameter of the same shape")
    for kind, group in (("parameter", params), ("momentum", momentum)):
        for name, t in group.items():
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                raise StateTransferError(f"{kind} {name} holds NaN or Inf")


LiveState = Callable[[], AbstractContextManager[tuple[Hashable, StateSnapshot] | None]]
"""What `StateServer.serve` reads: entering it yields (a key that changes whenever the state does, the
state with the peer's own tensors) or None before there is one; while inside, the tensors do not change."""


class StateServer:
    """Serves this peer's committed state to joiners. Construct before `node.start()`.

    `serve(live)` serves the peer's live state, serialized when a joiner asks: nothing is held for
    long between requests (a peer serves rarely, and a blob kept ready would cost two copies of the
    model all the time). The copy is taken while `live` holds the state still (the peer's outer step
    or heal waits for it, about one memory copy of θ and momentum), hashed afterwards, and shared by
    the requests for the same state that arrive while it is streamed or within `hold_s` of the last
    one (a joiner asks several donors for headers, then each for a range). `publish(snapshot)` serves
    a fixed state instead, serialized at once.
    """

    def __init__(self, node: RpcNode, *, hold_s: float = 10.0, register: bool = True) -> None:
        """`register`: serve it on `node` now (a test registers a wrapper of it instead)."""
        self._lock = threading.Lock()  # one serialization at a time: concurrent joiners share its blob
        self._node = node
        self._hold_s = hold_s
        self._held: StateBlob | None = None  # the last served blob, kept `hold_s` after its last request
        self._held_until = 0.0  # time.monotonic()
        self._live: LiveState | None = None
        self._fixed: StateBlob | None = None
        self._shared: tuple[Hashable, weakref.ref[StateBlob]] | None = None
        if register:
            serve_state(node, self)

    def serve(self, live: LiveState) -> None:
        """Serve the state `live` yields from now on (see LiveState), in place of any published one."""
        with self._lock:
            self._live, self._fixed, self._shared, self._held = live, None, None, None

    def publish(self, snapshot: StateSnapshot) -> None:
        """Serve `snapshot` from now on, serialized now (the caller may change its tensors afterwards)."""
        state = encode_snapshot(snapshot)
        with self._lock:
            if self._fixed is not None and snapshot.round < self._fixed.round:
                raise ValueError(f"publish: round {snapshot.round} is older than the served {self._fixed.round}")
            self._live, self._fixed, self._shared, self._held = None, state, None, None

    def current(self) -> StateBlob | None:
        """The state to stream now, or None before there is one. Blocking: call it off the event loop."""
        with self._lock:
            if self._live is None:
                return self._fixed
            with self._live() as live:
                if live is None:
                    return None
                key, snapshot = live
                shared = self._shared[1]() if self._shared is not None and self._shared[0] == key else None
                if shared is not None:
                    self._hold(shared)
                    return shared
                blob = safetensors_blob(_named(snapshot), metadata=_metadata(snapshot))
            state = _state_blob(snapshot, blob)  # hashed after the live state is released
            self._shared = (key, weakref.ref(state))
            self._hold(state)
            return state

    def _hold(self, state: StateBlob) -> None:
        """Keep `state` for `hold_s` more seconds (caller holds the lock; the release runs on the node's loop)."""
        if self._hold_s <= 0:
            return
        self._held, self._held_until = state, time.monotonic() + self._hold_s
        loop = self._node.loop
        loop.call_soon_threadsafe(loop.call_later, self._hold_s, self._release_held)

    def _release_held(self) -> None:
        # Without the lock (a serialization may hold it for seconds, and this runs on the event loop): at
        # worst a blob held again just now is dropped early, and the next request serializes it again.
        if time.monotonic() >= self._held_until:
            self._held = None


def state_size_limit(shapes: Mapping[str, Sequence[int]]) -> int:
    """The most bytes a valid state of a model of these shapes takes: θ and outer momentum in fp32 and the
    safetensors header. A donor declaring more is refused before anything is allocated."""
    numel = sum(math.prod(shape) for shape in shapes.values())
    return 2 * 4 * numel + _HEADER_BYTES + 2 * _HEADER_BYTES_PER_TENSOR * len(shapes)


def fetch_state(node: RpcNode, endpoints: Sequence[str], *, run_id: str, min_round: int = 0,
                expected_shapes: Mapping[str, Sequence[int]] | None = None, max_bytes: int | None = None,
                timeout_s: float = 120.0) -> StateSnapshot:
    """Blocking `fetch_state_async`, from a thread other than the node's loop."""
    return node.run(fetch_state_async(node, endpoints, run_id=run_id, min_round=min_round,
                                      expected_shapes=expected_shapes, max_bytes=max_bytes, timeout_s=timeout_s),
                    timeout_s=timeout_s + 10.0)


async def fetch_state_async(node: RpcNode, endpoints: Sequence[str], *, run_id: str, min_round: int = 0,
                            expected_shapes: Mapping[str, Sequence[int]] | None = None, max_bytes: int | None = None,
                            timeout_s: float = 120.0) -> StateSnapshot:
    """Download and verify the state from the first of `endpoints` (newest first, say) that serves a
    valid one at round >= `min_round`; StateTransferError when none does within `timeout_s`. A state
    may take `max_bytes`, by default what one of `expected_shapes` can take (`state_size_limit`).
    Awaited from any loop; the download runs on the node's and the checks in a thread."""
    max_bytes = _max_bytes(max_bytes, expected_shapes)
    client = StateClient(node)
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    for endpoint in endpoints:
        if time.monotonic() >= deadline:
            errors.append(f"{endpoint}: no time left")
            continue
        try:
            state = await asyncio.wait_for(
                node.call(client.get_state(endpoint, run_id=run_id, max_bytes=max_bytes, deadline=deadline)),
                max(deadline - time.monotonic(), 0.0) + 5.0)
            snapshot = await asyncio.to_thread(decode_snapshot, state, expected_shapes=expected_shapes)
        except (RpcError, StateTransferError, TimeoutError) as e:
            log.warning("state transfer from %s failed: %s", endpoint, e or "no answer in time")
            errors.append(f"{endpoint}: {e or 'no answer in time'}")
            continue
        if snapshot.round < min_round:
            errors.append(f"{endpoint}: at round {snapshot.round} < {min_round}")
            continue
        log.info("downloaded round-%d state (%d B) from %s", snapshot.round, len(state.blob), endpoint)
        return snapshot
    raise StateTransferError(f"no peer served a valid state: {'; '.join(errors) or 'no endpoints given'}")


def _max_bytes(max_bytes: int | None, expected_shapes: Mapping[str, Sequence[int]] | None) -> int:
    if max_bytes is not None:
        return max_bytes
    return UNBOUNDED_STATE_BYTES if expected_shapes is None else state_size_limit(expected_shapes)


def fetch_state_parallel(node: RpcNode, endpoints: Sequence[str], *, run_id: str,
                         expected_shapes: Mapping[str, Sequence[int]] | None = None, max_bytes: int | None = None,
                         timeout_s: float = 120.0) -> tuple[StateSnapshot, tuple[str, ...]]:
    """Blocking `fetch_state_parallel_async`, from a thread other than the node's loop."""
    return node.run(fetch_state_parallel_async(node, endpoints, run_id=run_id, expected_shapes=expected_shapes,
                                               max_bytes=max_bytes, timeout_s=timeout_s), timeout_s=timeout_s + 10.0)


async def fetch_state_parallel_async(node: RpcNode, endpoints: Sequence[str], *, run_id: str,
                                     expected_shapes: Mapping[str, Sequence[int]] | None = None,
                                     max_bytes: int | None = None,
                                     timeout_s: float = 120.0) -> tuple[StateSnapshot, tuple[str, ...]]:
    """The state most of `endpoints` serve, a range from each: (the verified snapshot, the endpoints
    that served it). Each donor is first asked for its header (sha256 and size of the blob it
    serves); the blob that most of them serve (at least two) is split into one range per donor,
    fetched at once; a range whose donor fails or has moved on is fetched from another of them. The
    whole blob must hash to the header's sha256: one donor serving other bytes fails the download
    (StateTransferError), and the caller goes on one donor at a time."""
    deadline = time.monotonic() + timeout_s
    try:
        state, served = await asyncio.wait_for(node.call(_download_ranges(
            StateClient(node), list(endpoints), run_id=run_id, max_bytes=_max_bytes(max_bytes, expected_shapes),
            deadline=deadline)), timeout_s + 5.0)
    except TimeoutError:
        raise TimeoutError(f"state transfer from {', '.join(endpoints)} took longer than {timeout_s:.1f}s") from None
    try:
        snapshot = await asyncio.to_thread(decode_snapshot, state, expected_shapes=expected_shapes)
    except StateTransferError as e:
        raise StateTransferError(f"{e}: a range from one of {', '.join(served)} is not the state its header "
                                 "announces") from None
    log.info("downloaded round-%d state (%d B) in %d ranges from %s", snapshot.round, len(state.blob), len(served),
             ", ".join(served))
    return snapshot, served


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering [0, total) in `parts` nearly equal non-empty pieces (fewer for tiny blobs)."""
    parts = max(1, min(parts, total))
    edges = [total * i // parts for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


async def _download_ranges(client: StateClient, endpoints: list[str], *, run_id: str, max_bytes: int,
                           deadline: float) -> tuple[StateBlob, tuple[str, ...]]:
    heads = await asyncio.gather(*(client.get_range(e, run_id=run_id, max_bytes=max_bytes, deadline=deadline,
                                                    header_only=True) for e in endpoints), return_exceptions=True)
    # Donors of one blob: the config in a header is each donor's own (its local sections differ), not compared.
    same: dict[tuple[str, int, int, bytes], list[str]] = {}
    configs: dict[str, str] = {}
    for endpoint, head in zip(endpoints, heads, strict=True):
        if isinstance(head, BaseException):
            log.info("state header from %s: %s", endpoint, head)
            continue
        h = head.header
        same.setdefault((h.run_id, h.round, h.total_bytes, bytes(h.sha256)), []).append(endpoint)
        configs[endpoint] = h.config_json
    if not same or max(len(v) for v in same.values()) < 2:
        raise StateTransferError(f"no two of {len(endpoints)} donors serve the same state")
    key, donors = max(same.items(), key=lambda kv: len(kv[1]))  # the first of the largest: donors' order breaks ties
    run, round_index, total, sha256 = key
    buf = bytearray(total)
    view = memoryview(buf)
    ranges = split_ranges(total, len(donors))

    async def fetch(i: int) -> str:
        lo, hi = ranges[i]
        errors = []
        for endpoint in donors[i:] + donors[:i]:  # its own donor first, then the others in turn
            try:
                part = await client.get_range(endpoint, run_id=run_id, max_bytes=max_bytes, deadline=deadline,
                                              offset=lo, length=hi - lo, into=view[lo:hi])
            except RpcError as e:
                errors.append(f"{endpoint}: {e}")
                continue
            if bytes(part.header.sha256) != sha256:
                errors.append(f"{endpoint}: serves another state now (it moved on)")
                continue
            return endpoint
        raise StateTransferError(f"state bytes [{lo}, {hi}) from no donor: {'; '.join(errors)}")

    served = await asyncio.gather(*(fetch(i) for i in range(len(ranges))))
    return StateBlob(run, round_index, configs[donors[0]], buf, sha256), tuple(dict.fromkeys(served))
