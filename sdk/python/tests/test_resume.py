"""Unit tests for torpor.resume against a fake agent (a unix socket server
speaking the events protocol). Run: python3 -m unittest discover -s tests"""

import http.client
import http.server
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import unittest

os.environ["TORPOR_RESUME_AUTOSTART"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torpor.resume as tr  # noqa: E402


class FakeAgent(object):
    def __init__(self, gen=1):
        self.dir = tempfile.mkdtemp(prefix="trs")
        self.gen = gen
        self.write_gen(gen)
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ln.bind(os.path.join(self.dir, "events"))
        self.ln.listen(4)
        self.conns = []
        self.ready = threading.Event()
        self.subscribe_name = None
        threading.Thread(target=self._accept, daemon=True).start()

    def write_gen(self, g):
        with open(os.path.join(self.dir, "generation"), "w") as f:
            f.write("%d\n" % g)

    def _accept(self):
        while True:
            try:
                c, _ = self.ln.accept()
            except OSError:
                return
            c.sendall((json.dumps({"event": "hello", "generation": self.gen}) + "\n").encode())
            f = c.makefile("rb")
            sub = json.loads(f.readline())
            assert sub.get("subscribe") is True, sub
            self.subscribe_name = sub.get("name")
            c.sendall(b'{"event":"subscribed"}\n')
            self.conns.append((c, f))
            self.ready.set()

    def resume(self, gen, seq, forked=False, timeout=5):
        """Sends a resume event and returns the decoded ack."""
        self.gen = gen
        self.write_gen(gen)
        c, f = self.conns[-1]
        ev = {"event": "resume", "generation": gen, "forked": forked,
              "host_time": "2026-11-29T08:46:06.123456789Z", "snapshot_id": "snap-1", "seq": seq}
        c.sendall((json.dumps(ev) + "\n").encode())
        c.settimeout(timeout)
        return json.loads(f.readline())

    def close(self):
        for c, f in self.conns:
            c.close()
        self.ln.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ResumeRuntimeTest(unittest.TestCase):
    def setUp(self):
        self.agent = FakeAgent(gen=5)
        self.old_dir = tr.DIR
        tr.DIR = self.agent.dir
        self.assertTrue(tr.start(name="unittest"))
        self.assertTrue(self.agent.ready.wait(5), "no subscribe")
        self.saved = (list(tr._callbacks), list(tr._pools))
        with tr._cond:
            tr._last[0] = None

    def tearDown(self):
        tr.stop()
        tr.DIR = self.old_dir
        tr._callbacks[:] = self.saved[0]
        tr._pools[:] = self.saved[1]
        self.agent.close()

    def test_reseed_first_then_callbacks_in_order_then_ack(self):
        self.assertEqual(self.agent.subscribe_name, "unittest")
        for _ in range(100):
            if tr.subscribed():
                break
            time.sleep(0.01)
        self.assertTrue(tr.subscribed())
        self.assertEqual(tr.generation(), 5)
        calls = []
        random.seed(12345)
        expected_unreseeded = random.Random(12345).getrandbits(64)

        @tr.on_resume
        def first(ev):
            calls.append(("first", ev.generation, random.getrandbits(64)))

        tr.on_resume(lambda ev: calls.append(("second", ev.generation, None)))
        tr.on_resume(lambda ev: calls.append(("early", ev.generation, None)), order=-1)
        ack = self.agent.resume(6, seq=1)
        self.assertEqual(ack, {"ack": 1})
        self.assertEqual([c[0] for c in calls], ["early", "first", "second"])
        # The callback already drew from a reseeded generator.
        self.assertNotEqual(calls[1][2], expected_unreseeded)
        self.assertEqual(tr.generation(), 6)
        ev = tr.wait_for_resume(timeout=1, after=5)
        self.assertIsNotNone(ev)
        self.assertEqual((ev.generation, ev.seq, ev.snapshot_id, ev.forked), (6, 1, "snap-1", False))
        self.assertEqual(ev.host_time.year, 2026)

    def test_failing_callback_still_acks(self):
        def bad(ev):
            raise RuntimeError("boom")
        ran = []
        tr.on_resume(bad)
        tr.on_resume(lambda ev: ran.append(ev.seq))
        stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
        try:
            self.assertEqual(self.agent.resume(7, seq=3), {"ack": 3})
        finally:
            sys.stderr.close()
            sys.stderr = stderr
        self.assertEqual(ran, [3])
        tr.wait_for_resume(1, after=6)
        self.assertEqual(len(tr.last_errors()), 1)

    def test_fork_wipes_secrets_and_moves_intents(self):
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        key = bytearray(b"hunter2")
        tr.fork_unsafe_secret("api key", key)
        j = tr.Journal(os.path.join(d, "j.jsonl"))
        unsafe = j.begin("create_pr", {"t": 1})
        safe = j.begin("read", 1, fork_safe=True)
        self.agent.resume(6, seq=1, forked=False)
        tr.wait_for_resume(2, after=5)
        self.assertIs(tr.secret("api key"), key)
        self.assertEqual(len(j.pending()), 2)
        self.agent.resume(9, seq=2, forked=True)
        tr.wait_for_resume(2, after=6)
        self.assertIsNone(tr.secret("api key"))
        self.assertEqual(bytes(key), b"\0" * 7)
        self.assertEqual([i.key for i in j.pending()], [safe])
        with open(os.path.join(d, "j.jsonl.forked-9")) as f:
            moved = [json.loads(x) for x in f]
        self.assertEqual([m["key"] for m in moved], [unsafe])
        j2 = tr.Journal(os.path.join(d, "j.jsonl"))
        self.assertEqual([i.key for i in j2.pending()], [safe])
        j2.close()
        j.begin("after", None)  # the journal keeps working after the rewrite
        j.close()

    def test_stale_connection_closed_on_resume(self):
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self.addCleanup(srv.server_close)
        self.addCleanup(srv.shutdown)
        conn = tr.register_connection(http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=5))
        conn.request("GET", "/")
        self.assertEqual(conn.getresponse().read(), b"ok")
        first_sock = conn.sock
        self.assertIsNotNone(first_sock)
        reset = []
        tr.register_pool(lambda: reset.append(1))
        self.agent.resume(6, seq=1)
        tr.wait_for_resume(2, after=5)
        self.assertIsNone(conn.sock, "registered connection not closed on resume")
        self.assertEqual(reset, [1])
        conn.request("GET", "/")
        self.assertEqual(conn.getresponse().read(), b"ok")
        conn.close()


