"""The outer round: its state machine (machine.py), commit rule (rules.py) and heal decision (heal.py).

Pure code: no I/O, no threads, no clock but the one injected. The peer daemon drives it.
"""

from swarmtrain.round.heal import HealPlan, keeps_progress, majority_state, plan_heal, swarm_round_end
from swarmtrain.round.machine import (
    Action,
    Average,
    Finish,
    Heal,
    Launch,
    Phase,
    RoundMachine,
    RoundMachineError,
    Settle,
    Train,
    Transition,
    Wait,
)
from swarmtrain.round.rules import electorate_problem, has_quorum, vote_problem, voters

__all__ = [
    "Action", "Average", "Finish", "Heal", "HealPlan", "Launch", "Phase", "RoundMachine", "RoundMachineError",
    "Settle", "Train", "Transition", "Wait", "electorate_problem", "has_quorum", "keeps_progress", "majority_state",
    "plan_heal",
    "swarm_round_end", "vote_problem", "voters",
]
