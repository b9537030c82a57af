"""The wire the weights travel over, from the trainer to its rollout endpoints (gspo/rollout/endpoint/weights.py):
authenticated TCP connections carrying tensors and a small JSON header checked against a schema. Nothing read from
a socket is unpickled or executed (docs/distributed.md, "Threat model").

Trust. A listener binds exactly the host it is given (the address the trainer reaches an endpoint from). Before
anything else is
read, each side proves it holds the run's secret, an HMAC-SHA256 over the other side's fresh random challenge:

    connector -> listener   MAGIC, nonce_c
    listener  -> connector  MAGIC, nonce_l, mac("listener", nonce_c, nonce_l)
    connector -> listener   rank (u32), mac("connector", nonce_l, nonce_c, rank)
    listener  -> connector  one status byte: ACCEPTED, or why not

The role names keep a proof from being reflected back to the side that asked for it; fresh nonces keep it from
being replayed. The channel is not encrypted: whoever can watch or alter the traffic between two machines can read
it and alter later messages (though never make a peer run code): use a private network or a tunnel.

Messages. A frame is the header's length (u32), the header (UTF-8 JSON: {"kind", the kind's fields, "tensors":
[[name, dtype, shape], ...]}), then each tensor's bytes (little-endian, C order). `recv` checks the header against
the kind's schema (`Kind`: field names and JSON types, tensor names, dtypes and ranks) before it reads a byte of
any tensor.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import queue
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

MAGIC = b"GSPO-ROLLOUT/1\r\n"  # ends a line: an HTTP server answers it at once, so a wrong port is named fast
NONCE_BYTES = MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0  # the longest either side waits for the other's next handshake message
MAX_HEADER_BYTES = 1 << 26  # 64 MiB of JSON (a step's prompts and data rows)
MAX_TENSORS = 64
MAX_HANDSHAKES = 32  # connections proving themselves at once; more are closed unread
ACCEPTED, RANK_TAKEN, RANK_UNKNOWN = 1, 2, 3  # the listener's last handshake byte
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
          "uint8": torch.uint8, "bool": torch.bool}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LENGTH = struct.Struct("<I")


class WireError(ValueError):
    """A peer that is not who it must be, or a message that is not one the protocol allows."""


class Closed(ConnectionError):
    """The peer closed the connection (`got`: the bytes of the unfinished read)."""

    def __init__(self, got: bytes = b""):
        super().__init__("the peer closed the connection")
        self.got = got


@dataclass(frozen=True)
class Kind:
    """What a message of one kind holds: `fields` name -> the JSON types its value may have (int excludes bool;
    float admits int; type(None): may be null); `tensors` name -> (dtype names, rank), those in `optional`
    may be left out."""

    fields: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    optional: tuple = ()


@dataclass
class Message:
    kind: str
    fields: dict
    tensors: dict  # name -> Tensor (on the CPU)


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join((role, *parts)), hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int, into=None) -> bytearray:
    """Exactly `n` bytes (into the writable buffer `into`, if given); `Closed` if the peer closes first."""
    buf = bytearray(n) if into is None else into
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise Closed(bytes(view[:got]))
        got += k
    return buf


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise WireError("the weight wire sends tensors little-endian; this machine is big-endian")


# ---- the handshake ----

def listen(host: str, port: int) -> socket.socket:
    """A socket listening on exactly `host`:`port` (port 0: one the kernel picks); a WireError naming the cause."""
    _check_byteorder()
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise WireError(f"cannot listen at {host}:{port}: the host does not resolve ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted trainer's old connections in TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(MAX_HANDSHAKES)
    except OSError as err:
        sock.close()
        hint = {98: ": another run or program holds this port",
                99: ": no interface of this machine has this address"}.get(err.errno, "")
        raise WireError(f"cannot listen at {host}:{port}: {err.strerror}{hint}") from None
    return sock


def _prove_listener(conn: socket.socket, secret: bytes) -> int:
    """The listener's side of the handshake, up to the status byte: the rank the peer proved it holds."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    magic = _read_exact(conn, len(MAGIC))
    if magic != MAGIC:
        raise WireError(f"it does not speak gspo's weight wire (it sent {bytes(magic)!r})")
    nonce_c, nonce_l = bytes(_read_exact(conn, NONCE_BYTES)), os.urandom(NONCE_BYTES)
    conn.sendall(MAGIC + nonce_l + _mac(secret, b"listener", nonce_c, nonce_l))
    answer = bytes(_read_exact(conn, 4 + MAC_BYTES))
    if not hmac.compare_digest(answer[4:], _mac(secret, b"connector", nonce_l, nonce_c, answer[:4])):
        raise WireError("it did not prove the run's secret")
    return int.from_bytes(answer[:4], "little")


