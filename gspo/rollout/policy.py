"""The policy's side of sampling: per-row seeded sampling (SeededSampler, row_seeds), the policy's copies that
sample in its place (PolicySampler: a low-precision copy, a lagged one), and the memory a rollout needs (checked
before training; an out-of-memory error while sampling named by the settings that size it)."""

from __future__ import annotations

import copy
import time
from collections import deque

import torch
from torch import Tensor

from gspo.algo.logprobs import is_fsdp2
from gspo.model_checks import available_memory


class SeededSampler:
    """Samples each row from its own generator: the Gumbel-max trick, argmax(logits / T + G).

    With G_v = -log(-log(U_v)), U_v uniform, argmax_v(l_v + G_v) is an exact sample from
    softmax(l) (Gumbel 1954; e.g. Maddison et al. 2014, "A* sampling"). HF runs the argmax (greedy
    decoding) after this processor. Row i draws V uniforms per step from generator i only.
    """

    def __init__(self, seeds: list[int], temperature: float, device, offsets: list[int] | None = None):
        """`offsets`: tokens each row's stream has sampled already (an endpoint going on with an episode's row in a
        later turn: its generator skips that many steps' draws before its first)."""
        self.seeds, self.temperature = list(seeds), temperature  # an engine seeds its own sampler from `seeds`
        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]
        self.skip = list(offsets) if offsets and any(offsets) else None
        # tokens each row's stream has sampled through an engine, in cells a view of some rows shares (rollout
        # endpoints: the client counts them, so the next turn's request says where the stream stands)
        self.drawn = [[0] for _ in seeds]

    def rows(self, index: list[int]) -> SeededSampler:
        """The sampler of rows `index` only, drawing from the same generators (a multi-turn episode's rows that
        are still running: each row's stream goes on where its last turn left it)."""
        view = copy.copy(self)
        view.seeds, view.generators = [self.seeds[i] for i in index], [self.generators[i] for i in index]
        view.drawn = [self.drawn[i] for i in index]
        return view

    def offsets(self) -> list[int]:
        """Tokens each row's stream has sampled through an engine so far (`drawn`)."""
        return [cell[0] for cell in self.drawn]

    def advance(self, steps: list[int]) -> None:
        """Count `steps` more tokens drawn by each row's stream (an engine's call ran that many decode steps)."""
        for cell, n in zip(self.drawn, steps):
            cell[0] += n

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        if self.skip is not None:  # draws of the steps the streams took before (each step: V uniforms per row)
            for g, n in zip(self.generators, self.skip):
                for _ in range(n):
                    torch.rand(V, generator=g, device=scores.device)
            self.skip = None
        uniform = torch.stack([torch.rand(V, generator=g, device=scores.device) for g in self.generators])  # (N, V)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-12, max=1 - 1e-7)))  # (N, V)
        return scores.float() / self.temperature + gumbel


def row_seeds(seed: int, step: int, first_row: int, count: int) -> list[int]:
    """Seeds of rows first_row .. first_row+count-1 of a run's rollout at `step` (global row numbers)."""
    base = (seed * 1_000_003 + step) * 1_000_003
    return [base + first_row + i for i in range(count)]


