"""torpor's reference workload: a long-running Python HTTP server holding state.

It keeps a request counter and MIB mebibytes of random data in memory, so a
hibernate/resume cycle can show that processes continue where they stopped:

  GET /count      -> {"count": n, "pid": p}         (n counts every request)
  GET /checksum   -> {"count": n, "sha256": hex, "bytes": b}
  GET /touch      -> reads one byte of every 4 KiB page of the data (working set)

Usage: python3 server.py PORT MIB
"""
import hashlib
import http.server
import json
import os
import sys

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 64

DATA = bytearray(os.urandom(MIB << 20))
COUNT = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        global COUNT
        COUNT += 1
        body = {"count": COUNT, "pid": os.getpid()}
        if self.path.startswith("/checksum"):
            body["sha256"] = hashlib.sha256(DATA).hexdigest()
            body["bytes"] = len(DATA)
        elif self.path.startswith("/touch"):
            body["sum"] = sum(DATA[i] for i in range(0, len(DATA), 4096))
        out = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


class Server(http.server.HTTPServer):
    def server_bind(self):
        # HTTPServer.server_bind calls socket.getfqdn(), which waits for DNS;
        # sandboxes have no reachable nameserver (docs/decisions/gvisor-engine.md).
        self.socket.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)
        self.server_name, self.server_port = "sandbox", self.server_address[1]


if __name__ == "__main__":
    Server(("0.0.0.0", PORT), Handler).serve_forever()
