"""The weight wire (rollout/endpoint/wire.py): a listener binds exactly its host, both sides prove the run's
secret before anything else is read, a message is tensors plus a schema-checked JSON header, and nothing that
arrives is unpickled: every malformed frame is one WireError naming what was wrong."""

import http.server
import json
import math
import os
import pickle
import socket
import struct
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.rollout.endpoint.wire import (
    DTYPES,
    MAGIC,
    MAX_HEADER_BYTES,
    NONCE_BYTES,
    Kind,
    WireError,
    accept_peers,
    connect,
    invite_one,
    listen,
    parse_header,
    recv,
    send,
)

SECRET, OTHER = b"the run's secret, 32 characters", b"another run's secret, not this 1"


def listening(pid: int = os.getpid()) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, read from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    hex_ip, hex_port = cols[1].split(":")
                    raw = bytes.fromhex(hex_ip)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each word little-endian
                    family = socket.AF_INET if width == 8 else socket.AF_INET6
                    found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


class Evil:
    """What an attacker would unpickle into the trainer: a file written by whoever runs it."""

    path = None

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def dropped(sock: socket.socket) -> bool:
    """Whether the other side closed `sock` (a close with unread bytes is a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def accept_in_thread(listener, secret=SECRET, ranks=range(1, 2), timeout_s=10.0):
    """accept_peers in a thread: (result holder, refused lines, the thread)."""
    out, refused = {}, []

    def run():
        try:
            out["peers"] = accept_peers(listener, secret, ranks, timeout_s, refused=refused.append)
        except Exception as err:  # noqa: BLE001  the test reads it
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return out, refused, thread


def test_a_listener_binds_exactly_the_host_it_is_given():
    # before: the trainer's TCPStore listened on *:PORT whatever host it was given (seen with ss -ltnp)
    listener = listen("127.0.0.1", 0)
    try:
        port = listener.getsockname()[1]
        assert listener.getsockname()[0] == "127.0.0.1"
        assert ("127.0.0.1", port) in listening()
        assert not [a for a, p in listening() if p == port and a != "127.0.0.1"]  # not 0.0.0.0, not ::
    finally:
        listener.close()
    assert port not in [p for _, p in listening()]


def test_an_invited_peer_joins_and_a_failed_invitation_is_raised_at_once():
    # invite_one: the invitation (an HTTP call, vLLM's init) runs while a thread accepts; the peer it sends is the
    # socket returned. An invitation that fails is raised at once, not after the accept's timeout, and its port
    # is closed; nobody coming is a TimeoutError.
    joined = []

    def invite(port):  # as an endpoint does: it connects before its answer comes back
        joined.append(connect("127.0.0.1", port, SECRET, 1, 5))

    sock = invite_one("127.0.0.1", SECRET, invite, 10)
    send(sock, "hello", {"n": 1})
    assert recv(joined[0], {"hello": Kind({"n": (int,)}, {})}).fields == {"n": 1}
    for s in (sock, *joined):
        s.close()
    ports = []

    def refuse(port):
        ports.append(port)
        raise ConnectionRefusedError("the endpoint said no")

    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="the endpoint said no"):
        invite_one("127.0.0.1", SECRET, refuse, 60)
    assert time.monotonic() - t0 < 2 and ("127.0.0.1", ports[0]) not in listening()

    def joins_then_fails(port):  # the peer joined, then the answer was an error: its socket is closed too
        joined.append(connect("127.0.0.1", port, SECRET, 1, 5))
        time.sleep(0.3)
        raise RuntimeError("late")

    with pytest.raises(RuntimeError, match="late"):
        invite_one("127.0.0.1", SECRET, joins_then_fails, 10)
    joined[-1].settimeout(5)
    assert joined[-1].recv(1) == b""  # the trainer's end was closed
    joined[-1].close()
    with pytest.raises(TimeoutError, match="1 of 1 peer"):
        invite_one("127.0.0.1", SECRET, lambda port: None, 0.3)


def test_a_port_in_use_is_named_as_the_cause():
    held = listen("127.0.0.1", 0)
    try:
        with pytest.raises(WireError, match=r"cannot listen at 127.0.0.1:\d+: Address already in use: another run or "
                                            r"program holds this port"):
            listen("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()


def test_peers_with_the_same_secret_join_and_talk():
    listener = listen("127.0.0.1", 0)
    out, refused, thread = accept_in_thread(listener, ranks=range(1, 3))
    a = connect("127.0.0.1", listener.getsockname()[1], SECRET, 2, 5)
    b = connect("127.0.0.1", listener.getsockname()[1], SECRET, 1, 5)
    thread.join(10)
    listener.close()
    peers = out["peers"]
    assert sorted(peers) == [1, 2] and refused == []
    send(peers[2], "hello", {"n": 7}, {"x": torch.arange(3)})
    message = recv(a, {"hello": Kind({"n": (int,)}, {"x": (("int64",), 1)})})
    assert message.fields == {"n": 7} and torch.equal(message.tensors["x"], torch.arange(3))
    for s in (a, b, *peers.values()):
        s.close()


def test_a_client_without_the_secret_is_dropped_and_counted_and_nothing_it_sent_is_unpickled(tmp_path):
    # before: recv() called pickle.loads on the first bytes a peer sent ("ready", obj): obj's __reduce__ ran here
    Evil.path = tmp_path / "ran"
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    out, refused, thread = accept_in_thread(listener)
    with socket.create_connection(("127.0.0.1", port)) as attacker:  # the old wire: a pickled message
        attacker.sendall(pickle.dumps(("ready", Evil())))
        assert dropped(attacker)
    with socket.create_connection(("127.0.0.1", port)) as attacker:  # the protocol's greeting, then a guessed proof
        attacker.sendall(MAGIC + os.urandom(NONCE_BYTES))
        attacker.recv(len(MAGIC) + 64)
        attacker.sendall((1).to_bytes(4, "little") + os.urandom(32))
        assert dropped(attacker)
    with pytest.raises(WireError, match="did not prove the run's secret"):  # a wrong secret: it gives up itself
        connect("127.0.0.1", port, OTHER, 1, 5)
    honest = connect("127.0.0.1", port, SECRET, 1, 5)
    thread.join(10)
    listener.close()
    assert sorted(out["peers"]) == [1]
    assert len(refused) == 3 and all(line.startswith("127.0.0.1:") for line in refused)
    assert "does not speak gspo's weight wire" in refused[0] and "did not prove the run's secret" in refused[1]
    assert "closed the connection" in refused[2]
    assert not Evil.path.exists()
    honest.close()
    out["peers"][1].close()


def test_a_proven_peer_cannot_take_a_rank_twice_or_one_not_waited_for():
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    out, refused, thread = accept_in_thread(listener, ranks=range(1, 3))
    first = connect("127.0.0.1", port, SECRET, 1, 5)
    time.sleep(0.3)  # joined before the next
    with pytest.raises(WireError, match="refused rank 1: a peer of that rank joined already"):
        connect("127.0.0.1", port, SECRET, 1, 5)
    with pytest.raises(WireError, match="refused rank 7: it waits for no such rank"):
        connect("127.0.0.1", port, SECRET, 7, 5)
    second = connect("127.0.0.1", port, SECRET, 2, 5)
    thread.join(10)
    listener.close()
    assert sorted(out["peers"]) == [1, 2] and len(refused) == 2 and "claimed rank 1, which is taken" in refused[0]
    for s in (first, second, *out["peers"].values()):
        s.close()


def test_a_fake_trainer_is_refused_by_the_worker_before_anything_is_read(tmp_path):
    Evil.path = tmp_path / "ran"
    listener = listen("127.0.0.1", 0)

    def fake_trainer():  # answers the greeting as the protocol does, without the secret, then sends a pickle
        conn, _ = listener.accept()
        conn.recv(len(MAGIC) + NONCE_BYTES)
        conn.sendall(MAGIC + os.urandom(NONCE_BYTES) + os.urandom(32) + pickle.dumps(("setup", Evil())))
        time.sleep(1)
        conn.close()

    threading.Thread(target=fake_trainer, daemon=True).start()
    with pytest.raises(WireError, match=r"the trainer at 127.0.0.1:\d+ did not prove the run's secret"):
        connect("127.0.0.1", listener.getsockname()[1], SECRET, 1, 5)
    listener.close()
    assert not Evil.path.exists()


def test_a_trainer_that_speaks_pickle_is_not_a_trainer(tmp_path):
    Evil.path = tmp_path / "ran"
    listener = listen("127.0.0.1", 0)

    def old_trainer():
        conn, _ = listener.accept()
        conn.sendall(pickle.dumps(("setup", Evil())))
        time.sleep(1)
        conn.close()

    threading.Thread(target=old_trainer, daemon=True).start()
    with pytest.raises(WireError, match=r"127.0.0.1:\d+ answered b'\\x80\\x04.*it does not speak gspo's weight "
                                        r"wire"):
        connect("127.0.0.1", listener.getsockname()[1], SECRET, 1, 5)
    listener.close()
    assert not Evil.path.exists()


def test_nothing_listening_is_named_within_the_start_timeout():
    # before: `gspo rollout-server --connect` to a closed port hung (a C++ stack dump at 120 s, then retries)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        t0 = time.perf_counter()
        with pytest.raises(WireError, match=rf"nothing answered at 127.0.0.1:{port} within 1.5 s \(Connection "
                                            r"refused\): is the trainer running there\?"):
            connect("127.0.0.1", port, SECRET, 1, 1.5)
        assert time.perf_counter() - t0 < 3


def test_an_http_server_is_named_as_not_speaking_the_protocol():
    # before: no output for 190 s against an HTTP server
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(WireError, match=r"answered b'<!DOCTYPE HTML>\\n': it does not speak gspo's "
                                            r"weight wire"):  # its 400 page: our greeting is no HTTP request
            connect("127.0.0.1", server.server_address[1], SECRET, 1, 30)
        assert time.perf_counter() - t0 < 5
    finally:
        server.shutdown()
        server.server_close()


# ---- messages ----

ANY = Kind({"a": (int,), "b": (str, type(None)), "c": (list,)}, {name: ((name,), 2) for name in DTYPES},
           optional=tuple(DTYPES))


def frame(header: dict | bytes, payload: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<I", len(raw)) + raw + payload


def read(raw: bytes, kinds=None, **kw):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        return recv(b, kinds or {"m": ANY}, **kw)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def tensor_for(dtype_name: str):
    dtype = DTYPES[dtype_name]
    shapes = st.tuples(st.integers(0, 4), st.integers(0, 5))
    if dtype == torch.bool:
        return shapes.map(lambda s: torch.randint(0, 2, s, generator=torch.Generator().manual_seed(sum(s))).bool())
    if dtype.is_floating_point:  # any bit pattern of the dtype: NaNs, infinities, subnormals included
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        return st.tuples(shapes, st.integers(0, 2**31)).map(
            lambda a: torch.randint(-2**15, 2**15, a[0], generator=torch.Generator().manual_seed(a[1]),
                                    dtype=torch.int64).to(width).view(dtype) if dtype.itemsize <= 2 else
            torch.randint(-2**31, 2**31, a[0], generator=torch.Generator().manual_seed(a[1]),
                          dtype=torch.int64).to(width).view(dtype))
    info = torch.iinfo(dtype)
    return st.tuples(shapes, st.integers(0, 2**31)).map(
        lambda a: torch.randint(max(info.min, -2**62), min(info.max, 2**62), a[0], dtype=torch.int64,
                                generator=torch.Generator().manual_seed(a[1])).to(dtype))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=20)
                           | st.floats(allow_nan=False), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(a=st.integers(-2**63, 2**63), b=st.none() | st.text(), c=st.lists(json_values, max_size=5),
       names=st.lists(st.sampled_from(sorted(DTYPES)), unique=True, max_size=4), data=st.data())
def test_every_message_the_schema_allows_comes_back_exactly(a, b, c, names, data):
    # Generated valid (every example decodes): fields equal, tensors bit for bit (NaN payloads included)
    tensors = {name: data.draw(tensor_for(name)) for name in names}
    x, y = socket.socketpair()
    with x, y:
        threading.Thread(target=send, args=(x, "m", {"a": a, "b": b, "c": c}, tensors), daemon=True).start()
        message = recv(y, {"m": ANY})
    assert message.kind == "m" and message.fields == {"a": a, "b": b, "c": c}
    assert sorted(message.tensors) == sorted(names)
    for name, t in tensors.items():
        got = message.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and bits(got) == bits(t)


@pytest.mark.parametrize("raw,error", [
    (frame(b"\x80\x04\x95 not json"), "a header that is not JSON"),
    (frame(b'{"kind": "m", ' + b'[' * 100000), "a header that is not JSON"),
    (frame({"kind": "exec", "tensors": []}), "a message of kind 'exec'; expected m"),
    (frame(["m"]), "a header without a kind"),
    (frame({"kind": "m", "a": 1, "b": None, "tensors": []}), r"fields \['a', 'b'\]; expected \['a', 'b', 'c'\]"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "d": 0, "tensors": []}), "with fields"),
    (frame({"kind": "m", "a": True, "b": None, "c": [], "tensors": []}), "whose a is bool"),
    (frame({"kind": "m", "a": 1.5, "b": None, "c": [], "tensors": []}), "whose a is float"),
    (frame({"kind": "m", "a": 1, "b": 3, "c": [], "tensors": []}), "whose b is int"),
    (frame({"kind": "m", "a": 1, "b": None, "c": []}), "without a valid tensor list"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["float32", "float32", [-1, 2]]]}),
     "an unexpected tensor"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["code", "float32", [1, 2]]]}),
     "an unexpected tensor"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["float32", "int64", [1, 2]]]}),
     "whose float32 is int64 of shape"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["float32", "float32", [4]]]}),
     "with 2 dimension"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["bool", "bool", [1, 2]]]}, b"\x01\x07"),
     "bytes that are not booleans"),
    (frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["uint8", "uint8", [1 << 20, 1 << 20]]]}),
     "tensor bytes, over"),
    (struct.pack("<I", MAX_HEADER_BYTES + 1), "a header of .* bytes, over"),
])
def test_a_malformed_frame_is_one_wire_error_naming_it(raw, error):
    with pytest.raises(WireError, match=error):
        read(raw, max_bytes=1 << 30)


def test_a_frame_cut_short_is_the_peer_closing_not_a_message():
    whole = frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["int64", "int64", [2, 2]]]}, bytes(32))
    assert read(whole).tensors["int64"].shape == (2, 2)
    with pytest.raises(ConnectionError, match="closed"):
        read(whole[:-1])


def test_a_check_refuses_a_message_before_its_tensors_are_read():
    raw = frame({"kind": "m", "a": 1, "b": None, "c": [], "tensors": [["float32", "float32", [1000, 1000]]]})

    def no_big_tensors(kind, fields, specs):
        if math.prod(specs[0][2]) > 10:
            raise WireError("too many values for this model")

    with pytest.raises(WireError, match="too many values for this model"):
        read(raw, check=no_big_tensors)  # the 4 MB it declares were never sent: refused, not waited for


def test_what_json_cannot_carry_is_refused_at_the_sender_by_name():
    x, y = socket.socketpair()
    with x, y, pytest.raises(ValueError, match="a 'm' message cannot be sent: Object of type bytes"):
        send(x, "m", {"a": b"raw"})
    with pytest.raises(WireError, match="a 'm' message whose a is float inf"):
        parse_header(json.dumps({"kind": "m", "a": float("inf"), "tensors": []}).encode(),
                     {"m": Kind({"a": (float,)})})
