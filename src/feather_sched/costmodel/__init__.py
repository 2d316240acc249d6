"""Step-cost model: hardware and model profiles, what one engine step costs, and its
calibration from measured step logs.

Shared by the simulator (``feather_sched.sim``) and the live model gate
(``feather_sched.gates.step_model``); it imports neither.
"""
