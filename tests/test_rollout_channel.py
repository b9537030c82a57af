"""The rollout channel end to end, in one process (fast): the trainer's RemoteSampler waits at rollout_address and a
real rollout worker (rollout/remote/worker.py) runs in a thread of this process. Between them a proxy that holds the
run's secret can change what the worker answers: a broken or hostile server. Every malformed answer is refused at
the boundary as RolloutWorkerLost, in one line naming the worker and what was wrong, and a run stops with the
checkpoint it writes for a lost worker. (tests/test_workers.py: spawned workers, in processes of their own.)"""

import copy
import os
import pickle
import re
import socket
import struct
import threading

import pytest
import torch

from conftest import SMALL, free_port, read_metrics, tiny_cfg
from gspo.config import LoraSettings, ModelSettings, section
from gspo.models import load_model
from gspo.rollout import Sampler, sampler_sections
from gspo.rollout.remote.client import RemoteSampler, RolloutWorkerLost
from gspo.rollout.remote.protocol import TO_TRAINER, TO_WORKER
from gspo.rollout.remote.wire import MAGIC, NONCE_BYTES, accept_peers, connect, listen, recv, send
from gspo.rollout.remote.worker import _worker_main, serve_rollouts
from gspo.runtime import TrainingAborted
from gspo.trainer import train
from test_wire import dropped, listening

SECRET = "the secret of this test's runs"
PROMPTS = ["12+34=", "5+6=", "70+8="]


def seeded_sampler(model, tok, cfg) -> Sampler:
    """The trainer's own Sampler of `cfg` in this process, seeded: what a worker must sample alike."""
    return Sampler(model, tok, *sampler_sections(cfg), seeded=True)


def waiting_sampler(model, tok, cfg, timeout_s: float = 20) -> RemoteSampler:
    """The trainer's RemoteSampler of `cfg`, seeded, waiting at its rollout_address for one rollout server."""
    return RemoteSampler(model, tok, *sampler_sections(cfg), seeded=True, workers=1, timeout_s=timeout_s,
                         address=cfg.rollout_address)


def forward(source, sink, kinds, tamper=None) -> None:
    """Copy messages from `source` to `sink` until either closes, each decoded and re-encoded; `tamper(kind,
    fields, tensors)` returns the message to send instead (None: as it came; bytes: those raw bytes)."""
    try:
        while True:
            message = recv(source, kinds)
            out = tamper(message.kind, message.fields, message.tensors) if tamper else None
            if isinstance(out, bytes):
                sink.sendall(out)
            else:
                send(sink, *(out or (message.kind, message.fields, message.tensors)))
    except (OSError, ValueError):
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(port: int, model=None, tokenizer=None, load=None, tamper=None) -> None:
    """A rollout worker of rank 1 for the trainer at 127.0.0.1:`port`, in threads of this process: the real worker
    (its own copy of `model`, or the model `load` names), through a proxy that applies `tamper` to its answers."""
    secret = SECRET.encode()
    inner = listen("127.0.0.1", 0)
    threading.Thread(target=_worker_main, daemon=True,
                     args=(1, "127.0.0.1", inner.getsockname()[1], secret, model and copy.deepcopy(model),
                           tokenizer, None, load)).start()

    def proxy():
        worker = accept_peers(inner, secret, range(1, 2), 60)[1]
        inner.close()
        trainer = connect("127.0.0.1", port, secret, 1, 60)
        threading.Thread(target=forward, args=(trainer, worker, TO_WORKER), daemon=True).start()
        forward(worker, trainer, TO_TRAINER, tamper)

    threading.Thread(target=proxy, daemon=True).start()


def remote(tmp_path, model, tok, tamper=None, **cfg):
    port = free_port()
    serve(port, model, tok, tamper=tamper)
    cfg = tiny_cfg(tmp_path, seeded_sampling=True, rollout_workers=1, rollout_address=f"127.0.0.1:{port}",
                   rollout_secret=SECRET, **cfg)
    return cfg, waiting_sampler(model, tok, cfg)


