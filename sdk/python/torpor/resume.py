"""The torpor resume contract for Python code inside a torpor sandbox.

Importing this module is enough to be safe against the commonest hazard of a
memory snapshot: if the process runs in a torpor sandbox, a daemon thread
connects to the guest agent's event socket (``/run/torpor/events``), subscribes,
and on every resume or fork

1. reseeds the ``random`` module (``random.seed(os.urandom(32))``) and every
   ``random.Random`` registered with :func:`register_random` -- before anything
   else runs;
2. in a clone (``event.forked``): wipes fork-unsafe secrets
   (:func:`fork_unsafe_secret`) and moves the pending, not fork-safe intents of
   every open :class:`Journal` aside;
3. drops pooled connections registered with :func:`register_pool` and
   :func:`register_connection` (see :func:`reset_http_pools`);
4. runs the callbacks registered with :func:`on_resume`, in registration order;

and then acknowledges the event: the torpor server forwards requests to the
sandbox only after every subscribed process acknowledged (or a deadline
passed), so the process's own code sees fresh state.

Outside a torpor sandbox (no socket) nothing happens: :func:`generation`
returns ``None`` and callbacks never fire. Only the standard library is used.

Example::

    import torpor.resume as tr

    journal = tr.Journal("/home/agent/intents.jsonl")
    for intent in journal.pending():            # after a crash or a resume
        retry(intent.tool, intent.args, key=intent.key)   # same key, never a new one
        journal.complete(intent.key, "done")

    key = journal.begin("create_pr", {"title": "fix"})    # on disk before the call
    create_pr(title="fix", idempotency_key=key)
    journal.complete(key, {"number": 7})
"""

import datetime as _dt
import json
import os
import random
import secrets as _secrets
import socket
import sys
import threading
import time
import weakref

__all__ = [
    "DIR", "ResumeEvent", "generation", "last_resume", "on_resume", "register_random",
    "register_pool", "register_connection", "reset_http_pools", "fork_unsafe_secret",
    "secret", "clock_offset_ns", "now", "expired", "expiry_in", "Lease", "Intent",
    "Journal", "new_key", "wait_for_resume", "start", "stop", "connected", "subscribed",
    "last_errors",
]

DIR = os.environ.get("TORPOR_RUN_DIR", "/run/torpor")
_GENERATION = "generation"
_RESUME = "resume.json"
_OFFSET = "clock_offset_ns"
_SOCKET = "events"


def _path(name):
    return os.path.join(DIR, name)


class ResumeEvent(object):
    """One resume event: ``kind`` ("restored" after a resume or fork,
    "unpaused" after the paused tier: same generation, the clocks jumped; ""
    from an older agent), ``generation``, ``forked``, ``host_time`` (an aware
    datetime or None), ``snapshot_id``, ``seq`` and the decoded ``raw`` dict."""

    __slots__ = ("kind", "generation", "forked", "host_time", "snapshot_id", "seq", "raw")

    def __init__(self, raw):
        self.raw = raw
        self.kind = raw.get("kind") or ""
        self.generation = int(raw.get("generation") or 0)
        self.forked = bool(raw.get("forked"))
        self.host_time = _parse_time(raw.get("host_time"))
        self.snapshot_id = raw.get("snapshot_id") or ""
        self.seq = int(raw.get("seq") or 0)

    def __repr__(self):
        return "ResumeEvent(kind=%r, generation=%d, forked=%r, snapshot_id=%r, seq=%d)" % (
            self.kind, self.generation, self.forked, self.snapshot_id, self.seq)


def _parse_time(s):
    """Parses RFC 3339 (with up to nanoseconds) into an aware datetime."""
    if not s:
        return None
    s = s.strip()
    if s.endswith("Z") or s.endswith("z"):
        s = s[:-1] + "+00:00"
    tz = ""
    for i in range(len(s) - 1, 9, -1):
        if s[i] in "+-":
            s, tz = s[:i], s[i:]
            break
    if "." in s:
        base, frac = s.split(".", 1)
        s = base + "." + (frac + "000000")[:6]
    try:
        return _dt.datetime.fromisoformat(s + tz)
    except ValueError:
        return None