def accept_peers(listener: socket.socket, secret: bytes, ranks: range, timeout_s: float, *, alive=lambda: None,
                 refused=lambda line: None) -> dict[int, socket.socket]:
    """Accept connections on `listener` until every rank in `ranks` has joined with the secret proven; {rank:
    socket}. A peer that fails the handshake (or claims a rank that is taken or unknown) is dropped and
    `refused(line)` is called; `alive()` may raise to stop waiting (a spawned worker died). TimeoutError when
    `timeout_s` passes first. Handshakes run in threads of their own: a silent peer delays nobody."""
    results: queue.Queue = queue.Queue()
    done, slots = threading.Event(), threading.BoundedSemaphore(MAX_HANDSHAKES)

    def handshake(conn, peer):
        try:
            results.put((conn, peer, _prove_listener(conn, secret), None))
        except (OSError, WireError) as err:
            conn.close()
            results.put((None, peer, None, "it closed the connection" if isinstance(err, Closed) else
                         "it sent no handshake in time" if isinstance(err, TimeoutError) else str(err)))
        finally:
            slots.release()
        if done.is_set():  # arrived after the waiting ended
            conn.close()

    joined: dict[int, socket.socket] = {}
    listener.settimeout(0.05)
    deadline = time.monotonic() + timeout_s
    try:
        while len(joined) < len(ranks):
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ranks) - len(joined)} of {len(ranks)} peer(s) did not join within "
                                   f"{timeout_s:g} s")
            try:
                conn, peer = listener.accept()
                if slots.acquire(blocking=False):
                    threading.Thread(target=handshake, args=(conn, peer), daemon=True).start()
                else:
                    conn.close()
                    refused(f"{peer[0]}:{peer[1]}: too many connections at once")
            except TimeoutError:
                pass
            while not results.empty():
                conn, peer, rank, why = results.get()
                if why is None:
                    status = RANK_TAKEN if rank in joined else ACCEPTED if rank in ranks else RANK_UNKNOWN
                    try:
                        conn.sendall(bytes([status]))
                    except OSError:
                        status, why = None, "it closed the connection"
                    if status == ACCEPTED:
                        _keep_alive(conn)
                        joined[rank] = conn
                        continue
                    conn.close()
                    why = why or f"it proved the secret but claimed rank {rank}, which is " + (
                        "taken" if status == RANK_TAKEN else f"not one of {ranks.start}..{ranks.stop - 1}")
                refused(f"{peer[0]}:{peer[1]}: {why}")
    except BaseException:
        for conn in joined.values():
            conn.close()
        raise
    finally:
        done.set()
    return joined


def invite_one(host: str, secret: bytes, invite, timeout_s: float, *, refused=lambda line: None) -> socket.socket:
    """Listen on `host` (a port of the OS's choice), call `invite(port)` (it asks the peer to connect: an HTTP call,
    vLLM's init) while a thread accepts the one peer that proves `secret` as rank 1; its socket. Where the invitation
    fails its error is raised at once; TimeoutError when no peer has joined within `timeout_s`."""
    from concurrent.futures import ThreadPoolExecutor

    listener = listen(host, 0)
    pool = ThreadPoolExecutor(1, thread_name_prefix="gspo-accept")
    stop = threading.Event()

    def stopped():
        if stop.is_set():
            raise Closed("the invitation failed")

    accepting = pool.submit(accept_peers, listener, secret, range(1, 2), timeout_s, alive=stopped, refused=refused)
    try:
        invite(listener.getsockname()[1])
    except BaseException:
        stop.set()  # accept_peers ends within 0.05 s
        pool.shutdown(wait=True)
        if accepting.exception() is None:  # the peer had joined before the invitation failed
            accepting.result()[1].close()
        listener.close()
        raise
    try:
        return accepting.result()[1]
    finally:
        pool.shutdown(wait=True)
        listener.close()


def connect(host: str, port: int, secret: bytes, rank: int, timeout_s: float) -> socket.socket:
    """A connection to the listener at `host`:`port`, both sides' secrets proven, as `rank`. Retries a refused
    connection until `timeout_s` (the listener may start later); a WireError in one line otherwise."""
    _check_byteorder()
    where, deadline = f"{host}:{port}", time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
            break
        except socket.gaierror as err:
            raise WireError(f"{where}: the host does not resolve ({err.strerror})") from None
        except OSError as err:  # refused, unreachable, timed out: keep trying until the deadline
            if time.monotonic() + 0.5 > deadline:
                raise WireError(f"nothing answered at {where} within {timeout_s:g} s "
                                f"({err.strerror or type(err).__name__}): is the trainer running there?") from None
            time.sleep(0.5)
    try:
        _prove_connector(sock, secret, rank, where)
    except BaseException:
        sock.close()
        raise
    _keep_alive(sock)
    return sock


