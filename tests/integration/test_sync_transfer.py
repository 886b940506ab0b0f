"""State transfer between loopback peers: exact download, checksum/shape/NaN/run-key rejections, fallback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import threading
import time
import weakref

import pytest
import torch

from swarmtrain.config import RpcConfig, RunConfig
from swarmtrain.rpc.node import RpcNode, RpcRejected
from swarmtrain.rpc.state_wire import StateClient, serve_state
from swarmtrain.sync.transfer import (
    StateServer,
    StateSnapshot,
    StateTransferError,
    encode_snapshot,
    fetch_state,
    state_size_limit,
)
from swarmtrain.testing import FaultPlan, wait_until
from swarmtrain.testing.state_faults import faulty_state_server

pytestmark = pytest.mark.integration

RPC = RpcConfig(run_key="k", chunk_bytes=1024, max_message_bytes=1 << 20, retries=1, backoff_s=0.01)
CONFIG = RunConfig().replace(train={"run_id": "sync-run"}, diloco={"inner_steps": 7})
HOLD_S = 0.5  # how long the donor keeps a served blob for the next request


def _snapshot(round_index: int, *, nan: bool = False) -> StateSnapshot:
    g = torch.Generator().manual_seed(round_index)
    params = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g)}
    if nan:
        params["b"][3] = float("nan")
    return StateSnapshot(round_index, params, {"w": torch.randn(64, 33, generator=g)}, CONFIG)


@pytest.fixture
def peers(no_thread_leak: None):
    plan = FaultPlan()
    donor = RpcNode(RPC, peer_id="donor")
    server = faulty_state_server(donor, plan, hold_s=HOLD_S)
    spare = RpcNode(RPC, peer_id="spare")
    spare_server = StateServer(spare)
    joiner = RpcNode(RPC, peer_id="joiner", serve=False)
    for n in (donor, spare, joiner):
        n.start()
    yield donor, server, spare, spare_server, joiner, plan
    for n in (donor, spare, joiner):
        n.close()


def test_a_joiner_downloads_the_exact_newest_state(peers) -> None:
    donor, server, _, _, joiner, _ = peers
    server.publish(_snapshot(2))
    sent = _snapshot(3)
    server.publish(sent)
    sent.params["w"].add_(1.0)  # mutating after publish must not change what is served
    got = fetch_state(joiner, [donor.endpoint], run_id="sync-run", expected_shapes={"w": (64, 33), "b": (33,)},
                      timeout_s=10)
    assert got.round == 3 and got.config == CONFIG
    ref = _snapshot(3)
    assert all(torch.equal(got.params[k], ref.params[k]) for k in ref.params)
    assert torch.equal(got.momentum["w"], ref.momentum["w"])
    assert joiner.counters.totals()[1] > 64 * 33 * 4 * 2  # streamed in many 1 KiB chunks


def test_a_corrupted_download_is_rejected_and_the_next_peer_is_tried(peers, caplog) -> None:
    donor, server, spare, spare_server, joiner, plan = peers
    plan.add(peer="donor", round=4, call="state", action="corrupt")
    server.publish(_snapshot(4))
    spare_server.publish(_snapshot(4))
    caplog.set_level(logging.WARNING)
    got = fetch_state(joiner, [donor.endpoint, spare.endpoint], run_id="sync-run", timeout_s=10)
    assert got.round == 4 and torch.equal(got.params["b"], _snapshot(4).params["b"])
    assert any("sha256 mismatch" in r.message for r in caplog.records)


def test_a_state_altered_with_its_checksum_on_the_way_is_refused_by_its_mac(peers, caplog) -> None:
    donor, server, spare, spare_server, joiner, plan = peers
    plan.add(peer="donor", round=4, call="state", action="forge")  # a man in the middle rewrites both
    server.publish(_snapshot(4))
    spare_server.publish(_snapshot(4))
    caplog.set_level(logging.WARNING)
    got = fetch_state(joiner, [donor.endpoint, spare.endpoint], run_id="sync-run", timeout_s=10)
    assert got.round == 4 and torch.equal(got.params["b"], _snapshot(4).params["b"])
    assert any("MAC is wrong" in r.message for r in caplog.records)
    assert not any("sha256 mismatch" in r.message for r in caplog.records)  # the checksum matched the forgery


@pytest.mark.parametrize("case", ["shape", "nan", "run_id", "none_yet", "stale"])
def test_unusable_states_are_refused(peers, case: str) -> None:
    donor, server, _, _, joiner, _ = peers
    if case != "none_yet":
        server.publish(_snapshot(5, nan=case == "nan"))
    kwargs = {"expected_shapes": {"w": (64, 32), "b": (33,)}} if case == "shape" else {}
    run_id = "other-run" if case == "run_id" else "sync-run"
    min_round = 6 if case == "stale" else 0
    with pytest.raises(StateTransferError):
        fetch_state(joiner, [donor.endpoint], run_id=run_id, min_round=min_round, timeout_s=5, **kwargs)


def test_a_state_bigger_than_the_model_allows_is_refused_before_it_is_allocated(peers) -> None:
    donor, server, _, _, joiner, _ = peers
    big = _snapshot(1)
    big.params["w"] = torch.zeros(4096, 1024)  # a donor serving 16 MiB for a model of 64x33 + 33 values
    server.publish(dataclasses.replace(big, momentum={}))
    shapes = {"w": (64, 33), "b": (33,)}
    limit = state_size_limit(shapes)
    assert 2 * 4 * (64 * 33 + 33) < limit < 2 << 20
    with pytest.raises(StateTransferError, match=f"exceeds the {limit}-byte limit"):
        fetch_state(joiner, [donor.endpoint], run_id="sync-run", expected_shapes=shapes, timeout_s=5)
    assert joiner.counters.totals()[1] < 1 << 20  # the header was read, the payload never was


def test_a_wrong_run_key_gets_nothing(peers, caplog, monkeypatch) -> None:
    donor, server, _, _, _, _ = peers
    server.publish(_snapshot(1))
    monkeypatch.setenv("SWARMTRAIN_RUN_KEY", "not-the-key")
    intruder = RpcNode(RPC, peer_id="intruder", serve=False)
    intruder.start()
    try:
        caplog.set_level(logging.WARNING)
        with pytest.raises(StateTransferError, match="UNAUTHENTICATED"):
            fetch_state(intruder, [donor.endpoint], run_id="sync-run", timeout_s=5)
        assert any("wrong run key" in r.message for r in caplog.records)
    finally:
        intruder.close()


class _Live:
    """A peer's live state as `StateServer.serve` reads it: one lock, tensors changed in place under it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 0
        self.snapshot = _snapshot(2)
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):  # type: ignore[no-untyped-def]
        with self.lock:
            self.entered += 1
            yield self.version, self.snapshot

    def step(self, round_index: int) -> None:
        """An outer step: every tensor changes in place, with the round."""
        with self.lock:
            ref = _snapshot(round_index)
            for mine, new in ((self.snapshot.params, ref.params), (self.snapshot.momentum, ref.momentum)):
                for k, t in mine.items():
                    t.copy_(new[k])
            self.snapshot = dataclasses.replace(self.snapshot, round=round_index)
            self.version += 1