# ---- generation, clock ---------------------------------------------------

def generation():
    """The sandbox's current generation (changes on every resume and fork), or
    None outside a torpor sandbox."""
    try:
        with open(_path(_GENERATION)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def last_resume():
    """The last resume event the agent recorded, or None."""
    try:
        with open(_path(_RESUME)) as f:
            return ResumeEvent(json.load(f))
    except (OSError, ValueError):
        return None


def clock_offset_ns():
    """Nanoseconds to add to the sandbox's wall clock to get the host's."""
    try:
        with open(_path(_OFFSET)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def now():
    """Corrected wall-clock time in seconds since the epoch (like time.time())."""
    return (time.time_ns() + clock_offset_ns()) / 1e9


def _epoch(ts):
    if isinstance(ts, _dt.datetime):
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=_dt.timezone.utc)
        return ts.timestamp()
    return float(ts)


def expired(ts):
    """Whether the expiry ``ts`` (epoch seconds or a datetime; naive means UTC)
    has passed on the corrected clock. Store expiries as wall-clock instants
    (not monotonic deadlines) so time spent hibernated counts."""
    return now() >= _epoch(ts)


def expiry_in(seconds):
    """The wall-clock instant ``seconds`` from now (for "expires_in" answers)."""
    return now() + seconds


class Lease(object):
    """A time-bounded right whose remaining time is recomputed on the corrected
    clock on every call."""

    def __init__(self, expiry=None, ttl=None):
        if expiry is None:
            expiry = expiry_in(ttl or 0)
        self.expiry = _epoch(expiry)

    def remaining(self):
        return self.expiry - now()

    def valid(self, for_seconds=0.0):
        return self.remaining() > for_seconds


# ---- registries ----------------------------------------------------------

_lock = threading.RLock()
_callbacks = []        # (order, seq, fn)
_seq = [0]
_randoms = weakref.WeakSet()
_pools = []            # objects or callables
_connections = weakref.WeakSet()
_secrets_reg = {}
_journals = weakref.WeakSet()


def on_resume(fn=None, order=0):
    """Registers ``fn(event)`` to run on every resume after the built-in steps,
    in ``order`` then registration order. Usable as a decorator."""
    def reg(f):
        with _lock:
            _seq[0] += 1
            _callbacks.append((order, _seq[0], f))
            _callbacks.sort(key=lambda c: (c[0], c[1]))
        return f
    if fn is None:
        return reg
    return reg(fn)


def register_random(r):
    """Registers a ``random.Random`` instance to be reseeded from os.urandom on
    every resume (the module-level ``random`` functions always are)."""
    _randoms.add(r)
    return r


def register_pool(obj):
    """Registers a connection pool to be reset on every resume: a urllib3
    PoolManager or connection pool, a requests Session, an httpx Client, an
    http.client connection, or any callable (called with no arguments)."""
    with _lock:
        if not any(p is obj for p in _pools):
            _pools.append(obj)
    return obj


def register_connection(conn):
    """Registers an ``http.client.HTTPConnection`` (or anything with close())
    to be closed on every resume. http.client reconnects on the next request, so
    the first request after a resume goes over a fresh connection instead of
    one whose peer hung up while the sandbox was hibernated."""
    _connections.add(conn)
    return conn


def _reset_one(obj):
    if callable(obj) and not hasattr(obj, "request") and not hasattr(obj, "clear"):
        obj()
        return
    adapters = getattr(obj, "adapters", None)
    if isinstance(adapters, dict):              # requests.Session: stays usable
        for a in list(adapters.values()):
            a.close()
        return
    if hasattr(obj, "_transport") and hasattr(obj, "_mounts"):   # httpx Client
        ts = [obj._transport] + [t for t in obj._mounts.values() if t is not None]
        for t in ts:
            pool = getattr(t, "_pool", None)
            target = pool if pool is not None else t
            res = target.close()
            if hasattr(res, "close") and hasattr(res, "send"):  # a coroutine: AsyncClient
                res.close()
                raise TypeError("register a callable for httpx.AsyncClient (its pools close asynchronously)")
        return
    if hasattr(obj, "clear") and hasattr(obj, "connection_from_url"):  # urllib3 PoolManager
        obj.clear()
        return
    q = getattr(obj, "pool", None)              # urllib3 HTTPConnectionPool
    if q is not None and hasattr(q, "queue"):
        for c in list(q.queue):
            if c is not None:
                c.close()
        return
    obj.close()                                 # http.client and the like


def reset_http_pools():
    """Drops every registered pool's and connection's open connections now (the
    built-in resume step calls it). Returns the list of errors."""
    with _lock:
        objs = list(_pools) + list(_connections)
    errs = []
    for o in objs:
        try:
            _reset_one(o)
        except Exception as e:  # noqa: BLE001 - reported, others still reset
            errs.append(e)
    return errs


def fork_unsafe_secret(name, value):
    """Registers a secret that a clone must not inherit and returns it. In a
    clone it is wiped (a bytearray is zeroed, a dict or list cleared) and
    :func:`secret` returns None for it."""
    with _lock:
        _secrets_reg[name] = value
    return value


def secret(name, default=None):
    """The fork-unsafe secret registered as ``name``, or ``default`` once wiped."""
    with _lock:
        return _secrets_reg.get(name, default)


def _wipe_secrets():
    with _lock:
        vals = list(_secrets_reg.values())
        _secrets_reg.clear()
    for v in vals:
        try:
            if isinstance(v, bytearray):
                v[:] = b"\0" * len(v)
            elif isinstance(v, (dict, list)):
                v.clear()
        except Exception:  # noqa: BLE001
            pass


# ---- intent journal ------------------------------------------------------

def new_key():
    """A fresh idempotency key from the kernel (os.urandom), never from
    ``random`` (which clones share)."""
    return "idem-" + _secrets.token_hex(16)


def _rfc3339(ts):
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Intent(object):
    """A recorded external action: ``key``, ``tool``, ``args``, ``fork_safe``,
    ``begun_at`` (RFC 3339), ``outcome`` and ``completed_at`` (None if pending)."""

    __slots__ = ("key", "tool", "args", "fork_safe", "begun_at", "outcome", "completed_at")

    def __init__(self, key, tool, args=None, fork_safe=False, begun_at=None, outcome=None, completed_at=None):
        self.key, self.tool, self.args, self.fork_safe = key, tool, args, fork_safe
        self.begun_at, self.outcome, self.completed_at = begun_at, outcome, completed_at

    @property
    def done(self):
        return self.completed_at is not None

    def record(self):
        r = {"type": "intent", "key": self.key, "tool": self.tool, "args": self.args, "begun_at": self.begun_at}
        if self.fork_safe:
            r["fork_safe"] = True
        return r

    def __repr__(self):
        return "Intent(key=%r, tool=%r, fork_safe=%r, done=%r)" % (self.key, self.tool, self.fork_safe, self.done)


def _fsync_dir(d):
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Journal(object):
    """An intent journal: a JSON-lines file (the same format as the Go SDK's)
    where each intent is appended and fsynced *before* the action and its
    outcome after. Reopening after a crash rebuilds the state (a torn last line
    is dropped). In a clone, pending intents not marked fork-safe are moved to
    ``<path>.forked-<generation>`` and are no longer pending. One process at a
    time may use a journal file."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        self._lock = threading.RLock()
        self._intents = {}
        self._order = []
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._f = os.fdopen(fd, "r+b", buffering=0)
        if created:
            _fsync_dir(os.path.dirname(self.path))
        try:
            self._load()
        except BaseException:
            self._f.close()
            raise
        _journals.add(self)

    def _load(self):
        data = self._f.read()
        good = 0
        off = 0
        while off < len(data):
            nl = data.find(b"\n", off)
            last = nl < 0
            end = len(data) if last else nl
            nxt = len(data) if last else nl + 1
            line = data[off:end].strip()
            if line:
                try:
                    rec = json.loads(line.decode("utf-8"))
                    if not isinstance(rec, dict) or not rec.get("key"):
                        raise ValueError("no key")
                except ValueError as e:
                    if last or not data[nxt:].strip():
                        break  # torn tail
                    raise ValueError("journal %s: bad record at byte %d: %s" % (self.path, off, e))
                if last:
                    break  # complete JSON but no newline: the append never finished
                self._apply(rec)
            off = nxt
            good = nxt
        if good < len(data):
            self._f.truncate(good)
            os.fsync(self._f.fileno())
        self._f.seek(0, os.SEEK_END)

    def _apply(self, rec):
        t, k = rec.get("type"), rec["key"]
        if t == "intent" and k not in self._intents:
            self._intents[k] = Intent(k, rec.get("tool"), rec.get("args"), bool(rec.get("fork_safe")), rec.get("begun_at"))
            self._order.append(k)
        elif t == "outcome" and k in self._intents:
            i = self._intents[k]
            i.outcome, i.completed_at = rec.get("outcome"), rec.get("completed_at") or "unknown"

    def _append(self, rec):
        self._f.write((json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8"))
        os.fsync(self._f.fileno())

    def begin(self, tool, args=None, fork_safe=False):
        """Records the intent to call ``tool`` with ``args`` (JSON-encodable)
        durably and returns its idempotency key. Send the key with the action
        and reuse it on every retry."""
        i = Intent(new_key(), tool, args, bool(fork_safe), _rfc3339(now()))
        with self._lock:
            self._append(i.record())
            self._intents[i.key] = i
            self._order.append(i.key)
        return i.key

    def complete(self, key, outcome=None):
        """Records the outcome of the intent ``key``; completing twice keeps
        the first outcome."""
        with self._lock:
            i = self._intents.get(key)
            if i is None:
                raise KeyError("unknown intent key %r in %s" % (key, self.path))
            if i.done:
                return
            ts = _rfc3339(now())
            self._append({"type": "outcome", "key": key, "outcome": outcome, "completed_at": ts})
            i.outcome, i.completed_at = outcome, ts

    def pending(self):
        """Intents without an outcome, oldest first: reconcile each (ask the
        external system, or retry with ``intent.key``)."""
        with self._lock:
            return [self._intents[k] for k in self._order if not self._intents[k].done]

    def get(self, key):
        with self._lock:
            return self._intents.get(key)

    def move_aside_for_fork(self, gen):
        """What a clone does: moves pending, not fork-safe intents to
        ``<path>.forked-<gen>`` and rewrites the journal without them. Returns
        the intents moved."""
        with self._lock:
            moved = [self._intents[k] for k in self._order
                     if not self._intents[k].done and not self._intents[k].fork_safe]
            if not moved:
                return []
            keep = [k for k in self._order if self._intents[k] not in moved]
            aside = "".join(json.dumps(i.record(), separators=(",", ":")) + "\n" for i in moved)
            with open("%s.forked-%d" % (self.path, gen), "ab") as f:
                f.write(aside.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            rest = []
            for k in keep:
                i = self._intents[k]
                rest.append(json.dumps(i.record(), separators=(",", ":")))
                if i.done:
                    rest.append(json.dumps({"type": "outcome", "key": k, "outcome": i.outcome,
                                            "completed_at": i.completed_at}, separators=(",", ":")))
            tmp = self.path + ".tmp"
            with open(tmp, "wb") as f:
                f.write("".join(r + "\n" for r in rest).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _fsync_dir(os.path.dirname(self.path))
            self._f.close()
            self._f = open(self.path, "r+b", buffering=0)
            self._f.seek(0, os.SEEK_END)
            for i in moved:
                del self._intents[i.key]
            self._order = keep
            return moved

    def close(self):
        with self._lock:
            _journals.discard(self)
            if not self._f.closed:
                self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- the resume steps and the event thread --------------------------------

_cond = threading.Condition()
_last = [None]          # last handled ResumeEvent
_errors = []            # errors of the last event's steps, for inspection


def _run_steps(ev):
    """Runs the resume steps for ev in the contract's order; returns errors."""
    errs = []
    # 1. Reseed before anything else.
    random.seed(os.urandom(32))
    for r in list(_randoms):
        try:
            r.seed(os.urandom(32))
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    # 2. Fork safety.
    if ev.forked:
        _wipe_secrets()
        for j in list(_journals):
            try:
                j.move_aside_for_fork(ev.generation)
            except Exception as e:  # noqa: BLE001
                errs.append(e)
    # 3. Connections.
    errs.extend(reset_http_pools())
    # 4. User callbacks.
    with _lock:
        cbs = list(_callbacks)
    for _, _, fn in cbs:
        try:
            fn(ev)
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    return errs


class _Runtime(object):
    def __init__(self, name):
        self.name = name
        self.sock = None
        self.stopped = False
        self.connected = False
        self.subscribed = False
        self.hello_generation = None
        self.thread = None

    def start(self):
        self.thread = threading.Thread(target=self._loop, name="torpor-resume", daemon=True)
        self.thread.start()

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(_path(_SOCKET))
            s.sendall((json.dumps({"subscribe": True, "name": self.name}) + "\n").encode())
        except OSError:
            s.close()
            raise
        self.sock = s
        self.connected = True
        return s

    def _loop(self):
        backoff = 0.1
        while not self.stopped:
            try:
                s = self._connect()
            except OSError:
                if not os.path.exists(_path(_SOCKET)):
                    return
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            try:
                self._serve(s)
            except OSError:
                pass
            finally:
                self.connected = False
                self.subscribed = False
                try:
                    s.close()
                except OSError:
                    pass
            if not self.stopped:
                time.sleep(backoff)

    def _serve(self, s):
        buf = b""
        while not self.stopped:
            chunk = s.recv(65536)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line.decode("utf-8"))
                except ValueError:
                    continue
                kind = msg.get("event")
                if kind == "hello":
                    self.hello_generation = msg.get("generation")
                elif kind == "subscribed":
                    self.subscribed = True
                elif kind == "start":
                    # A fresh start: nothing in this process predates it; just ack.
                    if msg.get("seq"):
                        s.sendall((json.dumps({"ack": int(msg["seq"])}) + "\n").encode())
                elif kind == "resume":
                    ev = ResumeEvent(msg)
                    errs = _run_steps(ev)
                    with _cond:
                        _last[0] = ev
                        _errors[:] = errs
                        _cond.notify_all()
                    s.sendall((json.dumps({"ack": ev.seq}) + "\n").encode())
                    if errs:
                        sys.stderr.write("torpor.resume: %d resume step(s) failed: %s\n"
                                         % (len(errs), "; ".join(repr(e) for e in errs)))

    def stop(self):
        self.stopped = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


