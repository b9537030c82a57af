"""gspo's OpenAI-compatible, token-in/token-out sampling endpoint (docs/agents.md): `gspo serve` in front of any
Sampler, and the trainer's endpoint for agent episodes.

engine.py batches requests into generator calls; requests.py and responses.py read and write OpenAI's formats;
sessions.py records an agent episode's calls; server.py is the HTTP side (FastAPI and uvicorn: the `serve` extra,
imported only there).
"""