def test_a_server_on_the_wire_samples_what_the_process_samples_and_follows_the_weights(tmp_path):
    torch.manual_seed(0)
    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg, sampler = remote(tmp_path, model, tok)
    try:
        assert not [p for p in listening_ports() if p == int(cfg.rollout_address.split(":")[1])]  # closed once joined
        local, far = seeded_sampler(model, tok, cfg).sample(PROMPTS, 1, 0), sampler.sample(PROMPTS, 1, 0)
        for name in ("input_ids", "attention_mask", "completion_mask"):
            assert torch.equal(getattr(local, name), getattr(far, name)), name
        assert local.completions == far.completions and sampler.version_of(1) == 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # an update
        stats = sampler.sync(model)
        assert stats["async/sync_bytes"] == 4.0 * sum(p.numel() for p in model.parameters())
        assert stats["async/refused_peers"] == 0.0
        local, far = seeded_sampler(model, tok, cfg).sample(PROMPTS, 2, 0), sampler.sample(PROMPTS, 2, 0)
        assert torch.equal(local.input_ids, far.input_ids) and sampler.version_of(2) == 1  # the new weights
    finally:
        sampler.close()


def listening_ports() -> list[int]:
    return [port for _, port in listening()]


def test_a_fake_server_without_the_secret_is_refused_and_the_run_goes_on_with_the_real_one(tmp_path, capfd):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    port = free_port()

    def fake_servers():  # the old protocol's attack (a pickled answer), then a client with a guessed secret
        for _ in range(100):  # until the trainer listens
            try:
                attacker = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                threading.Event().wait(0.05)
        with attacker:
            attacker.sendall(pickle.dumps(("ready", os.system)))
            assert dropped(attacker)
        with pytest.raises(ValueError, match="did not prove the run's secret"):
            connect("127.0.0.1", port, b"a guess at the secret, 32 chars", 1, 5)

    threading.Thread(target=fake_servers, daemon=True).start()
    serve_later = threading.Timer(1.0, serve, args=(port, model, tok))
    serve_later.start()
    cfg = tiny_cfg(tmp_path, seeded_sampling=True, rollout_workers=1, rollout_address=f"127.0.0.1:{port}",
                   rollout_secret=SECRET)
    sampler = waiting_sampler(model, tok, cfg)
    try:
        assert sampler.refused == 2
        assert torch.equal(sampler.sample(PROMPTS, 1, 0).input_ids,
                           seeded_sampler(model, tok, cfg).sample(PROMPTS, 1, 0).input_ids)
    finally:
        sampler.close()
    err = capfd.readouterr().err
    assert "rollout: refused a connection from 127.0.0.1:" in err and "does not speak gspo's rollout protocol" in err


def replace_first(kind_to_change, make):
    """A tamper that replaces the first answer of `kind_to_change` by `make(fields, tensors)`."""
    done = []

    def tamper(kind, fields, tensors):
        if kind == kind_to_change and not done:
            done.append(kind)
            return make(dict(fields), dict(tensors))
        return None

    return tamper


def with_tensor(name, change):
    def make(fields, tensors):
        tensors[name] = change(tensors[name].clone())
        return "rollout", fields, tensors
    return make


def out_of_vocab(ids):
    ids[0, -1] = 10_000
    return ids