class NoAgentTest(unittest.TestCase):
    def test_outside_torpor(self):
        old = tr.DIR
        tr.DIR = tempfile.mkdtemp()
        try:
            self.assertIsNone(tr.generation())
            self.assertFalse(tr.start())
            self.assertFalse(tr.connected())
            self.assertEqual(tr.clock_offset_ns(), 0)
            self.assertIsNone(tr.wait_for_resume(timeout=0.05))
        finally:
            shutil.rmtree(tr.DIR)
            tr.DIR = old


class ClockTest(unittest.TestCase):
    def test_offset_and_expiry(self):
        old = tr.DIR
        tr.DIR = tempfile.mkdtemp()
        self.addCleanup(setattr, tr, "DIR", old)
        self.addCleanup(shutil.rmtree, tr.DIR)
        self.assertFalse(tr.expired(time.time() + 60))
        self.assertTrue(tr.expired(time.time() - 0.001))
        lease = tr.Lease(ttl=2)
        self.assertTrue(lease.valid())
        with open(os.path.join(tr.DIR, "clock_offset_ns"), "w") as f:
            f.write("10000000000\n")
        self.assertAlmostEqual(tr.now() - time.time(), 10, delta=0.5)
        self.assertTrue(tr.expired(time.time() + 5))
        self.assertFalse(lease.valid())
        import datetime
        self.assertTrue(tr.expired(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=5)))


class JournalTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "j.jsonl")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_crash_between_intent_and_outcome(self):
        j = tr.Journal(self.path)
        a = j.begin("create_pr", {"repo": "x/y"})
        b = j.begin("mail", "hi")
        j.complete(b, {"id": 1})
        self.assertTrue(a.startswith("idem-") and len(a) == 37 and a != b)
        # A new process reopens the file (the old one never closed it).
        j2 = tr.Journal(self.path)
        p = j2.pending()
        self.assertEqual([(i.key, i.tool, i.args) for i in p], [(a, "create_pr", {"repo": "x/y"})])
        j2.complete(a, "created")
        with self.assertRaises(KeyError):
            j2.complete("idem-nope", 1)
        j.close()
        j2.close()
        with tr.Journal(self.path) as j3:
            self.assertEqual(j3.pending(), [])

    def test_key_not_from_random(self):
        random.seed(1)
        k1 = tr.new_key()
        random.seed(1)
        self.assertNotEqual(k1, tr.new_key())

    def test_torn_last_line(self):
        with tr.Journal(self.path) as j:
            a = j.begin("t", 1)
        with open(self.path, "rb") as f:
            before = f.read()
        for tail in ['{"type":"outcome","key":"%s","outc' % a, '{"type":"outcome","key":"%s","outcome":1}' % a]:
            with open(self.path, "ab") as f:
                f.write(tail.encode())
            j = tr.Journal(self.path)
            self.assertEqual([i.key for i in j.pending()], [a])
            with open(self.path, "rb") as f:
                self.assertEqual(f.read(), before)
            j.complete(a, "x")
            j.close()
            with tr.Journal(self.path) as j:
                self.assertEqual(j.pending(), [])
            with open(self.path, "wb") as f:
                f.write(before)
        with open(self.path, "wb") as f:
            f.write(b"garbage\n" + before)
        with self.assertRaises(ValueError):
            tr.Journal(self.path)

    def test_reads_go_journal_format(self):
        line = ('{"type":"intent","key":"idem-00","tool":"t","args":{"a":1},'
                '"begun_at":"2026-11-29T08:46:06.123456789Z"}\n')
        with open(self.path, "w") as f:
            f.write(line)
        with tr.Journal(self.path) as j:
            p = j.pending()
            self.assertEqual((p[0].key, p[0].args, p[0].fork_safe), ("idem-00", {"a": 1}, False))


if __name__ == "__main__":
    unittest.main()