_runtime = [None]


def start(name=None):
    """Starts the event thread if the socket exists and it is not running yet
    (import does this). Returns True if a thread runs."""
    with _lock:
        rt = _runtime[0]
        if rt is not None and rt.thread.is_alive():
            return True
        if not os.path.exists(_path(_SOCKET)):
            return False
        if name is None:
            name = "python:%d:%s" % (os.getpid(), os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "")
        rt = _Runtime(name)
        _runtime[0] = rt
        rt.start()
        return True


def stop():
    """Stops the event thread (for tests)."""
    with _lock:
        rt = _runtime[0]
        _runtime[0] = None
    if rt is not None:
        rt.stop()
        rt.thread.join(5)


def connected():
    """Whether the event thread is connected to the agent now."""
    rt = _runtime[0]
    return bool(rt and rt.connected)


def subscribed():
    """Whether the agent confirmed this process's subscription: from then on
    the server waits for this process's resume steps before forwarding requests."""
    rt = _runtime[0]
    return bool(rt and rt.subscribed)


def wait_for_resume(timeout=None, after=None):
    """Waits until the resume steps for an event have run and returns it (a
    :class:`ResumeEvent`), or None on timeout. With ``after`` (a generation),
    returns at once if an event with a greater generation was handled already;
    without it, waits for the next event."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cond:
        start_ev = _last[0]
        while True:
            ev = _last[0]
            if after is not None:
                if ev is not None and ev.generation > after:
                    return ev
            elif ev is not start_ev:
                return ev
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            _cond.wait(left)


def last_errors():
    """Errors of the resume steps of the last event (empty when all ran)."""
    with _cond:
        return list(_errors)


if os.environ.get("TORPOR_RESUME_AUTOSTART", "1") != "0":
    try:
        start()
    except Exception:  # noqa: BLE001 - importing must never fail
        pass
