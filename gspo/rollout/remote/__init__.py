"""Rollouts sampled in other processes (docs/samplers.md): wire.py (the authenticated channel: frames of a
JSON header and raw tensors, never pickle), protocol.py (the messages and their checks), worker.py (the
worker's side: a spawned worker or `gspo rollout-server`), client.py (the trainer's side: RemoteSampler)."""