MALFORMED = {
    "a reply of the wrong kind": (replace_first("probe", lambda f, t: ("ready", {}, {})), True,
                                  r"checking the broadcast weights: rollout worker 1 answered 'ready', expected "
                                  r"'probe'"),
    "a probe of the wrong shape": (replace_first("probe", lambda f, t: ("probe", f, {"logprobs": torch.zeros(3)})),
                                   True, r"checking the broadcast weights: rollout worker 1 sent a probe of shape "
                                         r"\(3,\), expected \(15,\)"),
    "undecodable bytes": (replace_first("rollout", lambda f, t: struct.pack("<I", 7) + b"\x80\x04\x95abcd"), False,
                          r"step 1: waiting for its rollout: rollout worker 1 sent a malformed message: a header that "
                          r"is not JSON"),
    "token ids outside the vocabulary": (replace_first("rollout", with_tensor("input_ids", out_of_vocab)), False,
                                         r"rollout worker 1 sent a rollout with token ids 0\.\.10000, outside the "
                                         r"vocabulary \(0\.\.\d+\)"),
    "a version far in the future": (replace_first("rollout", lambda f, t: ("rollout", {**f, "version": 10**9}, t)),
                                    False, r"rollout worker 1 sent a rollout of step 1 sampled with weights version "
                                           r"1000000000; it held version 0"),
    "a step never asked for": (replace_first("rollout", lambda f, t: ("rollout", {**f, "step": 7}, t)), False,
                               r"rollout worker 1 sent a rollout of step 7, which it was not asked for"),
    "rows missing": (replace_first("rollout", lambda f, t: ("rollout", {**f, "prompts": f["prompts"][1:],
                                                                        "completions": f["completions"][1:]},
                                                          {k: v[1:] if v.dim() == 2 else v for k, v in t.items()})),
                     False, r"rollout worker 1 sent a rollout of 11 sequences; it was asked for 12"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_a_lost_worker_in_one_line(tmp_path, case):
    # before: each was a traceback out of the trainer (or, for the version, accepted: async/staleness_max -1e9)
    tamper, at_start, error = MALFORMED[case]
    model, tok = load_model("tiny-dense", overrides=SMALL)
    if at_start:
        with pytest.raises(RolloutWorkerLost, match=error) as lost:
            remote(tmp_path, model, tok, tamper)
    else:
        _, sampler = remote(tmp_path, model, tok, tamper)
        try:
            with pytest.raises(RolloutWorkerLost, match=error) as lost:
                sampler.sample(PROMPTS, 1, 0)
            with pytest.raises(RolloutWorkerLost, match=error):  # lost for good
                sampler.request(PROMPTS, 2, 0)
        finally:
            sampler.close()
    assert "\n" not in str(lost.value)


def test_a_run_whose_server_answers_a_future_version_stops_with_the_checkpoint_of_a_lost_worker(tmp_path):
    port = free_port()
    cfg = tiny_cfg(tmp_path, max_steps=3, seeded_sampling=True, rollout_workers=1, eval_num_prompts=0,
                   rollout_address=f"127.0.0.1:{port}", rollout_secret=SECRET, rollout_timeout_s=30)

    def future_at_step_2(kind, fields, tensors):
        return ("rollout", {**fields, "version": 10**9}, tensors) if kind == "rollout" and fields["step"] == 2 else None

    serve(port, load=(section(cfg, ModelSettings), section(cfg, LoraSettings)), tamper=future_at_step_2)
    with pytest.raises(TrainingAborted, match=r"step 2: waiting for its rollout: rollout worker 1 sent a rollout of "
                                              r"step 2 sampled with weights version 1000000000; it held version 1\n"
                                              r"stopped after step 1; checkpoint saved to .*checkpoint-1; continue "
                                              r"with --resume latest"):
        train(cfg)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]
    assert (tmp_path / "run" / "checkpoint-1" / "checkpoint.json").is_file()


def test_the_secret_is_never_saved_and_never_on_the_command_line(tmp_path):
    from gspo.config import TrainConfig, load_config, to_dict

    cfg = tiny_cfg(tmp_path, rollout_workers=1, rollout_address="127.0.0.1:29999", rollout_secret=SECRET)
    assert to_dict(cfg)["rollout_secret"] == "<hidden>" and cfg.rollout_secret == SECRET
    with pytest.raises(ValueError, match=r"override rollout_secret=\.\.\.: a secret on the command line is visible "
                                         r"to every user of this machine \(ps\)"):
        load_config(TrainConfig, None, ["rollout_secret=" + SECRET])


def test_rollout_servers_need_a_secret_of_some_length_from_a_private_place(tmp_path, monkeypatch):
    monkeypatch.delenv("GSPO_ROLLOUT_SECRET", raising=False)
    server = dict(rollout_workers=1, rollout_address="127.0.0.1:29999")
    with pytest.raises(ValueError, match=r"rollout servers must prove the run's secret; set GSPO_ROLLOUT_SECRET"):
        tiny_cfg(tmp_path, **server)
    with pytest.raises(ValueError, match=r"config: rollout_secret: the run's secret must be at least 16 characters"):
        tiny_cfg(tmp_path, **server, rollout_secret="short")
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"rollout_secret_file=.*secret: others may read it \(mode 644\); chmod 600"):
        tiny_cfg(tmp_path, **server, rollout_secret_file=str(path))
    path.chmod(0o600)
    from gspo.config import rollout_secret

    assert rollout_secret(tiny_cfg(tmp_path, **server, rollout_secret_file=str(path))) == SECRET.encode()
    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", SECRET)
    assert rollout_secret(tiny_cfg(tmp_path, **server)) == SECRET.encode()


