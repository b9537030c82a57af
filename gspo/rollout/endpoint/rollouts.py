"""The Sampler plug over rollout endpoints (`rollout_endpoints`; docs/distributed.md).

`EndpointSampler` is the trainer's own Sampler (prompts rendered and tokenized here, per-row seeds, groups) whose
generator is the endpoints (gspo/rollout/endpoint/client.py). Its calls run on one thread of their own, in the order
they were asked, so a rollout asked for `max_staleness` steps ahead (gspo/rollout/feed.py) samples while the trainer
trains. `sync(policy)` first waits for the rollouts asked before it (they sample with the weights of their time),
then pushes the new weights to every endpoint and checks each on the probe: so which weights sample which step is
fixed by the order of the trainer's calls, never by timing, as with rollout workers. The weights' version each
rollout was sampled with is the number of pushes before it; every endpoint's answer says the version it sampled
with, and must agree.

Under torchrun every rank samples its own share from the endpoints, and rank 0 alone pushes the weights: each
`sync` first waits until every rank's rollouts asked so far are in (a barrier), every rank then takes part in
gathering the weights (fsdp: a collective) and the probe, and rank 0's success or failure is shared with all.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

from gspo.rollout.batch import key_name
from gspo.rollout.endpoint.client import EndpointLost

KEEP_VERSIONS = 64  # the versions of this many latest rollouts are kept (for checkpoints; extra sampling rounds too)


class EndpointSampler:
    """The Sampler plug with its sampling on rollout endpoints: `request` / `receive` / `sync` as RemoteSampler's.

    Built from the policy as training starts (or resumes: `version`, the pushes so far): it reaches every endpoint,
    pushes the policy's weights (all of them; later pushes carry what the optimizer changes: with LoRA the
    adapters) and checks them on the probe."""

    def __init__(self, model, tokenizer, sampling, episodes, shape, *, seeded: bool, version: int = 0,
                 topology=None, records: bool = False, rng: list | None = None, load: tuple | None = None):
        """`sampling.rollout_endpoints`: the endpoints to sample from (shared by every trainer rank); else
        `sampling.rollout_workers` endpoints this sampler starts itself (gspo/rollout/endpoint/spawned.py; each
        trainer rank its own). `topology`: the run's Topology (gspo/plugs/parallel.py) under torchrun; None: one
        process. `records`: routing_replay=rollout: every answer returns the experts its tokens were routed to
        (Rollout.routing). `rng`: a checkpoint's random states of the endpoints (unseeded sampling), set before the
        first rollout. `load`: the run's (ModelSettings, LoraSettings), which a started endpoint of an fsdp trainer
        loads the model by (the trainer's copy is sharded)."""
        from gspo.config import rollout_secret
        from gspo.plugs.moe import find_routers
        from gspo.rollout.endpoint.client import ENDPOINTS, MAX_ROWS_PER_REQUEST, Endpoints
        from gspo.rollout.endpoint.server import need
        from gspo.rollout.endpoint.spawned import spawn_endpoints

        need("serve", "fastapi", "uvicorn", "httpx")  # workers are gspo serve endpoints: said before one starts
        self.topology = topology if topology is not None and topology.enabled else None
        self.processes, self.pipes = [], []
        t0 = time.perf_counter()
        if sampling.rollout_endpoints:
            urls, secret, self.shared = list(sampling.rollout_endpoints), rollout_secret(sampling), True
            what = f"{len(urls)} rollout endpoint(s) ({', '.join(urls)})"
        else:
            load = _own_load(model, load)
            self.processes, self.pipes, urls, secret = spawn_endpoints(
                model, tokenizer, (sampling, episodes, shape), count=sampling.rollout_workers, seeded=seeded,
                load=load, device=str(next(model.parameters()).device), rows=MAX_ROWS_PER_REQUEST,
                timeout_s=sampling.rollout_timeout_s)
            self.shared = False
            what = f"{len(urls)} rollout worker process(es) (gspo serve endpoints of its own, on loopback)"
        self.pushes = not self.shared or self.topology is None or self.topology.is_main  # shared: rank 0 pushes
        self.name = "endpoints" if self.shared else "workers"
        self.reason = (f"sampler: {what}, weights by the four phases, rollouts asked for {sampling.max_staleness} "
                       "step(s) ahead")
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.lost = None
        self.wait_s = sampling.rollout_endpoint_wait_s if self.shared else 0.0
        self.last = None  # (version, payloads, the policy's probe log-probs) of the last push, for a restarted endpoint
        self.restarts = 0
        try:
            names = None if self.shared else [f"rollout worker {i + 1}" for i in range(len(urls))]
            self.endpoints = Endpoints(urls, secret, timeout_s=sampling.rollout_timeout_s, vocab_size=self.vocab_size,
                                       names=names, weight_transfer=sampling.rollout_weight_transfer,
                                       device=str(next(model.parameters()).device))
        except BaseException:
            self.close()
            raise
        try:
            from gspo.rollout.sampler import Sampler

            # its own tokenizer: its thread renders prompts while the trainer's decodes (a fast tokenizer's state is
            # not shared across threads)
            layers = tuple(router.layer for router in find_routers(model)) if records else ()
            self.sampler = Sampler(model, copy.deepcopy(tokenizer), sampling, episodes, shape, seeded=seeded,
                                   engine=(self.name, ENDPOINTS, self.endpoints), records=records,
                                   recorder=lambda endpoints: endpoints.recording(layers) if records else None)
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gspo-rollouts")
            self.version, self.started = version, False
            self.futures: dict = {}  # step (or (step, round)) -> Future of (Rollout, seconds sampling)
            self.versions: dict = {}  # step (or (step, round)) -> the weights' version that sampled it, received order
            self.asked_version: dict[int, int] = {}
            self.pushed = self._push(model)  # every endpoint starts from the policy's weights
            # unseeded sampling draws from each endpoint's own random state: kept after every rollout (one trainer
            # process, or endpoints of its own; gspo serve's), so a checkpoint resumes where they stood
            self.keeps_rng = (not seeded and (self.topology is None or not self.shared)
                              and all(kind == "gspo" for kind in self.endpoints.kinds))  # vLLM: no such route
            self.rngs: dict = {}  # step (or (step, round)) -> each endpoint's random state after its rollout
            if self.keeps_rng:  # resumed: where they stood; new: each its own stream, reproducible for the seed
                self.endpoints.set_rng_states(list(rng) if rng is not None else [
                    _state_b64(shape.seed + 1000 * (e + 1)) for e in range(len(urls))])
        except BaseException as err:
            self.close()
            if isinstance(err, EndpointLost):
                raise self._named(err, "starting the rollout workers") from None
            raise
        self.started = True
        self.start_s = time.perf_counter() - t0
        self.waited, self.busy, self.mark, self.synced = 0.0, 0.0, time.perf_counter(), False

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def request(self, prompts: list[str], step, first_row: int, rows: list | None = None) -> None:
        """Ask for rollout `step` (a step, or (step, round): gspo.rollout.batch.step_of); it samples on this
        sampler's thread once those asked before are done."""
        self._check()
        self.asked_version[step] = self.version
        self.futures[step] = self.thread.submit(self._sample, prompts, step, first_row, rows)

    def _sample(self, prompts, step, first_row, rows):
        t0 = time.perf_counter()
        while True:  # the same call again after a lost endpoint came back: seeded rows draw the same tokens
            try:
                rollout = self.sampler.sample(prompts, step, first_row, rows)
                break
            except EndpointLost as err:
                if not self._revived(err, f"{key_name(step)}: its rollout"):
                    raise
        rng = self.endpoints.rng_states() if self.keeps_rng else None
        return rollout, time.perf_counter() - t0, rng

    def receive(self, step, wait: bool = True):
        """Rollout `step` (asked for with `request`); without `wait`, only one that is done, else None."""
        future = self.futures.get(step)
        if future is None or (not wait and not future.done()):
            return None
        self._check()
        t0 = time.perf_counter()
        try:
            rollout, busy, rng = future.result()
        except EndpointLost as err:
            what = f"{key_name(step)}: waiting for its rollout"
            self.lost = self._named(EndpointLost(f"{what}: {err}"), what)
            raise self.lost from None
        self.waited += time.perf_counter() - t0
        self.busy += busy
        del self.futures[step]
        self.versions[step] = self.asked_version.pop(step)
        if rng is not None:
            self.rngs[step] = rng
        for old in list(self.versions)[:-KEEP_VERSIONS]:  # received in the order asked
            del self.versions[old]
            self.rngs.pop(old, None)
        return rollout

    def sample(self, prompts: list[str], step, first_row: int, rows: list | None = None):
        """`request` then `receive`: one step sampled without overlap."""
        self.request(prompts, step, first_row, rows)
        return self.receive(step)

    def rng_after(self, step) -> list | None:
        """Each endpoint's random state right after rollout `step` (unseeded sampling, one trainer process);
        None otherwise (seeded: every row's tokens follow its seed)."""
        return self.rngs.get(step)

    def version_of(self, step) -> int:
        """The version of the weights (the number of `sync`s before) that sampled rollout `step`."""
        return self.versions[step]

    def _push(self, policy) -> dict:
        """Push the policy's weights (version `self.version`) to every endpoint and check each on the probe (under
        torchrun: every rank gathers, rank 0 pushes, and every rank learns whether it worked)."""

        from gspo.rollout.endpoint.weights import flat_weights, probe_logprobs, sent_names
        from gspo.rollout.endpoint.wire import DTYPE_NAMES
        from gspo.rollout.vllm_engine import checkpoint_payload

        trained_only = self.started  # after the first push: what the optimizer changes (LoRA: the adapters)
        own = probe_logprobs(policy, self.vocab_size)  # fsdp: a forward, a collective like the gather below
        t0 = time.perf_counter()
        kinds = set(self.endpoints.kinds)
        payloads, sent = {}, 0.0
        if "gspo" in kinds:  # the parameters in the policy's order (fsdp: gathered, a collective)
            flat = flat_weights(policy, trained_only)
            payloads["gspo"] = ({DTYPE_NAMES[d]: t for d, t in flat.items()},
                                {"trained_only": trained_only, "names": sent_names(policy, trained_only)})
            sent += sum(t.numel() * t.element_size() for t in flat.values())
        if "vllm" in kinds:  # the checkpoint's tensors (LoRA merged, MoE experts as saved), all of them each time
            payloads["vllm"] = checkpoint_payload(policy, next(policy.parameters()).dtype)
            sent += sum(t.numel() * t.element_size() for t in payloads["vllm"][0].values())
        failed = None
        if self.pushes:
            try:
                try:
                    probes = self.endpoints.push(self.version, payloads)
                except EndpointLost as err:  # one that came back is given the last weights, then this push again
                    if not self._revived(err, "pushing the weights"):
                        raise
                    probes = self.endpoints.push(self.version, payloads)
                for e, probe in enumerate(probes):
                    self._check_probe(e, own, probe)
            except ValueError as err:  # EndpointLost among them
                failed = err
            if failed is None and self.wait_s:
                self.last = (self.version, payloads, own)
        if self.topology is not None and self.topology.any(failed is not None):  # rank 0's outcome, for all
            failed = failed or EndpointLost(f"rank 0 could not push the weights to the rollout endpoints (its error "
                                     f"above); this is rank {self.topology.rank}")
        if failed is not None:
            raise failed
        self.endpoints.version = str(self.version)  # what every answer must say from now on
        return {"seconds": time.perf_counter() - t0, "bytes": float(sent)}

    def _check_probe(self, e: int, own, probe: list) -> None:
        """A ValueError naming endpoint `e` unless its probe log-probs are the policy's (`own`)."""
        import torch

        kind, base = self.endpoints.kinds[e], self.endpoints.bases[e]
        diffs = (own - own.new_tensor(probe)).abs() if len(probe) == own.numel() else torch.full((1,), float("inf"))
        # gspo serve runs the trainer's own kernels: 1e-5; vLLM its own (fp32: 1e-3, 16-bit: 0.03 mean)
        if not (diffs.max() <= 1e-5 or (kind == "vllm" and (diffs.max() <= 1e-3 or diffs.mean() <= 0.03))):
            raise ValueError(f"{self.endpoints.named[base]}: the pushed weights give log-probs "
                             f"{diffs.max().item():.3g} away from the policy's on the probe (does it serve "
                             "the trainer's model?)")

    def _revived(self, err: EndpointLost, what: str) -> bool:
        """After `err`: where rollout_endpoint_wait_s allows, wait for every endpoint that no longer answers to
        answer again, join it, give it the last weights pushed (the version it lost) and check them on the probe;
        True when some endpoint was revived (the caller asks again), False when none was down (`err` stands)."""
        import sys

        if not self.wait_s:
            return False
        down = [e for e in range(len(self.endpoints.bases)) if not self.endpoints.alive(e)]
        if not down:
            return False
        t0 = time.perf_counter()
        for e in down:
            name = self.endpoints.named[self.endpoints.bases[e]]
            print(f"rollout endpoints: {name} is lost ({err}); waiting up to rollout_endpoint_wait_s="
                  f"{self.wait_s:g} s for it to answer again ({what})", file=sys.stderr, flush=True)
            self._wait_for(t0, lambda e=e: self.endpoints.alive(e), f"{name}: lost ({err}) and not back")
            if self.last is None:  # a rank that does not push: rank 0 gives it the weights
                if self.endpoints.kinds[e] != "gspo":
                    raise EndpointLost(f"{name}: lost ({err}); it came back, but only rank 0 can give it the weights "
                                       "and a vLLM server does not say which it holds") from None
                self._wait_for(t0, lambda e=e: self.endpoints.weight_version(e) == self.endpoints.version,
                               f"{name}: back, but rank 0 did not give it weights version {self.endpoints.version}")
                continue
            version, payloads, own = self.last
            self.endpoints.rejoin(e)
            self._check_probe(e, own, self.endpoints._push_one(e, version, *payloads[self.endpoints.kinds[e]]))
            if self.keeps_rng and self.rngs:  # unseeded: where it stood after the last rollout kept
                self.endpoints.set_rng_states(self.rngs[max(self.rngs)], only=e)
            self.restarts += 1
            print(f"rollout endpoints: {name} is back after {time.perf_counter() - t0:.1f} s, with weights version "
                  f"{version}; asking again", file=sys.stderr, flush=True)
        return True

    def _wait_for(self, t0: float, ready, failure: str) -> None:
        while not ready():
            if time.perf_counter() - t0 > self.wait_s:
                raise EndpointLost(f"{failure} within rollout_endpoint_wait_s={self.wait_s:g} s") from None
            time.sleep(0.5)

    def sync(self, policy) -> dict:
        """Wait for the rollouts asked so far, then push the updated weights; this step's timings.

        A lost endpoint is not raised here (the step's updates are done and its metrics still logged): the next
        `request` or `receive` raises it, before anything of the next step is applied."""
        if self.lost is not None:
            return {}
        t0 = time.perf_counter()
        self.thread.submit(lambda: None).result()  # the rollouts asked before this push have sampled
        if self.topology is not None and self.shared:  # on every rank: their endpoints are rank 0's to update
            self.topology.barrier()
        self.waited += time.perf_counter() - t0
        self.version += 1
        try:
            pushed = self._push(policy)
        except EndpointLost as err:
            self.lost = self._named(EndpointLost(f"pushing the weights: {err}"), "pushing the weights")
            return {}
        now = time.perf_counter()
        interval = now - self.mark
        stats = {"time/sync_s": pushed["seconds"], "async/sync_bytes": pushed["bytes"],
                 **({"async/endpoint_restarts": float(self.restarts)} if self.wait_s else {}),
                 "time/wait_for_rollout_s": self.waited, "async/trainer_busy": 1.0 - self.waited / interval,
                 "async/worker_busy": self.busy / interval}
        self.waited, self.busy, self.mark = 0.0, 0.0, now
        if not self.synced:
            stats["time/sampler_start_s"], self.synced = self.start_s, True
        return stats

    def _named(self, err, what: str):
        """`err`, or where an endpoint process of this sampler's has ended one naming it and its exit status."""
        from gspo.rollout.endpoint.spawned import dead

        for process in self.processes:  # a killed process's connections close before it can be reaped
            process.join(timeout=1.0)
        ended = dead(self.processes)
        return EndpointLost(f"{what}: {'; '.join(ended)}") if ended else err

    def close(self) -> None:
        from gspo.rollout.endpoint.spawned import stop_endpoints

        if hasattr(self, "thread"):
            self.thread.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "endpoints"):
            self.endpoints.close()  # a request in flight fails at once
        stop_endpoints(self.processes, self.pipes)


def _own_load(model, load: tuple | None) -> tuple | None:
    """What a started endpoint loads the model by: nothing (it gets a copy of the policy), or under fsdp (the
    trainer holds a shard only) the run's (ModelSettings, LoraSettings); a ValueError where that cannot be."""
    from gspo.algo.logprobs import is_fsdp2
    from gspo.given import is_marker

    if not is_fsdp2(model):
        return None
    if load is None:
        raise ValueError("rollout_workers under distributed=fsdp: build_sampler needs load=(ModelSettings, "
                         "LoraSettings), which each worker loads the model by (the trainer's copy is sharded)")
    if is_marker(load[0].model):
        raise ValueError("rollout_workers under distributed=fsdp: each worker loads the model the config names "
                         "(the trainer's copy is sharded), and a model object given from Python cannot be loaded "
                         "there; name the model by path, or use distributed=ddp")
    return load


def _state_b64(seed: int) -> str:
    """The base64 of torch's random state just after manual_seed(seed)."""
    import base64

    import torch

    return base64.b64encode(torch.Generator().manual_seed(seed).get_state().numpy().tobytes()).decode()


__all__ = ["EndpointSampler"]