class PolicySampler:
    """The sampler of the gspo and hf backends: the policy itself, or a copy of its weights.

    A copy when `sampler_dtype` differs from the policy's (a low-precision stand-in for an
    inference engine's numerics) or `sampler_lag` = k > 0 (a stand-in for asynchronous training:
    rollout s samples with the weights the updates of rollout s - 1 - k left, the initial ones
    until then). `push(policy)` after each rollout's updates; without a copy it does nothing and the
    sampled tokens are those of the policy itself, bit for bit.
    """

    def __init__(self, policy, tokenizer=None, sampling=None):
        """`sampling`: the run's SamplingSettings (gspo.config); None: the policy itself."""
        from gspo.models import DTYPES

        own = next(policy.parameters()).dtype
        self.dtype = DTYPES[sampling.sampler_dtype] if sampling is not None and sampling.sampler_dtype else own
        self.lag = sampling.sampler_lag if sampling is not None else 0
        self.start_s = 0.0
        self.pending: deque = deque()  # the lag's newer weights, oldest first
        if self.dtype == own and self.lag == 0:
            self.model = policy
            return
        if is_fsdp2(policy):
            raise ValueError("sampler_dtype/sampler_lag: the sampler copy needs the full weights, which fsdp shards; "
                             "use distributed=ddp (or one process)")
        t0 = time.perf_counter()
        self.model = copy.deepcopy(policy).to(self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.start_s = time.perf_counter() - t0

    @torch.no_grad()
    def push(self, policy) -> float:
        """Load the policy's weights (k rollouts later with a lag); seconds taken (0.0 without a copy)."""
        if self.model is policy:
            return 0.0
        t0 = time.perf_counter()
        state = policy.state_dict()
        if self.lag:
            self.pending.append({k: v.detach().to(self.dtype, copy=True) for k, v in state.items()})
            state = self.pending.popleft() if len(self.pending) > self.lag else None
        if state is not None:
            self.model.load_state_dict(state)  # cast into the copy's dtype
        return time.perf_counter() - t0


# what an error about a rollout too large for memory tells the user to lower
LOWER_HINT = "lower num_generations (or per_device_batch_size, max_completion_length)"


def sampling_bytes(config, n: int, new_tokens: int, dtype_bytes: int) -> int:
    """A lower bound of the memory that sampling `n` sequences of `new_tokens` tokens takes: the KV cache
    of the new tokens alone (the prompts' share left out) in every full-attention layer, plus one step's
    float32 logits (n, V). Where the config does not size the cache plainly (no head counts, latent
    attention), the logits alone. `config`: the model's (its text config for a multimodal one).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    layers = sum(t == "full_attention" for t in types) if types else getattr(config, "num_hidden_layers", 0)
    attention_heads = getattr(config, "num_attention_heads", None)
    heads = getattr(config, "num_key_value_heads", None) or attention_heads  # (G)QA: the cache's heads
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // attention_heads if attention_heads else None)
    window = getattr(config, "sliding_window", None)
    tokens = min(new_tokens, window) if not types and isinstance(window, int) and window > 0 else new_tokens
    kv = 0
    if layers and heads and head_dim and not hasattr(config, "kv_lora_rank"):
        kv = n * tokens * layers * 2 * heads * head_dim * dtype_bytes  # keys and values
    return kv + n * (getattr(config, "vocab_size", None) or 0) * 4


def available_bytes(device: torch.device) -> int | None:
    """Memory free for tensors on `device` (CUDA: free plus cached by torch; CPU: available RAM plus free swap,
    `gspo.model_checks.available_memory`), or None where it cannot be read (then nothing is refused)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return available_memory()
    return None


def check_sampling_memory(sampler, B: int, G: int, T: int) -> None:
    """Refuse, before training, a rollout of B prompts x G completions of up to T tokens whose lower bound
    (`sampling_bytes`) exceeds the memory available on the sampler's device: a ValueError naming num_generations."""
    param, config = next(sampler.parameters()), getattr(sampler, "config", None)
    if config is None:  # not a transformers model: nothing to size it by
        return
    need = sampling_bytes(config, B * G, T, param.element_size())
    have = available_bytes(param.device)
    if have is not None and need > have:
        raise ValueError(f"config: per_device_batch_size={B} x num_generations={G} = {B * G} sequences of up to {T} "
                         f"new tokens need at least {need / 2**30:.1f} GiB to sample (KV cache and logits), more "
                         f"than the {have / 2**30:.1f} GiB available on {param.device}; {LOWER_HINT}")


def out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, the CPU allocator's "not enough memory" /
    "can't allocate memory", MPS's "out of memory", Python's MemoryError."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in ("out of memory", "not enough memory",
                                                                      "can't allocate memory")))


__all__ = ["LOWER_HINT", "PolicySampler", "SeededSampler", "available_bytes", "check_sampling_memory", "out_of_memory",
           "row_seeds", "sampling_bytes"]
