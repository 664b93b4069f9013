"""moto's S3 server handling one request at a time: what the storage tests start (`conftest.py`).

moto checks a PUT's If-Match and If-None-Match and then stores the object as two steps of a request's handling, and
its own server (`python -m moto.server`) handles requests on threads: two conditional PUTs naming one version could
both pass the check, which S3 itself decides atomically (of any number of such writers, one wins). The workdir lock's
take-over relies on that (tests/storage/test_bucket_workdir.py: four runs taking over one stale lock got two leases
from the threaded server under load). Here requests still arrive on threads (connections kept alive), but each is
handled whole, its response made, before the next.

    python tests/storage/s3_server.py -H 127.0.0.1 -p PORT
"""

import argparse
import os
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto.server sets it: moto's URLs name the port
    backend = DomainDispatcherApplication(create_backend_app)
    one_at_a_time = threading.Lock()

    def serialized(environ, start_response):
        with one_at_a_time:
            return list(backend(environ, start_response))  # the whole response, made inside the lock

    run_simple(args.host, args.port, serialized, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
