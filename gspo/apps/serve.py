"""`gspo serve`: an OpenAI-compatible, token-in/token-out endpoint in front of a model (docs/agents.md).

    gspo serve model=runs/demo/rl/model --port 8000
    # then any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")

The model is loaded and sampled as a training run would (the config's sampling settings, generation_backend,
chat_template_kwargs, tool_call_style); the main thread samples, the HTTP server runs on a thread of its own.
"""

from __future__ import annotations

import signal
import sys
import threading


def serve(cfg, host: str = "127.0.0.1", port: int = 8000, *, ready=None, stop: threading.Event | None = None) -> None:
    """Serve `cfg.model` until Ctrl-C / SIGTERM (or `stop` is set). `ready(server)`: called once it listens."""
    from gspo.config import ModelSettings, rollout_secret, sampler_sections, section
    from gspo.models import seeded_model
    from gspo.rollout.endpoint.server import Server, endpoint_of
    from gspo.rollout.sampler import Sampler

    sampling, episodes, shape = sampler_sections(cfg)
    secret = rollout_secret(sampling)
    _, model, tokenizer = seeded_model(section(cfg, ModelSettings))
    sampler = Sampler(model, tokenizer, sampling, episodes, shape, seeded=False)
    endpoint = endpoint_of(sampler, model, tokenizer, secret, name=cfg.model, max_tokens=cfg.max_completion_length,
                           template_kwargs=cfg.chat_template_kwargs, tool_style=cfg.tool_call_style)
    server = Server(endpoint, host, port, secret=secret)
    stop = stop or threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if _main_thread() else None
    print(f"gspo serve: {cfg.model} at {server.url}/v1 ({sampler.reason}; "
          f"{'the secret is required from other hosts and for weights' if secret else 'loopback clients only'}); "
          "Ctrl-C stops",
          file=sys.stderr, flush=True)
    if ready is not None:
        ready(server)
    try:
        endpoint.engine.serve(stop)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        sampler.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


__all__ = ["serve"]