def _same(got: StateSnapshot, ref: StateSnapshot) -> bool:
    return got.round == ref.round and all(torch.equal(got.params[k], ref.params[k]) for k in ref.params) and all(
        torch.equal(got.momentum[k], ref.momentum[k]) for k in ref.momentum)


def test_a_live_state_is_serialized_when_asked_and_not_kept(peers) -> None:
    donor, server, _, _, joiner, _ = peers
    live = _Live()
    server.serve(live)
    assert live.entered == 0, "nothing is serialized before a joiner asks"
    assert _same(fetch_state(joiner, [donor.endpoint], run_id="sync-run", timeout_s=10), _snapshot(2))
    live.step(3)  # in place: the next joiner gets the new state
    assert _same(fetch_state(joiner, [donor.endpoint], run_id="sync-run", timeout_s=10), _snapshot(3))
    assert live.entered == 2
    blob = weakref.ref(server.current())
    gc.collect()
    assert blob() is server.current(), "a blob is shared by the requests within hold_s of each other"

    def dropped() -> bool:
        gc.collect()
        return blob() is None

    wait_until(dropped, timeout_s=HOLD_S + 10, what="the served blob dropped after hold_s")


def test_a_state_served_while_an_outer_step_waits_is_one_consistent_state(peers) -> None:
    """The step that comes while a GetState copies the live state waits for the copy; the joiner gets
    the state from before the step, whole, and the next joiner the state after it."""
    donor, server, _, _, joiner, _ = peers
    live, inside, go_on = _Live(), threading.Event(), threading.Event()
    real_enter = live.__call__

    @contextlib.contextmanager
    def slow_live():  # type: ignore[no-untyped-def]
        with real_enter() as state:
            inside.set()
            assert go_on.wait(10)
            yield state

    server.serve(slow_live)
    got: list[StateSnapshot] = []
    fetcher = threading.Thread(target=lambda: got.append(fetch_state(joiner, [donor.endpoint], run_id="sync-run",
                                                                     timeout_s=10)))
    fetcher.start()
    assert inside.wait(10)
    stepper = threading.Thread(target=live.step, args=(3,))
    stepper.start()
    stepper.join(0.2)
    assert stepper.is_alive(), "the step waits while the state is copied"
    go_on.set()
    stepper.join(10)
    fetcher.join(10)
    assert len(got) == 1 and _same(got[0], _snapshot(2))
    assert _same(fetch_state(joiner, [donor.endpoint], run_id="sync-run", timeout_s=10), _snapshot(3))


