"""A discrete-event simulator of RL post-training on on-demand plus spot GPUs (`spotlight simulate`).

It answers, before a launch, what a run costs and how fast it reaches its target under each policy
(on-demand only, inline exploration, Spotlight, disaggregated rollout on spot), at any cluster
size, on a real spot trace. It reuses the production pieces instead of modelling them: the pull
queue (`spot.jobqueue.JobQueue`, on a virtual clock), the planners (`planners`), the trace readers
(`spot.traces`) and the cost arithmetic (`spotlight.core.cost`).

    profile.py    per-phase durations: built-in paper-scale profiles, or measured from a run
    engine.py     event loop, spot pool from a trace, workers through the real queue, SP groups
    policies.py   each policy's iteration loop and the learning model (reward tables)
    plots.py      the comparison as JSON and PNG plots

    from spot.sim import Setup, simulate, builtin_profile
"""

from spot.sim.policies import POLICIES, Learning, PolicyResult, Setup, compare, simulate
from spot.sim.profile import Profile, builtin_profile, load_profile, profile_from_run

__all__ = [
    "POLICIES",
    "Learning",
    "PolicyResult",
    "Profile",
    "Setup",
    "builtin_profile",
    "compare",
    "load_profile",
    "profile_from_run",
    "simulate",
]
