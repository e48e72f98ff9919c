"""Stands in for vLLM's OpenAI server only in the tests of how long lit's server process lives (``test_server.py``):
``InferenceServer`` starts it through a fake interpreter (``InferenceConfig.python``), so lit's own start-up and
shut-down code runs unchanged, in a second instead of minutes. It answers ``GET /health`` and nothing else.

Like vLLM's API server, it starts a child in its own process group (vLLM's engine core), and on SIGTERM stops that
child and exits. The parent-death signal lit asks for reaches only this process, the group's leader: taking the
child down with it is the server's part, which ``test_vllm_engine_core_dies_with_a_crashed_trainer`` checks vLLM
does.

Run as ``python _vllm_stand_in.py <vLLM's arguments>``: it reads ``--host`` and ``--port`` and ignores the rest.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def option(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit, so that the engine is stopped below
    engine = None
    try:
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        host = option("--host")
        ThreadingHTTPServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = ThreadingHTTPServer((host, int(option("--port"))), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        while True:
            signal.pause()
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait()


if __name__ == "__main__":
    main()
