"""The side endpoint: a daemon HTTP thread in the process that runs the model.

Why a side endpoint and not a field in the first response chunk: vLLM V1 runs the
model in an engine-core process, and the first chunk is written by the API-server
process; carrying the counts through vLLM's output path would mean patching its
serving code. A GET by request id after the prefill-only leg (`max_tokens=1`) needs
nothing from vLLM, costs one local round trip, and also works for a client that
does not stream.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from laneway_eldr.recorder import ExpertRecorder

PREFIX = "/eldr/requests/"


def serve(recorder: ExpertRecorder, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: no connection set-up per lookup
        disable_nagle_algorithm = True  # headers and body are two writes (40 ms ACK wait)

        def do_GET(self) -> None:
            if self.path.startswith(PREFIX):
                record = recorder.lookup(self.path[len(PREFIX):])
                if record is None:
                    self._send(404, "application/json", b'{"error": "unknown request"}')
                else:
                    self._send(200, "application/json", json.dumps(record).encode())
            elif self.path == "/metrics":
                self._send(200, "text/plain; version=0.0.4",
                           recorder.metrics_text().encode())
            else:
                self._send(404, "text/plain", b"not found")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="laneway-eldr", daemon=True).start()
    return server
