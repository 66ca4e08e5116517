"""The actor runtime: actors, refs, supervisors and the clock."""

from aurora.runtime.actor import Actor, ActorCell, ActorRef, Exit
from aurora.runtime.clock import Clock, LoopClock, VirtualClock, settle
from aurora.runtime.groups import cancel_and_wait, first_error, unwrap_group, wait_first
from aurora.runtime.supervisor import ChildSpec, Supervisor
from aurora.runtime.threads import in_thread, to_the_end

__all__ = [
    "Actor",
    "ActorCell",
    "ActorRef",
    "ChildSpec",
    "Clock",
    "Exit",
    "LoopClock",
    "Supervisor",
    "VirtualClock",
    "cancel_and_wait",
    "first_error",
    "in_thread",
    "settle",
    "to_the_end",
    "unwrap_group",
    "wait_first",
]
