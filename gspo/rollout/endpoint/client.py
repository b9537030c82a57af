"""The trainer's side of its rollout endpoints (`rollout_endpoints`): OpenAI-compatible servers it samples from,
token in and token out, and whose weights it updates by the four phases of the weight-transfer API.

`Endpoints` is the handle of the "endpoints" generator (`ENDPOINTS`, a GeneratorBackend the Sampler plug samples
with: gspo/rollout/sampler.py): each generator call's rows are sent as /v1/completions requests whose prompts are
token ids, whole groups at a time, spread over the endpoints by load (the one with the fewest rows in flight takes
the next share); each answer's choices carry their token ids, mu (the sampled tokens' log-probs) and the version
of the weights that sampled them, checked against the version the trainer last pushed. With seeded sampling a
request carries its rows' seeds (choice j of a request seeded S is seeded S + j; gspo serve also takes a list),
so each row samples what the in-process sampler would draw for it.

`push(policy, version)`: /start_weight_update, /update_weights (the tensors over gspo's wire, where the endpoint
joined the trainer at /init_weight_transfer_engine: gspo/rollout/endpoint/weights.py; or, for a vllm serve endpoint
with rollout_weight_transfer=nccl, vLLM's NCCL broadcast: vllm_nccl.py), /finish_weight_update with the version, on
every endpoint at once; each answers with its probe, which must match the policy's.

Every request bears the run's secret. An endpoint that fails, times out or answers what was not asked is named in
one line (`EndpointLost`): the trainer then stops with a checkpoint, as for a lost rollout worker.
"""

from __future__ import annotations

import math
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from gspo.config.sampling import split_endpoint
from gspo.rollout.registry import GeneratorBackend

KINDS = ("gspo", "vllm")  # the servers an endpoint may be (its /v1/models' owned_by)
MAX_ROWS_PER_REQUEST = 256  # completions per request at most (gspo serve samples a request in calls of its max_rows)


class EndpointLost(ValueError):
    """A rollout endpoint (or rollout worker) failed, went silent or answered what was not asked; the message names
    it. The trainer then stops with a checkpoint of the last step it finished."""


