"""A stage server's copies of its neighbouring stages' state (`pipeline.lost_stage = "checkpoint"`), and the
verified download of a stage's θ_global from its servers that copies, moves and rebuilds share.

A copy is θ_global of a neighbouring stage at one of its rounds, taken from that stage's servers and checked
against the digest a strict majority of them announce at their newest round. It is refreshed when the stage's
servers announce a newer round than the copy's, at most once every `pipeline.stage_copy_period_s`; a copy of a
stage that is no longer a neighbour (the server moved) is dropped. The outer momentum is not kept: a copy
costs one fp32 copy of the stage's blocks per neighbour, and a restored stage restarts its momentum, as a
rebuilt one does.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmtrain.config import ModelConfig
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.discovery import PeerRecord
from swarmtrain.driver.part import CommittedState
from swarmtrain.peer.network import NetworkPlane
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.lost import copy_stages
from swarmtrain.pipeline.parts import stage_module

__all__ = ["StageCopies", "StageCopy", "fetch_stage_state", "stage_param_shapes"]

log = logging.getLogger(__name__)

ParamShapes = list[tuple[str, tuple[int, ...]]]


def stage_param_shapes(model: ModelConfig, stage: int, stages: int) -> ParamShapes:
    """Stage `stage`'s (name, shape) in θ's flat order, without allocating its weights."""
    with torch.device("meta"):
        part = stage_module(model, stage_blocks(model.shape_value("n_layer"), stages)[stage])
    return param_shapes(part)


async def fetch_stage_state(plane: NetworkPlane, stage: int, records: Sequence[PeerRecord], *, max_donors: int,
                            param_shapes: ParamShapes | None = None,
                            momentum: bool = False) -> tuple[CommittedState, str] | None:
    """Stage `stage`'s committed state (with `momentum` its outer momentum, else None) from its servers at their
    newest round, with who served it; None (logged) when none serves one that checks out.

    The digest to match is the one a strict majority of the servers at the newest round announce (a heal's
    rule: a lone liar cannot outvote the stage), and the served state must hash to it whole: round, θ_global,
    outer momentum and voters."""
    holders = [p for p in records if p.role == "stage_server" and p.stage == stage and p.endpoint]
    if not holders:
        return None
    top = max(p.round for p in holders)
    at_top = [p for p in holders if p.round == top]
    want, count = collections.Counter(p.state_hash for p in at_top).most_common(1)[0]
    if 2 * count <= len(at_top):
        log.warning("stage %d: no digest has a strict majority of its %d servers at round %d", stage, len(at_top),
                    top)
        return None
    donors = [p for p in at_top if p.state_hash == want]
    # A range from each of several at once first (they must serve one blob), then one at a time, as a heal does.
    width = min(max_donors, len(donors))
    for chosen in ([donors[:width]] if width > 1 else []) + [[d] for d in donors]:
        try:
            state, served = await plane.fetch_state([p.endpoint for p in chosen], param_shapes=param_shapes)
        except Exception as e:  # PeerError, a transfer error, a dead donor
            log.warning("no θ_global of stage %d from %s: %s", stage, [p.peer_id for p in chosen], e)
            continue
        if state.round != top or state.digest != want:
            log.warning("stage %d served round %d %s, its servers announced round %d %s", stage, state.round,
                        state.digest[:12], top, want[:12])
            continue
        who = ",".join(p.peer_id for p in chosen if p.endpoint in served)
        return dataclasses.replace(state, outer_momentum=state.outer_momentum if momentum else None), who
    return None


@dataclass(frozen=True)
class StageCopy:
    """θ_global of `stage` at `round` (hash `state_hash`), served by `source`, kept at `taken_at` (monotonic)."""

    stage: int
    round: int
    state_hash: str
    theta_global: torch.Tensor
    source: str
    taken_at: float


class StageCopies:
    """The copies one stage server keeps of its neighbouring stages (the caller refreshes them)."""

    def __init__(self, model: ModelConfig, *, stages: int, max_donors: int) -> None:
        self.model = model
        self.stages = stages
        self.max_donors = max_donors
        self._kept: dict[int, StageCopy] = {}
        self._shapes: dict[int, ParamShapes] = {}

    def announced(self) -> tuple[tuple[int, int], ...]:
        """(stage, round) of every copy kept, for the server's record."""
        return tuple(sorted((k, c.round) for k, c in self._kept.items()))

    def get(self, stage: int) -> StageCopy | None:
        return self._kept.get(stage)

    async def refresh(self, *, own_stage: int, plane: NetworkPlane, records: Sequence[PeerRecord]) -> list[StageCopy]:
        """Keep copies of `own_stage`'s neighbours only, and download again each whose servers announce a newer
        round than its copy; returns the copies taken now."""
        wanted = copy_stages(own_stage, stages=self.stages)
        for k in [k for k in self._kept if k not in wanted]:
            del self._kept[k]
        taken = []
        for k in wanted:
            announced = [p.round for p in records if p.role == "stage_server" and p.stage == k]
            kept = self._kept.get(k)
            if not announced or (kept is not None and kept.round >= max(announced)):
                continue
            if k not in self._shapes:
                self._shapes[k] = stage_param_shapes(self.model, k, self.stages)
            got = await fetch_stage_state(plane, k, records, max_donors=self.max_donors, param_shapes=self._shapes[k])
            if got is None:
                continue  # the old copy, if any, stays: older, but verified
            state, who = got
            copy = StageCopy(stage=k, round=state.round, state_hash=state.digest,
                             theta_global=state.theta_global, source=who, taken_at=time.monotonic())
            self._kept[k] = copy
            taken.append(copy)
        return taken
