"""The outer round as pure code: its state machine (machine.py), heal decision (heal.py), the decision's
ballots, quorums and values (ballots.py), a voter's acceptor state (acceptor.py), certificates and their chains
(certificate.py), the consensus messages (messages.py), a round's group and its members (group.py), the
group's rule for material (rules.py), and the bounded set of voters a commit names (committee.py).

No I/O, no threads, no clock but the one injected: the round driver (swarmtrain/driver) and the averaging
services drive it.
gossip_groups.py: who averages with whom in a gossip round, computed by every peer alone.
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
from swarmtrain.round.rules import has_quorum

__all__ = [
    "Action", "Average", "Finish", "Heal", "HealPlan", "Launch", "Phase", "RoundMachine", "RoundMachineError",
    "Settle", "Train", "Transition", "Wait", "has_quorum", "keeps_progress", "majority_state", "plan_heal",
    "swarm_round_end",
]