def _keep_alive(sock: socket.socket) -> None:
    """Blocking from now on, with TCP keepalive probes: a peer whose machine vanished is noticed in about two
    minutes (Linux's default would wait two hours)."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _prove_connector(sock: socket.socket, secret: bytes, rank: int, where: str) -> None:
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce_c = os.urandom(NONCE_BYTES)
    not_ours = "it does not speak gspo's weight wire (is it the trainer's listener?)"
    try:
        sock.sendall(MAGIC + nonce_c)
        magic = _read_exact(sock, len(MAGIC))
    except Closed as err:
        got = f"answered {err.got!r} and " if err.got else ""
        raise WireError(f"{where} {got}closed the connection: {not_ours}") from None
    except TimeoutError:
        raise WireError(f"{where} accepted the connection but answered nothing within {HANDSHAKE_TIMEOUT_S:g} s: "
                        f"{not_ours}") from None
    if magic != MAGIC:
        raise WireError(f"{where} answered {bytes(magic)!r}: {not_ours}")
    try:
        reply = bytes(_read_exact(sock, NONCE_BYTES + MAC_BYTES))
        nonce_l = reply[:NONCE_BYTES]
        if not hmac.compare_digest(reply[NONCE_BYTES:], _mac(secret, b"listener", nonce_c, nonce_l)):
            raise WireError(f"the trainer at {where} did not prove the run's secret: this side's secret differs "
                            "(GSPO_ROLLOUT_SECRET, rollout_secret_file or rollout_secret)")
        claim = rank.to_bytes(4, "little")
        sock.sendall(claim + _mac(secret, b"connector", nonce_l, nonce_c, claim))
        (status,) = _read_exact(sock, 1)
    except (Closed, TimeoutError):
        raise WireError(f"{where} dropped the connection during the handshake") from None
    if status != ACCEPTED:
        raise WireError(f"the trainer at {where} refused rank {rank}: " + (
            "a peer of that rank joined already" if status == RANK_TAKEN else "it waits for no such rank"))


# ---- messages ----

def _fits(value, types: tuple) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    if isinstance(value, float) and not math.isfinite(value) and float in types:
        return False  # a count or a time is finite
    return isinstance(value, types)


def send(sock: socket.socket, kind: str, fields: dict | None = None, tensors: dict | None = None) -> None:
    """Send one message: `fields` (JSON values) and `tensors` (name -> Tensor; None values are left out)."""
    parts = [(name, t.detach().to("cpu").contiguous().reshape(-1), list(t.shape))
             for name, t in (tensors or {}).items() if t is not None]
    try:
        header = json.dumps({"kind": kind, **(fields or {}),
                             "tensors": [[name, DTYPE_NAMES[t.dtype], shape] for name, t, shape in parts]}).encode()
    except (TypeError, ValueError, KeyError, RecursionError) as err:
        raise ValueError(f"weight wire: a {kind!r} message cannot be sent: {err}") from None
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"weight wire: a {kind!r} message's header is {len(header)} bytes, over "
                         f"{MAX_HEADER_BYTES} (prompts and data rows of one step)")
    sock.sendall(_LENGTH.pack(len(header)) + header)
    for _, t, _ in parts:
        if t.numel():
            sock.sendall(memoryview(t.view(torch.uint8).numpy()))


def parse_header(raw: bytes, kinds: dict) -> tuple[str, dict, list]:
    """(kind, fields, [(name, dtype, shape)]) of a header, checked against `kinds` (name -> Kind)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, nested past the parser's depth
        raise WireError(f"a header that is not JSON ({str(err)[:80]})") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError("a header without a kind")
    kind = header.pop("kind")
    spec = kinds.get(kind)
    if spec is None:
        raise WireError(f"a message of kind {kind[:40]!r}; expected {', '.join(kinds)}")
    listed = header.pop("tensors", None)
    if set(header) != set(spec.fields):
        raise WireError(f"a {kind!r} message with fields {sorted(header)[:12]}; expected {sorted(spec.fields)}")
    for name, types in spec.fields.items():
        if not _fits(header[name], types):
            raise WireError(f"a {kind!r} message whose {name} is {type(header[name]).__name__} "
                            f"{str(header[name])[:40]}")
    return kind, header, _tensor_specs(kind, listed, spec)


