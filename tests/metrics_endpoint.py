"""A loopback Prometheus /metrics endpoint for tests: answers from a script of replies."""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = tuple[int, bytes, float]  # status, body, delay before answering (s)


class MetricsEndpoint:
    """Serves ``replies`` in order, one per GET, the last one repeating; ``hits`` counts the GETs."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.hits = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body, delay = endpoint.replies[min(endpoint.hits, len(endpoint.replies) - 1)]
                endpoint.hits += 1
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(OSError):  # a scraper that timed out closed the socket
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
