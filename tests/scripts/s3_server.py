"""A real S3-compatible server for tests/test_object_store.py: moto's S3 in server mode on
127.0.0.1 (an unused port), with one hook: when a multipart ``UploadPart`` request of an
object whose key contains ``kill-me`` arrives, the file ``FLAG`` is created and the request
is held for ``HOLD`` seconds before moto handles it, so the test can kill the uploading
process while its upload is under way.

usage: s3_server.py FLAG [HOLD]
Prints ``PORT <n>`` once it listens; serves until terminated.
"""

import os
import sys
import time

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

flag, hold = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
app = DomainDispatcherApplication(create_backend_app)


def hooked(environ, start_response):
    query = environ.get("QUERY_STRING", "")
    if (
        environ.get("REQUEST_METHOD") == "PUT"
        and "partNumber=" in query
        and "kill-me" in environ.get("PATH_INFO", "")
    ):
        with open(flag, "w") as fh:
            fh.write(environ.get("PATH_INFO", ""))
        time.sleep(hold)
    return app(environ, start_response)


server = make_server("127.0.0.1", 0, hooked, threaded=True, request_handler=MotoRequestHandler)
print(f"PORT {server.server_address[1]}", flush=True)
sys.stderr = open(os.devnull, "w")  # werkzeug logs every request
server.serve_forever()
