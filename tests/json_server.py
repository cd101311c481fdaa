"""The tests' OpenAI-compatible stand-in servers answer JSON through one handler base (a real HTTP server on
127.0.0.1, http.server): each test's subclass says what its routes return."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:   # keep the test output clean
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
