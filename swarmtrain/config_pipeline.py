"""The run config's `[pipeline]` section (SWARM pipelines, docs/pipeline.md), apart from config_sections.py
for its size; documented and validated the same way (`swarmtrain config reference` reads its field
docstrings too)."""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.config_sections import check

__all__ = ["LOST_STAGE_METHODS", "PipelineConfig"]

LOST_STAGE_METHODS = ("neighbours", "checkpoint", "off")


@dataclass(frozen=True)
class PipelineConfig:
    """SWARM pipelines: the model's blocks cut into stages served by several peers (docs/pipeline.md)."""

    stages: int = 0
    """Stages the model's transformer blocks are cut into, in order and as evenly as they go; trainers hold
    the embeddings and the head. 0 = no pipeline: every peer holds the whole model (DiLoCo data parallel)."""
    microbatch_size: int = 4
    """Sequences per micro-batch: what one call to a stage carries."""
    samples_per_step: int = 16
    """Sequences a server (and a trainer) accumulates gradients over before its inner optimizer step; a
    multiple of `microbatch_size`."""
    call_timeout_s: float = 10.0
    """Deadline in seconds of a call to a stage server that has no latency history yet."""
    deadline_factor: float = 4.0
    """A call to a server with a latency history gets this multiple of its p95 latency (at least
    `min_deadline_s`, at most `call_timeout_s`) before it is re-sent to another server of the stage."""
    min_deadline_s: float = 0.5
    """Shortest deadline in seconds of a call to a stage server."""
    avoid_s: float = 10.0
    """Seconds a server that failed a call is avoided (doubled at each further failure, up to 8×) unless
    no other server of its stage is left."""
    activation_codec: str = "fp32"
    """Codec of activations and their gradients on the wire: `fp32`, `fp16`, `bf16` or `int8`."""
    bulk_min_bytes: int = 8 << 20
    """An encoded activation or gradient of at least this many bytes travels over the server's bulk port
    (with `rpc.bulk_transport = "tcp"`), smaller ones inside the gRPC call; 0 = only those too large for
    `rpc.max_message_bytes`. The bulk path costs three more round trips, so it pays only for large tensors
    (where it starts to on loopback: docs/benchmarks.md#pipeline)."""
    max_contexts: int = 256
    """Micro-batches a server keeps the input of, for their backward (the oldest go first)."""
    context_ttl_s: float = 120.0
    """Seconds a server keeps a micro-batch's input for its backward."""
    max_stale_steps: int = 1
    """A server refuses the backward of a micro-batch whose forward ran more than this many of its steps
    ago, inner or outer (the trainer then runs that stage's forward again)."""
    rebalance: bool = False
    """Stage servers move to the bottleneck stage: every `rebalance_period_s` each compares the stages'
    capacities and loads from the servers' records, and the one server whose move raises the pipeline's
    capacity most (by at least `rebalance_margin`) moves (docs/pipeline.md#rebalancing)."""
    rebalance_period_s: float = 10.0
    """Seconds between two looks of a stage server at the stages' records; also the window its published
    load (the fraction of time it computed) covers."""
    rebalance_margin: float = 0.25
    """A move must raise the capacity of the pipeline's slowest stage by at least this fraction."""
    rebalance_cooldown_s: float = 60.0
    """No server moves for this many seconds after any server took its stage (moved, joined or restarted):
    the figures of the stages it left and joined settle first."""
    rebalance_observe_s: float = 20.0
    """The same move must be called for over this many seconds in a row before it is made."""
    rebalance_drain_s: float = 30.0
    """Seconds a moving server keeps answering the backwards of micro-batches whose forward it ran on its
    old stage (new forwards there are refused at once, and the trainers re-send them)."""
    lost_stage: str = "neighbours"
    """What rebuilds a stage left without a live server (docs/pipeline.md#lost-stages): `neighbours` (a
    server of a stage that keeps another takes the stage and starts it from the average of the two
    neighbouring stages' blocks, CheckFree's rule; middle stages only), `checkpoint` (every server keeps a
    verified copy of its neighbouring stages' state, refreshed every `stage_copy_period_s`; the spare server
    holding the freshest copy of the lost stage takes it and restarts it from that copy; any stage) or `off`
    (the stage stays unserved until a server joins it)."""
    stage_copy_period_s: float = 60.0
    """With `lost_stage = "checkpoint"`: seconds between two looks of a stage server at its neighbouring stages'
    rounds; a copy whose stage committed a newer round is downloaded again (a stage's size per server and
    period). A stage restored from a copy loses at most the rounds its servers committed in one period."""
    lost_stage_grace_s: float = 30.0
    """Seconds a stage that had a server must have none in the live records before it counts as lost (a
    restarting server comes back within it)."""
    stage_wait_s: float = 120.0
    """Seconds a trainer waits, re-reading the records, while a stage it must call has no server listed
    at all (a lost stage being taken; with servers listed that all failed the call it waits `call_timeout_s`,
    and at least until a dead server's record has expired: `discovery.record_ttl_s` + `heartbeat_s`); then
    the micro-batch is lost, with its reason."""

    def __post_init__(self) -> None:
        check(self.stages >= 0, "pipeline.stages", "must be >= 0 (0 = no pipeline)")
        check(self.microbatch_size >= 1, "pipeline.microbatch_size", "must be >= 1")
        check(self.samples_per_step >= self.microbatch_size and self.samples_per_step % self.microbatch_size == 0,
              "pipeline.samples_per_step", f"{self.samples_per_step} must be a positive multiple of "
              f"pipeline.microbatch_size ({self.microbatch_size})")
        for key in ("call_timeout_s", "min_deadline_s", "avoid_s", "context_ttl_s"):
            check(getattr(self, key) > 0, f"pipeline.{key}", "must be > 0")
        check(self.min_deadline_s <= self.call_timeout_s, "pipeline.min_deadline_s",
              f"{self.min_deadline_s} must not exceed pipeline.call_timeout_s ({self.call_timeout_s})")
        check(self.deadline_factor >= 1, "pipeline.deadline_factor", "must be >= 1")
        check(self.activation_codec in ("fp32", "fp16", "bf16", "int8"), "pipeline.activation_codec",
              f"{self.activation_codec!r} is not fp32, fp16, bf16 or int8")
        check(self.max_contexts >= 1, "pipeline.max_contexts", "must be >= 1")
        check(self.bulk_min_bytes >= 0, "pipeline.bulk_min_bytes", "must be >= 0")
        check(self.max_stale_steps >= 0, "pipeline.max_stale_steps", "must be >= 0")
        for key in ("rebalance_period_s", "rebalance_margin", "rebalance_drain_s"):
            check(getattr(self, key) > 0, f"pipeline.{key}", "must be > 0")
        for key in ("rebalance_cooldown_s", "rebalance_observe_s"):
            check(getattr(self, key) >= 0, f"pipeline.{key}", "must be >= 0")
        check(self.rebalance_cooldown_s >= self.rebalance_period_s or self.rebalance_cooldown_s == 0,
              "pipeline.rebalance_cooldown_s", f"{self.rebalance_cooldown_s} is shorter than "
              f"pipeline.rebalance_period_s ({self.rebalance_period_s}): a moved server's load would not be "
              "measured over one whole window before the next move (0 = no cooldown)")
        check(self.lost_stage in LOST_STAGE_METHODS, "pipeline.lost_stage",
              f"{self.lost_stage!r} is not one of {', '.join(LOST_STAGE_METHODS)}")
        check(self.stage_copy_period_s > 0, "pipeline.stage_copy_period_s", "must be > 0")
        check(self.lost_stage_grace_s > 0, "pipeline.lost_stage_grace_s", "must be > 0")
        check(self.stage_wait_s >= 0, "pipeline.stage_wait_s", "must be >= 0")