def test_joiners_of_one_state_share_its_blob(peers) -> None:
    _, server, _, _, _, _ = peers
    live = _Live()
    server.serve(live)
    first = server.current()
    assert server.current() is first and live.entered == 2, "a second request reuses the blob still streaming"
    live.step(3)
    assert server.current() is not first


def test_publishing_an_older_round_is_refused(peers) -> None:
    _, server, _, _, _, _ = peers
    server.publish(_snapshot(3))
    with pytest.raises(ValueError, match="older"):
        server.publish(_snapshot(2))


def test_the_state_blob_is_safetensors_that_the_library_reads_back_exactly() -> None:
    from safetensors.torch import load as st_load

    from swarmtrain.sync.transfer import safetensors_blob

    g = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(7, 3, generator=g), "h": torch.randn(5, generator=g).half(),
               "bf": torch.randn(2, 2, generator=g).bfloat16(), "i": torch.arange(6).reshape(2, 3),
               "empty": torch.zeros(0), "scalar": torch.tensor(2.5), "mask": torch.tensor([True, False])}
    blob = safetensors_blob(tensors, metadata={"k": "v"})
    back = st_load(bytes(blob))
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
    header_len = int.from_bytes(blob[:8], "little")
    assert header_len % 8 == 0 and b'"__metadata__":{"k":"v"}' in bytes(blob[8:8 + header_len])


class _Held:
    """A state source whose `current()` blocks until `release` is set (a peer busy serializing)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.blob = encode_snapshot(_snapshot(1))

    def current(self):  # type: ignore[no-untyped-def]
        self.entered.release()
        self.release.wait(10)
        return self.blob


def test_calls_past_the_servers_concurrency_limit_are_refused_not_queued(no_thread_leak: None) -> None:
    donor = RpcNode(dataclasses.replace(RPC, max_concurrent_calls=2), peer_id="donor")
    held = _Held()
    serve_state(donor, held)
    joiner = RpcNode(RPC, peer_id="joiner", serve=False)
    for n in (donor, joiner):
        n.start()
    try:
        client = StateClient(joiner)

        async def three() -> list[object]:
            async def one() -> object:
                try:
                    return await client.get_state(donor.endpoint, run_id="sync-run", max_bytes=1 << 20,
                                                  deadline=time.monotonic() + 10)
                except RpcRejected as e:
                    return e

            first = [asyncio.ensure_future(one()) for _ in range(2)]
            for _ in range(2):  # both are inside the server's handler before the third call goes out
                await asyncio.to_thread(held.entered.acquire, True, 10)
            third = await one()
            held.release.set()
            return [*(await asyncio.gather(*first)), third]

        results = joiner.run(three(), timeout_s=30)
    finally:
        held.release.set()
        for n in (donor, joiner):
            n.close()
    assert all(getattr(r, "round", None) == 1 for r in results[:2])
    assert isinstance(results[2], RpcRejected) and results[2].code == "RESOURCE_EXHAUSTED"