class Endpoints:
    """The run's rollout endpoints: sampling (`sample`, the ENDPOINTS generator's) and weight updates (`push`).

    `urls`: each endpoint's base URL (gspo serve's or vllm serve's, with or without /v1); `secret`: the run's,
    sent as the bearer token; `timeout_s`: the longest wait for one answer (rollout_timeout_s); `vocab_size`:
    token ids outside it are refused; `names`: what errors call each (default "rollout endpoint <url>");
    `weight_transfer`: how vllm serve endpoints take weights (TRANSFERS; gspo serve's always by "gspo");
    `device`: the policy's (the trainer's NCCL rank is on it)."""

    def __init__(self, urls: list[str], secret: bytes, *, timeout_s: float, vocab_size: int,
                 names: list[str] | None = None, weight_transfer: str = "gspo", device: str = "cpu"):
        from gspo.rollout.endpoint.server import need

        need("serve", "httpx")
        import httpx

        self.bases = [split_endpoint(u)[0] for u in urls]
        self.named = dict(zip(self.bases, names or [f"rollout endpoint {base}" for base in self.bases]))
        self.timeout_s, self.vocab_size, self.secret = timeout_s, vocab_size, secret
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 headers={"Authorization": "Bearer " + secret.decode()})
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(urls)), thread_name_prefix="gspo-endpoints")
        self.in_flight = [0] * len(urls)  # rows asked of each endpoint and not yet answered
        self.version: str | None = None  # the weights' version the trainer last pushed
        self.links: list | None = None  # how each endpoint takes weights, once joined (`_join`)
        self.device = torch.device(device)
        self.routing_layers: tuple | None = None  # the policy's routers' layers, while a call records (`recording`)
        self.routed: list | None = None  # each row's experts, (fed tokens, R, k) per row, of the last call
        self.models, self.kinds = [], []
        for base in self.bases:
            listed = self._call(base, "GET", "/v1/models", None, "listing its model")
            data = listed.get("data") if isinstance(listed, dict) else None
            if not (isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"),
                                                                                                  str)):
                raise EndpointLost(f"{self.named[base]}: /v1/models lists no model")
            self.models.append(data[0]["id"])
            self.kinds.append(data[0].get("owned_by"))
        others = [f"{b} (owned_by {k!r})" for b, k in zip(self.bases, self.kinds) if k not in KINDS]
        if others:
            raise ValueError(f"rollout_endpoints: {', '.join(others)}: gspo samples from and updates gspo serve and "
                             "vllm serve endpoints only")
        if weight_transfer != "gspo" and "vllm" not in self.kinds:
            raise ValueError(f"rollout_weight_transfer={weight_transfer}: it is how vllm serve endpoints take "
                             "weights, and none of rollout_endpoints is one (gspo serve takes them by gspo's)")
        self.transfers = [weight_transfer if kind == "vllm" else "gspo" for kind in self.kinds]
        if "nccl" in self.transfers:
            from gspo.rollout.endpoint.vllm_nccl import check_trainer_device

            check_trainer_device(self.device)

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _call(self, base: str, method: str, path: str, body: dict | None, what: str):
        """The JSON answer of one request; an EndpointLost naming the endpoint and `what` otherwise."""
        import httpx

        try:
            response = self.http.request(method, base + path, json=body)
        except httpx.TimeoutException:
            raise EndpointLost(f"{self.named[base]}: no answer within rollout_timeout_s={self.timeout_s:g} "
                               f"({what})") from None
        except httpx.HTTPError as err:
            raise EndpointLost(f"{self.named[base]}: {what}: {type(err).__name__}: {err}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200:
            detail = answer.get("error") if isinstance(answer, dict) else None
            detail = detail.get("message") if isinstance(detail, dict) else detail or response.text[:200]
            raise EndpointLost(f"{self.named[base]}: {what}: HTTP {response.status_code}: {detail}")
        if answer is None:
            raise EndpointLost(f"{self.named[base]}: {what}: the answer is not JSON")
        return answer

    # -- sampling -----------------------------------------------------------------------------------------------
    def sample(self, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, min_p,
               repetition_penalty, greedy, seeded, with_logprobs, group_size):
        """The ENDPOINTS generator: completion ids (N, T) and mu (N, T) of rows `prompt_ids` (N, L), left-padded,
        in groups of `group_size` copies of a prompt."""
        N = prompt_ids.shape[0]
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        g = group_size if group_size > 1 and N % group_size == 0 and all(
            rows[i] == rows[i - i % group_size] for i in range(N)) else 1
        seeds = list(seeded.seeds) if seeded is not None else None
        offsets = seeded.offsets() if seeded is not None else None  # an episode's later turn: where its stream is
        options = {"max_tokens": max_new_tokens, "temperature": 0.0 if greedy else temperature, "logprobs": 0,
                   "return_token_ids": True}
        options.update({k: v for k, v, off in (("top_p", top_p, 1.0), ("top_k", top_k, 0), ("min_p", min_p, 0.0),
                                               ("repetition_penalty", repetition_penalty, 1.0)) if v != off})
        groups = N // g
        shares = _shares(groups, len(self.bases), MAX_ROWS_PER_REQUEST // g or 1)  # [(first group, groups)]
        futures = []
        for first, count in shares:
            where = min(range(len(self.bases)), key=lambda e: (self.in_flight[e], e))
            self.in_flight[where] += count * g
            lo, hi = first * g, (first + count) * g
            for a, b, body in self._requests(where, rows, lo, hi, g, options, None if greedy else seeds, offsets):
                futures.append((a, b, where, self.pool.submit(self._complete, where, body, b - a)))
        out: list = [None] * N
        try:
            for lo, hi, _, future in futures:
                out[lo:hi] = future.result()
        finally:
            for lo, hi, where, _ in futures:
                self.in_flight[where] -= hi - lo
        if seeded is not None:  # each request's rows were sampled in one call, their streams all advanced by its steps
            seeded.advance([max(len(row[0]) for row in out[lo:hi]) for lo, hi, _, _ in futures
                            for _ in range(hi - lo)])
        width = max([len(row[0]) for row in out] + [1])
        device = prompt_ids.device
        ids = torch.full((N, width), pad, dtype=torch.long)  # (N, T)
        mu = torch.zeros((N, width), dtype=torch.float32)  # (N, T)
        if self.routing_layers is not None:  # laid out on (prompt_ids, completion) as the trainer's forwards see them
            self.routed = [(len(rows[i]), row[2]) for i, row in enumerate(out)]
            self.routed_shape = (prompt_ids.shape[1], width)
        for i, (tokens, logprobs, _) in enumerate(out):
            ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mu[i, :len(tokens)] = torch.tensor(logprobs, dtype=torch.float32)
        return ids.to(device), (mu.to(device) if with_logprobs else None)

    def _requests(self, where: int, rows: list, lo: int, hi: int, g: int, options: dict, seeds, offsets):
        """(first row, end row, body) of each request that samples rows lo..hi on endpoint `where`: gspo serve takes
        them in one (a seed per choice, how far each seed's stream went, the experts with their padding); vLLM, which
        seeds a request's prompts alike and goes on with no stream, one per row when seeded (a later turn's seed
        derived from the row's seed and how far it went)."""
        base = {"model": self.models[where], **options}
        if self.kinds[where] == "gspo":
            body = {**base, "prompt": rows[lo:hi:g], "n": g,
                    **({"return_routed_experts": "padded"} if self.routing_layers else {})}
            if seeds is not None:
                share = seeds[lo:hi]
                body["seed"] = share[0] if share == list(range(share[0], share[0] + len(share))) else share
                if any(offsets[lo:hi]):
                    body["seed_offset"] = offsets[lo:hi]
            return [(lo, hi, body)]
        if seeds is None:
            return [(lo, hi, {**base, "prompt": rows[lo:hi:g], "n": g})]
        return [(i, i + 1, {**base, "prompt": [rows[i]], "n": 1,
                            "seed": seeds[i] if not offsets[i] else (seeds[i] * 1_000_003 + offsets[i]) % 2**63})
                for i in range(lo, hi)]

    def _complete(self, where: int, body: dict, expected: int) -> list[tuple]:
        """(token ids, mu, routed experts or None) of each choice of one /v1/completions request, checked against
        what it asked."""
        base = self.bases[where]
        answer = self._call(base, "POST", "/v1/completions", body, f"sampling {expected} completions")
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != expected:
            raise EndpointLost(f"{self.named[base]}: answered {len(choices) if isinstance(choices, list) else 0} "
                               f"completions, asked for {expected}")
        version = answer.get("weight_version")  # gspo serve's (vLLM's answers carry none)
        if self.kinds[where] == "gspo" and self.version is not None and version != self.version:
            raise EndpointLost(f"{self.named[base]}: sampled with weights version {version!r}; the trainer "
                               f"pushed {self.version!r} (another trainer updates it?)")
        out = []
        for k, choice in enumerate(sorted(choices, key=lambda c: c.get("index", -1) if isinstance(c, dict) else -1)):
            tokens = choice.get("token_ids") if isinstance(choice, dict) else None
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") if isinstance(choice, dict) else None
            ok = (choice.get("index") == k and isinstance(tokens, list) and isinstance(logprobs, list)
                  and len(tokens) == len(logprobs) <= body["max_tokens"]
                  and all(type(t) is int and 0 <= t < self.vocab_size for t in tokens)
                  and all(isinstance(x, (int, float)) and not x > 0 and not math.isnan(x) for x in logprobs))
            if not ok:
                raise EndpointLost(f"{self.named[base]}: choice {k} is not {body['max_tokens']} or fewer token "
                                   f"ids below {self.vocab_size} with their log-probs")
            routed = None
            if self.routing_layers is not None:
                padding = choice.get("routed_experts_padding", 0)
                if type(padding) is not int or padding < 0:
                    raise EndpointLost(f"{self.named[base]}: choice {k}'s routed_experts_padding is not a count")
                prompt = body["prompt"][k // body["n"]]
                routed = padding, self._experts(base, k, choice.get("routed_experts"),
                                                padding + len(prompt) + len(tokens) - 1)
            out.append((tokens, [float(x) for x in logprobs], routed))
        return out

    def _experts(self, base: str, k: int, encoded, fed: int) -> torch.Tensor:
        """(at least fed, R, k') int64 experts of choice k: vLLM's format (base64 .npy bytes, read without pickle),
        checked."""
        import base64
        import io

        import numpy as np

        try:
            array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
        except (TypeError, ValueError, OSError) as err:
            raise EndpointLost(f"{self.named[base]}: choice {k} has no routed experts one can read ({err}); "
                               "routing_replay=rollout needs them (gspo serve of an MoE model returns them)") from None
        R = len(self.routing_layers)
        if array.dtype.kind not in "iu" or array.ndim != 3 or array.shape[0] < fed or array.shape[1] != R or (
                array.size and (array.min() < 0)):
            raise EndpointLost(f"{self.named[base]}: choice {k}'s routed experts are {array.dtype} "
                               f"{array.shape}, not ({fed} or more, {R}, k) expert numbers")
        return torch.from_numpy(array.astype(np.int64))

    def recording(self, layers: tuple):
        """A context in which each call returns its rows' experts: yields an object whose `record()` is the last
        call's RoutingRecord (R, N, P + T - 1, k), laid out as gspo.plugs.moe.record_routing records a forward."""
        return _Recording(self, tuple(layers))

    # -- weights ------------------------------------------------------------------------------------------------
    def push(self, version: int, payloads: dict) -> list[list[float]]:
        """Load the weights into every endpoint by the four phases, as weights version `version`; each endpoint's
        probe. `payloads`: per kind of endpoint ("gspo", "vllm") (tensors: one flat buffer per dtype name,
        update_info without the version): gspo serve takes the parameters in the policy's order (`flat_weights`,
        their names), vLLM the checkpoint's tensors with each one's name, dtype and shape."""
        if self.links is None:
            self._join()
        futures = [self.pool.submit(self._push_one, e, version, *payloads[self.kinds[e]])
                   for e in range(len(self.bases))]
        return [f.result() for f in futures]  # the caller sets self.version once the probes agree

    def _push_one(self, e: int, version: int, tensors: dict, info: dict) -> list[float]:
        base, call = self.bases[e], partial(self._call, self.bases[e])
        call("POST", "/start_weight_update", None, "starting a weight update")
        try:
            self.links[e].send(call, version, tensors, info)
        except (OSError, RuntimeError) as err:  # the wire's socket, NCCL
            raise EndpointLost(f"{self.named[base]}: sending the weights: {type(err).__name__}: {err}") from None
        answer = call("POST", "/finish_weight_update", {"weight_version": str(version)}, "finishing the weight update")
        probe = answer.get("probe") if isinstance(answer, dict) else None
        if self.kinds[e] == "vllm":
            probe = self._prompt_logprobs(e)
        if not (isinstance(probe, list) and all(isinstance(x, (int, float)) for x in probe)):
            raise EndpointLost(f"{self.named[base]}: finish_weight_update answered no probe")
        return [float(x) for x in probe]

    def alive(self, e: int) -> bool:
        """Whether endpoint `e` answers /v1/models now (a few seconds at most)."""
        import httpx

        try:
            return self.http.get(self.bases[e] + "/v1/models", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def weight_version(self, e: int) -> str | None:
        """The weights' version gspo serve endpoint `e` holds (its /weight_info), None where it cannot say."""
        try:
            answer = self._call(self.bases[e], "GET", "/weight_info", None, "reading its weights' version")
        except EndpointLost:
            return None
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return None if version is None else str(version)

    def rejoin(self, e: int) -> None:
        """Endpoint `e` came back (a new process at its URL): join it again for weights."""
        if self.links is not None:
            self.links[e].close()
            self.links[e] = self._join_one(e)

    def _prompt_logprobs(self, e: int) -> list[float]:
        """vLLM's log-probs of the probe's tokens (its prompt_logprobs), what gspo serve answers as its probe."""
        from gspo.rollout.endpoint.weights import probe_ids

        ids = probe_ids(self.vocab_size)[0].tolist()
        answer = self._call(self.bases[e], "POST", "/v1/completions",
                            {"model": self.models[e], "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                             "prompt_logprobs": 0}, "checking the weights on the probe")
        try:
            listed = answer["choices"][0]["prompt_logprobs"][1:]
            return [float(position[str(token)]["logprob"]) for position, token in zip(listed, ids[1:], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise EndpointLost(f"{self.named[self.bases[e]]}: its prompt_logprobs of the probe cannot be read"
                               ) from None

    def rng_states(self) -> list[str]:
        """Each endpoint's random state (base64 of torch's), what its unseeded sampling draws from next."""
        states = [self._call(base, "GET", "/rng_state", None, "reading its random state").get("rng_state")
                  for base in self.bases]
        if not all(isinstance(state, str) for state in states):
            raise EndpointLost("rollout endpoints: a random state that is not base64 text")
        return states

    def set_rng_states(self, states: list[str], only: int | None = None) -> None:
        """Set each endpoint's random state (`only`: that endpoint's alone)."""
        if len(states) != len(self.bases):
            raise ValueError(f"resume: the checkpoint holds the random states of {len(states)} rollout endpoint(s), "
                             f"this run has {len(self.bases)}")
        for e, (base, state) in enumerate(zip(self.bases, states)):
            if only is None or e == only:
                self._call(base, "POST", "/rng_state", {"rng_state": state}, "setting its random state")

    def _join(self) -> None:
        """/init_weight_transfer_engine on every endpoint, by its transfer (TRANSFERS)."""
        self.links = list(self.pool.map(self._join_one, range(len(self.bases))))

    def _join_one(self, e: int):
        return TRANSFERS[self.transfers[e]](self, e)

    def _join_wire(self, e: int) -> _WireLink:
        """gspo's backend: the endpoint joins a listener of the trainer's own (on the address this machine reaches it
        from), both proving the run's secret."""
        from gspo.rollout.endpoint.weights import BACKEND
        from gspo.rollout.endpoint.wire import invite_one

        base = self.bases[e]
        host = _local_address(base, self.named[base])

        def invite(port):
            return self._call(base, "POST", "/init_weight_transfer_engine",
                              {"init_info": {"backend": BACKEND, "host": host, "port": port, "rank": 1}},
                              "joining the trainer for weights")

        try:
            sock = invite_one(host, self.secret, invite, self.timeout_s,
                              refused=lambda line: print(f"rollout endpoints: refused a connection from {line}",
                                                         file=sys.stderr, flush=True))
        except TimeoutError as err:
            raise EndpointLost(f"{self.named[base]}: it did not join the trainer at {host}: {err}") from None
        return _WireLink(sock, self.pool)

    def _join_nccl(self, e: int):
        """vLLM's NCCL backend (gspo/rollout/endpoint/vllm_nccl.py): an NCCL group with the server's GPUs."""
        from gspo.rollout.endpoint.vllm_nccl import join

        base = self.bases[e]
        try:
            return join(partial(self._call, base), self.named[base], self.device, self.timeout_s)
        except (TimeoutError, RuntimeError) as err:
            raise EndpointLost(f"{self.named[base]}: joining it by NCCL: {type(err).__name__}: {err}") from None

    def close(self) -> None:
        for link in self.links or ():
            link.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


class _WireLink:
    """gspo's backend: the authenticated socket an endpoint joined; each update one tensors message on it."""

    def __init__(self, sock, pool) -> None:
        self.sock, self.pool = sock, pool

    def send(self, call, version: int, tensors: dict, info: dict) -> None:
        """The tensors while the endpoint answers /update_weights (it reads them meanwhile)."""
        from gspo.rollout.endpoint.wire import send

        sending = self.pool.submit(send, self.sock, "weights",
                                   {"version": version, "trained_only": info.get("trained_only", False)}, tensors)
        try:
            call("POST", "/update_weights", {"update_info": {"version": version, **info}}, "loading the weights")
        except EndpointLost:
            self.sock.close()  # a refused update: the send stops at once (the connection is done)
            raise
        sending.result()

    def close(self) -> None:
        self.sock.close()


# how a vllm serve endpoint takes weights (rollout_weight_transfer): gspo's backend (any device; the trainer's
# listener, the run's secret, tensors only) or vLLM's NCCL (the trainer's GPU and the server's in one NCCL group)
TRANSFERS = {"gspo": Endpoints._join_wire, "nccl": Endpoints._join_nccl}


class _Recording:
    def __init__(self, endpoints: Endpoints, layers: tuple):
        self.endpoints, self.layers = endpoints, layers

    def __enter__(self):
        self.endpoints.routing_layers, self.endpoints.routed = self.layers, None
        return self

    def __exit__(self, *exc):
        self.endpoints.routing_layers = None

    def record(self):
        from gspo.plugs.moe import RoutingRecord

        routed, (P, T) = self.endpoints.routed, self.endpoints.routed_shape
        k = max((experts.shape[2] for _, (_, experts) in routed), default=1)
        L = P + T - 1
        indices = torch.full((len(self.layers), len(routed), L, k), -1, dtype=torch.long)  # (R, N, L, k)
        for i, (prompt, (padding, experts)) in enumerate(routed):  # the row's prompt ends at position P here
            start = P - prompt - padding  # where the endpoint's first position lands (its padding may be wider)
            lo, hi = max(start, 0), min(start + experts.shape[0], L)
            indices[:, i, lo:hi] = experts[lo - start:hi - start].permute(1, 0, 2)
        return RoutingRecord(indices, self.layers)


def _shares(groups: int, endpoints: int, most: int) -> list[tuple[int, int]]:
    """(first group, number of groups) of each request: the groups in contiguous shares, as even as possible over
    the endpoints, at most `most` groups each."""
    parts = max(min(groups, endpoints), math.ceil(groups / most)) if groups else 0
    sizes = [groups // parts + (i < groups % parts) for i in range(parts)]
    return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]


def _local_address(base: str, name: str) -> str:
    """The address of this machine that reaches endpoint `base` (loopback for a loopback endpoint)."""
    _, host, port = split_endpoint(base)
    try:
        with socket.create_connection((host, port), timeout=10) as probe:
            return probe.getsockname()[0]
    except OSError as err:
        raise EndpointLost(f"{name}: cannot be reached ({err})") from None


def _unsupported(model) -> str:
    return "samples from rollout_endpoints only"


ENDPOINTS = GeneratorBackend(lambda endpoints, *args, **kwargs: endpoints.sample(*args, **kwargs), _unsupported)


__all__ = ["ENDPOINTS", "TRANSFERS", "EndpointLost", "Endpoints"]
