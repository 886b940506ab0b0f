"""SWARM pipelines: a model too big for one peer, cut into stages that several servers each serve.

Trainers hold the data, the embeddings and the head, and drive each micro-batch through one server
per stage (routing.py), re-sending it to another server of the stage when one fails or stalls;
servers hold a contiguous range of transformer blocks (parts.py, server.py, service.py) and step their
own inner optimizer once they have accumulated enough samples; each part's holders average it (outer.py).
The daemon roles: role_base.py, roles.py (trainer), server_role.py (server: one decision loop over the
pure rules of decisions.py, which moves it to the bottleneck stage by the rule of rebalance.py and has it
take a stage left without a server by the rules of lost.py). docs/pipeline.md has the whole design.
Also: cut.py (which blocks each stage holds), llama_parts.py (the Llama's stage and end parts), tensors.py
(activations and gradients on the wire), trainer.py (a trainer's steps), stage_copies.py (a server's copies of its
neighbours' state), memory.py (what a stage needs in memory), errors.py (typed errors), process.py (a role as a
process).
"""

from swarmtrain.pipeline.cut import stage_blocks, stage_of_block
from swarmtrain.pipeline.errors import (
    BadActivation,
    PipelineError,
    StageLost,
    StaleContext,
    UnknownMicrobatch,
    WrongStage,
)

__all__ = [
    "BadActivation",
    "PipelineError",
    "StageLost",
    "StaleContext",
    "UnknownMicrobatch",
    "WrongStage",
    "stage_blocks",
    "stage_of_block",
]
