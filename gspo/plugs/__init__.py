"""The trainer's plugs: what the loop may ask of each (protocols.py) and their implementations.

Every plug is built once before the loop (gspo/run.py: build_run) from its own config section and has
a do-nothing twin: parallel.py (the Topology: one process, DDP, FSDP2), routing.py and moe.py (MoE
routing replay and drift), baselines.py and critic.py (advantages from the group or PPO's critic),
reference.py (pi_ref of the KL term), auxiliary.py and supervised.py (the SFT term), lora.py, precision.py.
The Sampler and the prompt source live in gspo/rollout/ and gspo/data/.
"""

from gspo.plugs.protocols import AuxiliaryTerm, Baseline, PromptSource, Reference, Routing, RoutingWatch, Sampler

__all__ = ["AuxiliaryTerm", "Baseline", "PromptSource", "Reference", "Routing", "RoutingWatch", "Sampler"]
