"""An HTTP proxy in front of moto that misbehaves on request, like real S3 and its clones can.

``S3Proxy(upstream, drop_if_none_match=True)`` forwards every request without its
``If-None-Match`` (a store that ignores conditional writes); setting ``fail_next_put`` makes the
next PUT reach moto and then answers 503 in its place (a server error after the write was applied);
every request whose method is in ``unavailable`` is answered 503 without reaching moto (a store
that keeps throttling), and ``refused`` lists their methods. ``forwarded`` lists ``(method, moto's
status)`` of what went through.
"""

from __future__ import annotations

import http.client
import http.server
import threading

_SERVICE_UNAVAILABLE = (b"<Error><Code>ServiceUnavailable</Code><Message>Please reduce your request rate."
                        b"</Message></Error>")


class S3Proxy:
    def __init__(self, upstream: str, *, drop_if_none_match: bool = False):
        host, port = upstream.rsplit("/", 1)[-1].split(":")
        self.fail_next_put = False
        self.unavailable: set[str] = set()
        self.refused: list[str] = []
        self.forwarded: list[tuple[str, int]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command in proxy.unavailable:
                    proxy.refused.append(self.command)
                    self._answer(503, [], _SERVICE_UNAVAILABLE)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if not (drop_if_none_match and k.lower() == "if-none-match")}
                connection = http.client.HTTPConnection(host, int(port), timeout=10)
                try:
                    connection.request(self.command, self.path, body=body, headers=headers)
                    answer = connection.getresponse()
                    payload = answer.read()
                finally:
                    connection.close()
                proxy.forwarded.append((self.command, answer.status))
                if self.command == "PUT" and proxy.fail_next_put:
                    proxy.fail_next_put = False
                    self._answer(503, [], _SERVICE_UNAVAILABLE)
                else:
                    self._answer(answer.status, answer.getheaders(), payload)

            def _answer(self, status, headers, payload):
                self.send_response(status)
                length = str(len(payload))
                for name, value in headers:
                    if name.lower() == "content-length" and self.command == "HEAD":
                        length = value  # the object's size: a HEAD answer has no body
                    elif name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
