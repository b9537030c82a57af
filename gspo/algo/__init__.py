"""The math of RL post-training, as pure functions on tensors: imports nothing of gspo's.

objectives.py (policy losses, registered by name in objective_registry.py, with their options;
aggregation.py: aggregations, KL estimators, ratio statistics), advantages.py (advantage estimators, registered;
GAE), values.py (PPO's value loss), correction.py (sampler-vs-trainer mismatch and its corrections),
balance.py (the MoE routers' load-balancing loss), logprobs.py (per-token log-probs and entropy without
full-vocabulary fp32 logits), schedules.py (lr and coefficient schedules). Each has hand-derived tests in tests/.
"""
