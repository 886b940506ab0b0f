"""The stage server's decision loop's rules on fabricated records: a lost stage this server takes comes before a
move, each look decides only what is due, a stage nobody takes is told once, a move to a stage that does not fit
is refused."""

from __future__ import annotations

import pytest

from swarmtrain.discovery import PeerRecord, StageLoad
from swarmtrain.pipeline.decisions import Move, Rebuild, Restore, ServerRules, Stay, describe
from swarmtrain.pipeline.lost import LostStageWatch
from swarmtrain.pipeline.rebalance import Rebalancer, RebalanceRule

pytestmark = pytest.mark.unit

GRACE_S = 5.0
RULE = RebalanceRule(margin=0.25, cooldown_s=0.0, observe_s=0.0)


def server(peer: str, stage: int, *, busy: float = 0.33, service_s: float = 0.1, round_: int = 4,
           copies: tuple[tuple[int, int], ...] = ()) -> PeerRecord:
    return PeerRecord(run_id="r", peer_id=peer, endpoint="127.0.0.1:1", role="stage_server", round=round_,
                      server=StageLoad(stage=stage, service_s=service_s, busy=busy, copies=copies))


def rules(me: str, *, stages: int = 3, lost_stage: str = "neighbours", rebalance: bool = True,
          fitting: tuple[int, ...] = (0, 1, 2)) -> ServerRules:
    blocks = [1] * stages
    return ServerRules(me=me, stages=stages, blocks=blocks, fitting=fitting, lost_stage=lost_stage,
                       watch=LostStageWatch(stages=stages, grace_s=GRACE_S),
                       rebalancer=Rebalancer(RULE, me=me, blocks=blocks) if rebalance else None)


ALL = (server("a", 0), server("b", 0), server("c", 1, busy=0.98), server("d", 2), server("e", 2))
WITHOUT_C = tuple(r for r in ALL if r.peer_id != "c")
BOTH = {"lost", "rebalance"}


def test_a_lost_stage_this_server_takes_comes_before_a_move() -> None:
    r = rules("a")
    assert r.choose(BOTH, ALL, now=0.0) == Stay(r.choose({"rebalance"}, ALL, now=0.0).why)
    assert isinstance(r.choose({"lost"}, WITHOUT_C, now=1.0), Stay)  # within the grace: a restart, maybe
    choice = r.choose(BOTH, WITHOUT_C, now=1.0 + GRACE_S)
    assert isinstance(choice, Rebuild) and (choice.lost, choice.pair, choice.round) == (1, (0, 2), 5)
    assert choice.records == WITHOUT_C and choice.lost_s == pytest.approx(GRACE_S)
    assert describe(choice) == "rebuilding stage 1 from stages 0 and 2"


def test_a_server_that_is_not_the_taker_stays_and_rebalancing_waits_for_its_own_look() -> None:
    r = rules("b")  # a takes stage 1 (the lowest id of a stage that can spare one)
    r.choose({"lost"}, ALL, now=0.0)
    assert r.choose({"lost"}, WITHOUT_C, now=1.0 + GRACE_S) == Stay()
    assert r.warnings == []  # another server takes it: nothing to tell


def test_the_freshest_copy_restores_the_stage() -> None:
    keeping = (server("a", 0), server("b", 0, copies=((1, 3),)), server("d", 2, copies=((1, 4),)), server("e", 2))
    chosen, other = rules("d", lost_stage="checkpoint"), rules("b", lost_stage="checkpoint")
    for r in (chosen, other):
        r.choose({"lost"}, (*keeping, server("c", 1)), now=0.0)
        assert r.choose({"lost"}, keeping, now=1.0) == Stay()
    choice = chosen.choose({"lost"}, keeping, now=1.0 + GRACE_S)
    assert isinstance(choice, Restore) and (choice.lost, choice.round) == (1, 5)
    assert describe(choice) == "restoring stage 1 from this server's copy"
    assert other.choose({"lost"}, keeping, now=1.0 + GRACE_S) == Stay()


def test_a_stage_nobody_takes_is_told_once() -> None:
    r = rules("a", lost_stage="off")
    r.choose({"lost"}, ALL, now=0.0)
    for now in (GRACE_S, 2 * GRACE_S, 3 * GRACE_S):
        assert r.choose({"lost"}, WITHOUT_C, now=now) == Stay()
    assert len(r.warnings) == 1 and "stage 1 has had no live server" in r.warnings[0]
    assert "pipeline.lost_stage = off" in r.warnings[0]


def test_rebalancing_moves_the_named_server_only_at_its_look() -> None:
    # stage 1 saturated and alone, stage 0 with three at a third of their time: a moves to 1
    loads = (server("a", 0), server("b", 0), server("c", 0), server("d", 1, busy=0.98))
    r = rules("a", stages=2, fitting=(0, 1))
    assert r.choose({"lost"}, loads, now=0.0) == Stay()
    choice = r.choose({"rebalance"}, loads, now=0.0)
    assert isinstance(choice, Move) and (choice.decision.move_to, choice.decision.source) == (1, 0)
    assert rules("a", stages=2, fitting=(0, 1), rebalance=False).choose(BOTH, loads, now=0.0) == Stay()


def test_a_move_to_a_stage_that_does_not_fit_is_refused_and_told() -> None:
    loads = (server("a", 0), server("b", 0), server("c", 0), server("d", 1, busy=0.98))
    r = rules("a", stages=2, fitting=(0,))
    assert isinstance(r.choose({"rebalance"}, loads, now=0.0), Stay)
    assert isinstance(r.choose({"rebalance"}, loads, now=1.0), Stay)
    assert len(r.warnings) == 1 and "does not fit train.memory_budget_mb" in r.warnings[0]
