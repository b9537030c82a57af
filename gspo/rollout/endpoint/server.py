"""The HTTP side of the endpoint: a FastAPI app (the `serve` extra) with OpenAI's routes, its guard, and a server
thread.

Routes: GET /v1/models, POST /v1/chat/completions and /v1/completions (stream off and on), and the same under
/sessions/{id}/v1 for the trainer's agent episodes (each call recorded in its session).
Trust (DESIGN.md): the server binds the host it is given (loopback by default); a request must bear the run's
secret (`Authorization: Bearer <secret>`, what the openai client sends as its api_key) before anything it sends is
read: from any address but loopback always, from loopback too where `open_loopback` is off (inside a run). A
host other than loopback without a secret is refused at start.
"""


import asyncio
import contextlib
import hmac
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass, field

from gspo.rollout.endpoint.engine import Engine
from gspo.rollout.endpoint.requests import (
    BadRequest,
    Call,
    Limits,
    chat_prompt,
    check_fields,
    completion_prompts,
    job_of,
    normalise,
)
from gspo.rollout.endpoint.responses import (
    chat_chunks,
    chat_reply,
    chat_response,
    completion_chunks,
    completion_response,
    events,
)
from gspo.rollout.endpoint.sessions import Session, Sessions

logger = logging.getLogger(__name__)


@dataclass
class Endpoint:
    """What the routes answer with: the engine, the tokenizer and how requests are read."""

    engine: Engine
    tokenizer: object
    model_name: str = "gspo"
    template_kwargs: dict | None = None  # the run's chat_template_kwargs
    tool_style: str = "hermes"  # how the model writes tool calls (tool_call_style)
    limits: Limits = field(default_factory=Limits)
    sessions: Sessions = field(default_factory=Sessions)
    overrides: dict = field(default_factory=dict)  # request fields set whatever a request says (an evaluation's
    # temperature: greedy or eval_temperature)
    weights: object = None  # WeightReceiver (endpoint/weights.py): weight updates by the four phases; None: refused

    async def chat(self, body, session: Session | None) -> dict:
        """A chat.completion for `body` (a checked request), recorded in `session` if any."""
        check_fields(body, "chat")
        body = {**body, **self.overrides}
        prompt = chat_prompt(body, self.tokenizer, self.template_kwargs, session.calls if session else [])
        job = job_of(body, "chat", self.limits, prompt.token_ids, session.next_seed() if session else None)
        if session is not None:
            session.admit(job, prompt)
        samples = await self.sample(job)
        replies = [chat_reply(s, prompt.tools if prompt.parse_tools else None, self.tool_style) for s in samples]
        if session is not None:
            session.record(Call(prompt, samples, [normalise(message, 0) for message, _ in replies]))
            session.tool_calls += sum(len(message.get("tool_calls", ())) for message, _ in replies)
        return chat_response(samples, replies, prompt.token_ids, self.model_name, self.tokenizer,
                             bool(body.get("logprobs")))

    async def sample(self, job) -> list:
        """The job's samples, once the sampling thread ran it; a prompt the model cannot take is a BadRequest."""
        return (await self.sample_all([job]))[0]

    async def sample_all(self, jobs: list) -> list[list]:
        """Each job's samples, the jobs sampled as one unit (one generator call where their settings allow)."""
        try:
            futures = self.engine.submit_all(jobs)
        except ValueError as err:  # longer than the model's context, no tokens
            raise BadRequest(str(err), "max_tokens") from None
        return [await asyncio.wrap_future(future) for future in futures]

    async def complete(self, body, session: Session | None) -> dict:
        """A text_completion for `body`, its prompts sampled together; in a session each prompt is a call of its
        own."""
        from gspo.rollout.endpoint.requests import Prompt

        check_fields(body, "completion")
        body = {**body, **self.overrides}
        prompts = completion_prompts(body, self.tokenizer)
        jobs = []
        for i, ids in enumerate(prompts):
            job = job_of(body, "completion", self.limits, ids, session.next_seed() if session else None,
                         first_choice=i * (body.get("n") or 1))
            if session is not None:
                session.admit(job, Prompt(ids))
            jobs.append(job)
        samples = await self.sample_all(jobs)
        if session is not None:
            for ids, per_prompt in zip(prompts, samples):
                session.record(Call(Prompt(ids), per_prompt, [{} for _ in per_prompt]))
        return completion_response(samples, prompts, self.model_name, self.tokenizer, body.get("logprobs") is not None
                                   and body.get("logprobs") is not False)