def _tensor_specs(kind: str, listed, spec: Kind) -> list:
    if not isinstance(listed, list) or len(listed) > MAX_TENSORS:
        raise WireError(f"a {kind!r} message without a valid tensor list")
    out, seen = [], set()
    for item in listed:
        ok = (isinstance(item, list) and len(item) == 3 and item[0] in spec.tensors and item[0] not in seen
              and isinstance(item[2], list) and all(type(n) is int and n >= 0 for n in item[2]))
        if not ok:
            raise WireError(f"a {kind!r} message with an unexpected tensor {str(item)[:60]}")
        name, dtype, shape = item
        dtypes, rank = spec.tensors[name]
        if dtype not in dtypes or len(shape) != rank:
            raise WireError(f"a {kind!r} message whose {name} is {str(dtype)[:20]} of shape {shape[:8]}; expected "
                            f"{'/'.join(dtypes)} with {rank} dimension(s)")
        seen.add(name)
        out.append((name, DTYPES[dtype], tuple(shape)))
    missing = set(spec.tensors) - seen - set(spec.optional)
    if missing:
        raise WireError(f"a {kind!r} message without its {', '.join(sorted(missing))}")
    return out


def recv(sock: socket.socket, kinds: dict, max_bytes: int = 1 << 36, check=None) -> Message:
    """The next message, checked against `kinds`; `check(kind, fields, specs)` may refuse it (raising WireError)
    before any tensor is read. Tensors over `max_bytes` in all are refused unread."""
    (length,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise WireError(f"a header of {length} bytes, over {MAX_HEADER_BYTES}")
    kind, fields, specs = parse_header(bytes(_read_exact(sock, length)), kinds)
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    if sum(sizes) > max_bytes:
        raise WireError(f"a {kind!r} message of {sum(sizes)} tensor bytes, over {max_bytes}")
    if check is not None:
        check(kind, fields, specs)
    tensors = {}
    for (name, dtype, shape), size in zip(specs, sizes):
        t = torch.empty(shape, dtype=dtype)
        if size:
            flat = t.view(-1).view(torch.uint8)  # (size,) the tensor's own memory
            _read_exact(sock, size, memoryview(flat.numpy()))
            if dtype == torch.bool and int(flat.max()) > 1:
                raise WireError(f"a {kind!r} message whose {name} holds bytes that are not booleans")
        tensors[name] = t
    return Message(kind, fields, tensors)


class Peer:
    """One authenticated connection, read by a thread of its own (messages wait in `inbox`) and written by another
    (`post` returns at once), so neither side can block the other on a full socket buffer. A failure of either
    thread is put into the inbox: the next `get` raises it."""

    def __init__(self, sock: socket.socket, kinds: dict):
        self.sock, self.kinds = sock, kinds
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.reader.start()
        self.writer.start()

    def _read(self) -> None:
        while True:
            try:
                self.inbox.put(recv(self.sock, self.kinds))
            except (OSError, WireError) as err:
                self.inbox.put(err)
                return

    def _write(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            message, sent = item
            try:
                send(self.sock, *message)
            except (OSError, ValueError) as err:
                self.inbox.put(err)
                return
            finally:
                sent.set()

    def post(self, kind: str, fields: dict | None = None, tensors: dict | None = None) -> threading.Event:
        """Queue a message; the event is set once it is written (or writing it failed)."""
        sent = threading.Event()
        self.outbox.put(((kind, fields, tensors), sent))
        return sent

    def get(self, timeout_s: float) -> Message:
        """The next message; TimeoutError after `timeout_s`; what failed the connection, raised."""
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None
        if isinstance(item, BaseException):
            self.inbox.put(item)  # the connection stays failed: every later get raises it too
            raise item
        return item

    def close(self, wait_s: float = 0.0) -> None:
        """Write what was posted (up to `wait_s`), tell the peer this side is done (FIN), give it up to `wait_s` to
        close its own, and close: a peer that reads a last message is not cut off before it."""
        self.outbox.put(None)
        self.writer.join(wait_s)
        if not self.writer.is_alive():  # all written: FIN, then the peer's last messages are read to its FIN
            _shutdown(self.sock, socket.SHUT_WR)
            self.reader.join(wait_s)
        _shutdown(self.sock, socket.SHUT_RDWR)  # unblocks a thread still waiting on a silent peer
        self.sock.close()


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:  # not connected any more
        pass


__all__ = ["Closed", "Kind", "Message", "Peer", "WireError", "accept_peers", "connect", "invite_one", "listen",
           "parse_header", "recv", "send"]
