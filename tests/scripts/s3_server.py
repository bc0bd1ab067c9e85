"""A real S3-compatible server for tests/manager/test_object_store.py: moto's S3 in server mode on
127.0.0.1 (an unused port), with two hooks:

* when a multipart ``UploadPart`` request of an object whose key contains ``kill-me``
  arrives, the file ``FLAG`` is created and the request is held for ``HOLD`` seconds before
  moto handles it, so the test can kill the uploading process while its upload is under way;
* faults injected at the server: ``PUT /__faults__`` with a JSON list of rules replaces the
  rules (``[]``: none), ``GET /__faults__`` returns how many requests each rule caught. A
  rule ``{"method", "path", "query", "key", "status", "code", "delay", "times"}`` catches a
  request whose method is ``method``, whose path contains ``path`` (``path_end``: ends
  with it), whose query string contains ``query`` and whose credentials' access key is
  ``key`` (each optional); it holds it for ``delay`` seconds, then answers ``status`` with the
  S3 error ``code`` (or, without ``status``, lets moto answer), at most ``times`` times
  (default: every time). The first rule that catches a request applies.

usage: s3_server.py FLAG [HOLD]
Prints ``PORT <n>`` once it listens; serves until terminated.
"""

import json
import os
import re
import sys
import threading
import time

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

flag, hold = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
app = DomainDispatcherApplication(create_backend_app)
rules, hits, guard = [], [], threading.Lock()
_KEY = re.compile(r"Credential=([^/]+)/")


def _catches(rule, environ):
    path = environ.get("PATH_INFO", "")
    key = _KEY.search(environ.get("HTTP_AUTHORIZATION", ""))
    return (
        rule.get("method") in (None, environ.get("REQUEST_METHOD"))
        and rule.get("path", "") in path
        and path.endswith(rule.get("path_end", ""))
        and rule.get("query", "") in environ.get("QUERY_STRING", "")
        and rule.get("key") in (None, key.group(1) if key else None)
    )


def _faults(environ, start_response):
    global rules, hits
    if environ["REQUEST_METHOD"] == "PUT":
        size = int(environ.get("CONTENT_LENGTH") or 0)
        with guard:
            rules = json.loads(environ["wsgi.input"].read(size) or b"[]")
            hits = [0] * len(rules)
    with guard:
        body = json.dumps(hits).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def hooked(environ, start_response):
    if environ.get("PATH_INFO") == "/__faults__":
        return _faults(environ, start_response)
    query = environ.get("QUERY_STRING", "")
    if (
        environ.get("REQUEST_METHOD") == "PUT"
        and "partNumber=" in query
        and "kill-me" in environ.get("PATH_INFO", "")
    ):
        with open(flag, "w") as fh:
            fh.write(environ.get("PATH_INFO", ""))
        time.sleep(hold)
    rule = None
    with guard:
        for n, candidate in enumerate(rules):
            if _catches(candidate, environ) and hits[n] < candidate.get("times", float("inf")):
                hits[n] += 1
                rule = candidate
                break
    if rule is not None:
        time.sleep(rule.get("delay", 0))
        if rule.get("status"):
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # the request, unused
            code = rule.get("code", "InternalError")
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>injected fault: {code}</Message><RequestId>kss</RequestId></Error>"
            ).encode()
            start_response(
                f"{rule['status']} Injected",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]  # HEAD: headers only
    return app(environ, start_response)


server = make_server("127.0.0.1", 0, hooked, threaded=True, request_handler=MotoRequestHandler)
print(f"PORT {server.server_address[1]}", flush=True)
sys.stderr = open(os.devnull, "w")  # werkzeug logs every request
server.serve_forever()
