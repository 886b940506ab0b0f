"""Typed errors of the pipeline: what a server refuses, and what a trainer reports as lost."""

from __future__ import annotations

__all__ = ["BadActivation", "PipelineError", "StageLost", "StaleContext", "UnknownMicrobatch", "WrongStage"]


class PipelineError(Exception):
    """Base of the pipeline's errors. `code` is the gRPC status a server answers it with."""

    code = "FAILED_PRECONDITION"


class BadActivation(PipelineError, ValueError):
    """An activation or gradient that is not what the stage takes: shape, dtype, size, NaN/Inf, undecodable."""

    code = "INVALID_ARGUMENT"


class WrongStage(PipelineError):
    """A call meant for another stage than the one this server holds."""

    code = "FAILED_PRECONDITION"


class UnknownMicrobatch(PipelineError):
    """A backward whose forward context this server does not hold (never seen, evicted, expired, restarted)."""

    code = "NOT_FOUND"


class StaleContext(PipelineError):
    """A backward whose forward ran more inner steps ago than `pipeline.max_stale_steps` allows."""

    code = "ABORTED"


class StageLost(PipelineError):
    """A micro-batch could not go through a stage: no server of it answered within the deadlines."""

    code = "UNAVAILABLE"