def test_a_rollout_server_refuses_a_fake_trainer_and_names_a_dead_address_within_its_timeout(tmp_path):
    # before: a client posing as a trainer ran code in `gspo rollout-server` (it unpickled the setup message)
    cfg = tiny_cfg(tmp_path, rollout_workers=1, rollout_address="127.0.0.1:29999", rollout_secret=SECRET)
    listener = listen("127.0.0.1", 0)
    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    def fake_trainer():
        conn, _ = listener.accept()
        conn.recv(len(MAGIC) + NONCE_BYTES)
        conn.sendall(MAGIC + os.urandom(NONCE_BYTES + 32) + pickle.dumps(("setup", Evil())))
        threading.Event().wait(1)
        conn.close()

    threading.Thread(target=fake_trainer, daemon=True).start()
    with pytest.raises(ValueError, match=r"^rollout-server: the trainer at 127.0.0.1:\d+ did not prove the run's "
                                         r"secret"):
        serve_rollouts(cfg, f"127.0.0.1:{listener.getsockname()[1]}", 1, start_timeout_s=5)
    listener.close()
    assert not ran.exists()
    with pytest.raises(ValueError, match=r"^rollout-server: nothing answered at 127.0.0.1:\d+ within 1 s"):
        serve_rollouts(cfg, f"127.0.0.1:{free_port()}", 1, start_timeout_s=1)


def test_a_port_already_taken_is_named_first(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    held = listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    cfg = tiny_cfg(tmp_path, rollout_workers=1, rollout_address=f"127.0.0.1:{port}", rollout_secret=SECRET)
    try:
        with pytest.raises(ValueError, match=rf"^rollout_address=127.0.0.1:{port}: cannot listen at 127.0.0.1:{port}: "
                                             r"Address already in use: another run or program holds this port"):
            waiting_sampler(model, tok, cfg, timeout_s=5)
    finally:
        held.close()


def server_thread(cfg, port):
    """`serve_rollouts(cfg)` (`gspo rollout-server`) in a thread joining the trainer at `port`; what it raised."""
    raised = []

    def run():
        try:
            serve_rollouts(cfg, f"127.0.0.1:{port}", 1, start_timeout_s=30)
        except ValueError as err:
            raised.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


@pytest.mark.parametrize("server_settings,trainer_error,server_error", [
    ({"max_completion_length": 7}, r"starting the rollout workers: rollout worker 1 failed:\nthe trainer's sampling "
     r"settings differ from this rollout server's config \(max_completion_length: trainer 12, here 7\): start the "
     r"server with the trainer's config", r"^rollout-server: .*max_completion_length: trainer 12, here 7"),
    ({"model_overrides": {**SMALL, "intermediate_size": 96}}, r"checking the broadcast weights: rollout worker 1 "
     r"failed:\nrollout worker 1 refused a message: the broadcast weights do not fit this model: "
     r"\{'float32': \d+\} values per dtype sent, this model has \{'float32': \d+\}",
     r"^rollout-server: the broadcast weights do not fit"),
])
def test_a_server_whose_config_differs_from_the_trainer_s_says_so_on_both_sides(tmp_path, server_settings,
                                                                               trainer_error, server_error):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    port = free_port()
    common = dict(seeded_sampling=True, rollout_workers=1, rollout_address=f"127.0.0.1:{port}", rollout_secret=SECRET)
    thread, raised = server_thread(tiny_cfg(tmp_path, **common, **server_settings), port)
    cfg = tiny_cfg(tmp_path, **common)
    with pytest.raises(RolloutWorkerLost, match=trainer_error):
        waiting_sampler(model, tok, cfg)
    thread.join(20)
    assert len(raised) == 1 and re.search(server_error, str(raised[0])), raised