def endpoint_of(sampler, model, tokenizer, secret: bytes | None, *, name: str, max_tokens: int, template_kwargs=None,
                tool_style: str = "hermes", rows: int = 64, autocast=contextlib.nullcontext):
    """The Endpoint serving `sampler` (the Sampler plug of `model`): its engine samples up to `rows` completions per
    generator call, under `autocast` (a context factory); with the run's `secret` it takes weight updates by the
    four phases (endpoint/weights.py)."""
    from gspo.rollout.endpoint.engine import engine_of
    from gspo.rollout.endpoint.requests import Limits
    from gspo.rollout.endpoint.weights import WeightReceiver

    engine = engine_of(sampler, max_rows=rows, autocast=autocast)
    weights = WeightReceiver(engine, model, sampler.sync, secret) if secret else None
    limits = Limits(max_tokens=max_tokens, max_tokens_cap=max(4096, max_tokens), max_n=max(64, rows))
    return Endpoint(engine, tokenizer, model_name=name, template_kwargs=template_kwargs, tool_style=tool_style,
                    limits=limits, weights=weights)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def need(extra: str, *modules: str) -> None:
    """A ValueError naming the extra to install where one of `modules` is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} is not installed: the endpoint needs the {extra} extra "
                         f"(pip install 'gspo[{extra}]')")


def make_app(endpoint: Endpoint, *, secret: bytes | None, open_loopback: bool = True):
    """The FastAPI app of `endpoint`. `secret`: the bearer token requests must carry (from loopback only where
    `open_loopback` is off); None: only loopback clients are answered."""
    need("serve", "fastapi", "uvicorn")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="gspo", docs_url=None, redoc_url=None, openapi_url=None)

    from gspo.rollout.endpoint.weights import ROUTES

    @app.middleware("http")
    async def guard(request: Request, call_next):  # before the body is read
        client = request.client.host if request.client else ""
        if request.url.path in ROUTES and secret is None:
            return JSONResponse(_error("weight updates need the run's secret: start gspo serve with "
                                       "GSPO_ROLLOUT_SECRET (or rollout_secret_file) set", "permission_error"),
                                status_code=403)
        if open_loopback and is_loopback(client) and request.url.path not in ROUTES:  # weights: always the secret
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if secret is None or not hmac.compare_digest(given, b"Bearer " + secret):
            return JSONResponse(_error("a bearer token (the run's secret) is required", "authentication_error"),
                                status_code=401)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, err: BadRequest):
        return JSONResponse(_error(str(err), "invalid_request_error", err.param), status_code=err.status)

    async def answer(request: Request, sid: str | None, route: str):
        session = endpoint.sessions.get(sid) if sid is not None else None
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        response = await (endpoint.chat(body, session) if route == "chat" else endpoint.complete(body, session))
        if not body.get("stream"):
            return JSONResponse(response)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = (chat_chunks if route == "chat" else completion_chunks)(response, endpoint.tokenizer, usage)
        return StreamingResponse(events(chunks), media_type="text/event-stream")

    @app.get("/v1/models")
    @app.get("/sessions/{sid}/v1/models")
    async def models(sid: str | None = None):
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "gspo",
                                            "created": 0}]}

    @app.post("/v1/chat/completions")
    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat(request: Request, sid: str | None = None):
        return await answer(request, sid, "chat")

    @app.post("/v1/completions")
    @app.post("/sessions/{sid}/v1/completions")
    async def completions(request: Request, sid: str | None = None):
        return await answer(request, sid, "completion")

    async def phase(request: Request, key: str | None, act):
        """Run one weight-transfer phase `act(value of body[key])` on a thread (it waits on the wire and the
        engine's lock)."""
        if endpoint.weights is None:
            raise BadRequest("this endpoint takes no weight updates", status=403)
        value = None
        if key is not None:
            try:
                body = await request.json()
            except ValueError:
                raise BadRequest("the request body is not JSON") from None
            if not isinstance(body, dict) or set(body) - {key}:
                raise BadRequest(f"the body must be {{{key!r}: ...}}", key)
            value = body.get(key)
        return await asyncio.to_thread(act, value)

    @app.post("/init_weight_transfer_engine")
    async def init_weights(request: Request):
        await phase(request, "init_info", lambda info: endpoint.weights.init(info))
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weights(request: Request):
        await phase(request, None, lambda _: endpoint.weights.start())
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        await phase(request, "update_info", lambda info: endpoint.weights.update(info))
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weights(request: Request):
        probe = await phase(request, "weight_version", lambda version: endpoint.weights.finish(version))
        return {"message": "Weight update finished", "weight_version": endpoint.engine.version, "probe": probe}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weights(request: Request):
        await phase(request, None, lambda _: endpoint.weights.shutdown())
        return {"message": "Weight transfer shut down"}

    @app.get("/rng_state")
    async def get_rng_state(request: Request):
        return {"rng_state": await phase(request, None, lambda _: endpoint.weights.rng_state())}

    @app.post("/rng_state")
    async def set_rng_state(request: Request):
        await phase(request, "rng_state", lambda state: endpoint.weights.set_rng_state(state))
        return {"message": "Random state set"}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": endpoint.engine.version}

    return app


def _listener(host: str, port: int) -> socket.socket:
    """A TCP listener on host:port whose accepted connections asyncio sets TCP_NODELAY on: it does so only for
    sockets made with proto IPPROTO_TCP, which `socket.create_server` leaves 0; without it each answer after a
    connection's first waits ~40 ms (Nagle's algorithm against the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _error(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class Server:
    """`make_app(endpoint)` served by uvicorn on a thread of its own, on `host`:`port` (0: a free port, read back
    as `.port`). The requests' sampling runs wherever the engine is driven (`Engine.run_once`)."""

    def __init__(self, endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 open_loopback: bool = True):
        need("serve", "fastapi", "uvicorn")
        import uvicorn

        if not is_loopback(host) and not secret:
            raise ValueError(f"serving on {host} (not loopback) needs the run's secret: set GSPO_ROLLOUT_SECRET or "
                             "rollout_secret_file; clients send it as their api_key")
        self.sock = _listener(host, port)
        self.host, self.port, self.endpoint = host, self.sock.getsockname()[1], endpoint
        app = make_app(endpoint, secret=secret, open_loopback=open_loopback)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="gspo-endpoint")
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


__all__ = ["Endpoint", "Server", "endpoint_of", "is_loopback", "make_app", "need"]
