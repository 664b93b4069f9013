"""How lmzoo talks to a bucket's server: the fsspec clients (gcsfs, s3fs) it makes, each request within a deadline,
retried only while a retry can still end within it, and the errors a bucket that does not answer, does not exist or
gives no credentials raises, each naming the path. Below `lmzoo.storage`'s file API, which alone calls it.

Every wait on a bucket has a deadline (`deadline_seconds()`: 30 s, or LMZOO_STORAGE_DEADLINE_S): each request times out
after `request_timeout_seconds()` without an answer (connecting, or reading: no byte for that long). Once an operation
gave up, the server is taken for down: later operations on it try once, without retries, until one is answered.

Endpoints come from the environment variables the stores' own tools read, so one configuration serves real buckets
and emulators alike: STORAGE_EMULATOR_HOST for GCS; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, with the usual AWS
credential and region variables (or ~/.aws files), for S3. Bucket operations go through fsspec (gcsfs, s3fs), the
backend etils.epath itself uses for these schemes when TensorFlow is not installed. docs/notes/object-storage.md
says why, and what each client needs.
"""

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import secrets
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator

# Requests to a bucket in flight at once, per client: a training step reads hundreds of small ranges (aiohttp's
# default pool of 100 connections, and aiobotocore's of 10, would make that several round trips), and a loader
# prefetching steps ahead gets at most this many requests per latency (Little's law): 1,024 at 100 ms is 10K ranged
# reads a second, about 10M tokens of 1,024-token windows.
CONCURRENT_REQUESTS = 1024


# How long lmzoo waits for a bucket's server that does not answer, before it gives up (issue 55): an operation (its
# retries included), a checkpoint save waiting on the bucket (lmzoo.checkpoint), a token store's read. A run on a bucket
# that stops answering therefore stops within about twice this (docs/SCALING.md). Tests set a few seconds.
DEADLINE_VARIABLE = "LMZOO_STORAGE_DEADLINE_S"


DEFAULT_DEADLINE_SECONDS = 30.0


def deadline_seconds() -> float:
    """How long a wait on a bucket lasts at most: LMZOO_STORAGE_DEADLINE_S, else DEFAULT_DEADLINE_SECONDS."""
    text = os.environ.get(DEADLINE_VARIABLE, "").strip()
    if not text:
        return DEFAULT_DEADLINE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):  # NaN too
        raise ValueError(f"{DEADLINE_VARIABLE}={text!r}: give the seconds to wait for a bucket, a number > 0")
    return value


def request_timeout_seconds() -> float:
    """How long one request to a bucket may go without an answer (to connect, or between two reads): a third of the
    deadline, at most 10 s, so that an operation can retry within its deadline."""
    return _request_timeout(deadline_seconds())


def _request_timeout(deadline: float) -> float:
    return min(10.0, deadline / 3)


class BucketUnreachableError(OSError):
    """A bucket's server did not answer: the connection was refused or dropped, timed out, or the server failed."""


class BucketNotFoundError(FileNotFoundError):
    """The bucket of a gs:// or s3:// path does not exist."""


class BucketCredentialsError(PermissionError):
    """No credentials were found for a bucket (S3: AWS's variables, files and instance role all gave none)."""


def version(info: dict) -> str:
    """An object's version in gcsfs's or s3fs's `info`: its GCS generation or its S3 ETag."""
    return str(info["generation"]) if "generation" in info else info["ETag"]


def gcs_upload_if_generation(filesystem, location: str, data: bytes, generation: str) -> dict:
    """Uploads `data` with the precondition ifGenerationMatch=`generation`; returns the new object's resource.

    The multipart form gcsfs itself uploads with (gcsfs offers no other precondition than "absent"); fake-gcs-server
    enforces preconditions on this form, not on a plain media upload. 412 raises FileExistsError (gcsfs's mapping).
    """
    bucket, key, _ = filesystem.split_path(location)
    boundary = f"lmzoo-{secrets.token_hex(8)}"
    body = (
        (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': key})}\r\n"
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--".encode()
    )
    return filesystem.call(
        "POST",
        f"{filesystem._location}/upload/storage/v1/b/{urllib.parse.quote(bucket)}/o",
        uploadType="multipart",
        ifGenerationMatch=generation,
        headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
        data=body,
        json_out=True,
    )


def s3_lost_precondition(error: OSError) -> bool:
    """Whether s3fs's `error` is S3 refusing a conditional request: 412 PreconditionFailed, or 409
    ConditionalRequestConflict (another conditional write to the object in flight, which S3 may answer so)."""
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")


@contextlib.contextmanager
def unreachable_named(location: str) -> Iterator[None]:
    """Turns an error that says the server did not answer into BucketUnreachableError naming `location`; one of a
    bucket that does not exist into BucketNotFoundError, and S3's missing credentials into BucketCredentialsError,
    each naming the bucket (the clients' own errors name a URL, or print pages of traceback)."""
    try:
        yield
    except (BucketUnreachableError, BucketNotFoundError, BucketCredentialsError):
        raise
    except FileNotFoundError:
        refuse_missing_bucket(location)
        raise
    except Exception as error:
        if _no_credentials(error):
            raise BucketCredentialsError(
                f"{location}: no AWS credentials were found ({type(error).__name__}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials, or run where an instance role gives "
                "them"
            ) from None
        if not did_not_answer(error):
            raise
        if isinstance(error, TimeoutError) and not str(error):
            cause = f"no answer within {request_timeout_seconds():g} s"
        else:
            cause = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        raise BucketUnreachableError(f"{location}: the bucket's server did not answer ({cause})") from error


_BUCKETS_FOUND: set[str] = set()  # "gs://name" of buckets seen to exist: looked up once a process


def _bucket_missing(location: str) -> bool:
    """Whether the bucket of `location` does not exist (one look-up of the bucket, until one answered; False where the
    look-up fails)."""
    bucket = "/".join(location.split("/", 3)[:3])
    if bucket in _BUCKETS_FOUND:
        return False
    filesystem = client_for(location)
    try:
        if location.startswith("gs://"):
            filesystem.call("GET", "b/{}", bucket.removeprefix("gs://"))
        else:
            filesystem.call_s3("head_bucket", Bucket=bucket.removeprefix("s3://"))
    except FileNotFoundError:
        return True
    except Exception as error:
        if did_not_answer(error) or _no_credentials(error):
            return False  # not known: asked again next time
    _BUCKETS_FOUND.add(bucket)  # there, or not ours to look up (403): the object's own error says the rest
    return False


def refuse_missing_bucket(location: str) -> None:
    """Raises BucketNotFoundError, naming the bucket, if the bucket of `location` does not exist."""
    if _bucket_missing(location):
        bucket = "/".join(location.split("/", 3)[:3])
        raise BucketNotFoundError(
            f"{bucket}: no such bucket (needed for {location}); create it, or correct the bucket's name"
        )


def _no_credentials(error: BaseException) -> bool:
    """Whether an error of s3fs (botocore) says that no AWS credentials, or only some of them, were found."""
    botocore_errors = sys.modules.get("botocore.exceptions")
    return botocore_errors is not None and isinstance(
        error, botocore_errors.NoCredentialsError | botocore_errors.PartialCredentialsError
    )


def did_not_answer(error: BaseException) -> bool:
    """Whether an error of gcsfs, s3fs or the HTTP clients below them says that the server did not answer (refused
    or dropped connections, timeouts, server errors left after the client's own retries), not what it answered."""
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(error, aiohttp.ClientConnectionError):
        return True
    botocore_errors = sys.modules.get("botocore.exceptions")
    if botocore_errors is not None and isinstance(
        error, botocore_errors.ConnectionError | botocore_errors.HTTPClientError
    ):
        return True
    gcsfs_retry = sys.modules.get("gcsfs.retry")
    if gcsfs_retry is not None and isinstance(error, gcsfs_retry.HttpError):
        return error.code in gcsfs_retry.errs  # 5xx, 408 and 429: what gcsfs retries
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("InternalError", "ServiceUnavailable", "SlowDown")


def gcs_emulator_url() -> str | None:
    """The GCS emulator's URL from STORAGE_EMULATOR_HOST (a bare host:port means http), or None for real GCS."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):  # gcsfs and google-cloud-storage read "default" as unset too
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def share_gcs_emulator() -> str | None:
    """Points the other GCS clients of this process and its children at the emulator STORAGE_EMULATOR_HOST names, if
    any (variables the user set already are kept); returns its URL.

    - tensorstore, which orbax writes arrays through, reads only TENSORSTORE_GCS_HTTP_URL.
    - gcsfs's default class (ExtendedGcsFileSystem) asks GCS's Storage Control API, over gRPC with TLS, whether a
      bucket is hierarchical or zonal before it opens, writes or lists there. Emulators serve the JSON API only, so
      each lookup fails after 60 s of retries and, its UNKNOWN answer not being cached, is made again on the next
      call. GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false makes gcsfs offer its JSON-API-only class instead; gcsfs reads it
      once, when first imported (fsspec imports it at the first gs:// filesystem, e.g. orbax's through etils.epath).
    """
    url = gcs_emulator_url()
    if url is not None:
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return url


def client_for(location: str):
    """The fsspec filesystem for a gs:// or s3:// location, configured from the environment as it is now."""
    if location.startswith("gs://"):
        return _gcs_filesystem(share_gcs_emulator(), deadline_seconds())
    return _s3_filesystem(os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL"), deadline_seconds())


async def _within_deadline(
    filesystem, attempt: Callable, retriable: Callable[[BaseException], bool], tries: int | None = None
):
    """`await attempt()`, tried again after an error `retriable` accepts (backing off 1, 2, 4, 8 s, with jitter) while
    another try can still end within the deadline (and, given `tries`, at most that many times); tried once only while
    the server is taken for down (`filesystem.gave_up_at`: an operation gave up on it, and none was answered since).
    Any answer clears that mark; giving up sets it."""
    deadline, timeout = deadline_seconds(), request_timeout_seconds()
    began, delay, tried = time.monotonic(), 1.0, 0
    while True:
        tried += 1
        try:
            result = await attempt()
        except Exception as error:
            if not retriable(error):  # an answer: "not found", "precondition failed", ...
                filesystem.gave_up_at = None
                raise
            out_of_time = time.monotonic() - began + delay + timeout > deadline
            if filesystem.gave_up_at is not None or out_of_time or (tries is not None and tried >= tries):
                filesystem.gave_up_at = filesystem.gave_up_at or time.monotonic()
                raise
        else:
            filesystem.gave_up_at = None
            return result
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(2 * delay, 8.0)


def _gcs_retriable(error: BaseException) -> bool:
    """What gcsfs's own retries retry (connection errors, timeouts, 408, 429 and 5xx answers), but "not found"."""
    from gcsfs import retry

    if getattr(error, "status", None) == 404 or getattr(error, "code", None) == 404:
        return False
    return isinstance(error, asyncio.TimeoutError) or retry.is_retriable(error)


def _aws_max_attempts() -> int | None:
    """AWS_MAX_ATTEMPTS, the tries (the first included) the user allows a request to S3, if set to a number."""
    text = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return max(1, int(text)) if text.strip().isdigit() else None


def _without_expect_continue(params: dict, **kwargs) -> None:
    """botocore's before-call hook: the request goes without "Expect: 100-continue" (`_s3_filesystem` says why)."""
    params.get("headers", {}).pop("Expect", None)


def _s3_retriable(error: BaseException) -> bool:
    """Connection errors, timeouts, 5xx answers and S3's throttling ("SlowDown"), as s3fs and botocore see them."""
    if did_not_answer(error):
        return True
    response = getattr(error, "response", None) or getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("Throttling", "ThrottlingException", "RequestTimeout")


@functools.cache
def _client_bounds(timeout: float) -> None:
    """Gives the clients lmzoo does not make itself the same request timeouts (variables and settings the user gave
    are kept): orbax's (through etils.epath's fsspec filesystems: directories, commit files) and tensorstore's (the
    arrays; its curl transport reads these variables once, when it first sends a request). Their retries are their
    own; lmzoo.checkpoint bounds its waits on them."""
    import aiohttp
    import fsspec.config

    seconds = max(1, round(timeout))
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", str(seconds))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(seconds))
    fsspec.config.conf.setdefault("gcs", {}).setdefault(
        "requests_timeout", aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
    )
    s3_config = fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {})
    s3_config.setdefault("connect_timeout", timeout)
    s3_config.setdefault("read_timeout", timeout)


def bound_other_clients() -> None:
    _client_bounds(request_timeout_seconds())


class _DropGcsfsRetryReports(logging.Filter):
    """Drops gcsfs's report of an error its retries end on: it logs it with its traceback and then raises it, and the
    caller reports the raised error itself (`lmzoo.storage`, as BucketUnreachableError in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != "retry_request" or record.levelno < logging.ERROR


@functools.cache
def _gcs_filesystem(emulator_url: str | None, deadline: float):
    """Keyed by the emulator and the deadline, so that a changed environment gets a new client."""
    if emulator_url is None:
        from gcsfs import GCSFileSystem
    else:
        # The JSON-API-only class by name, also where gcsfs was imported before the switch above could take effect.
        from gcsfs.core import GCSFileSystem
    import aiohttp

    logging.getLogger("gcsfs").addFilter(_DropGcsfsRetryReports())
    # One try of a request: gcsfs's `_request` without its retry decorator (6 tries, 31 s of sleeps, no deadline).
    single_request = getattr(GCSFileSystem._request, "__wrapped__", GCSFileSystem._request)

    class PooledGcsFileSystem(GCSFileSystem):
        """gcsfs with a connection pool of CONCURRENT_REQUESTS (an aiohttp connector is made inside the loop) and
        requests within the deadline (`_within_deadline`)."""

        gave_up_at: float | None = None

        async def _set_session(self):
            if self._session is None and "connector" not in self.session_kwargs and not self._use_client_cert:
                self.session_kwargs = {
                    **self.session_kwargs,
                    "connector": aiohttp.TCPConnector(limit=CONCURRENT_REQUESTS),
                }
            return await super()._set_session()

        async def _request(self, method, path, *args, **kwargs):
            return await _within_deadline(
                self, lambda: single_request(self, method, path, *args, **kwargs), _gcs_retriable
            )

    timeout = _request_timeout(deadline)
    # No cached listings: another process or host may have written since (a lock, a checkpoint, a shard).
    return PooledGcsFileSystem(
        endpoint_url=emulator_url,
        use_listings_cache=False,
        skip_instance_cache=True,
        requests_timeout=aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout),
    )


@functools.cache
def _s3_filesystem(s3_endpoint_url: str | None, endpoint_url: str | None, deadline: float):
    """Keyed by the endpoint variables and the deadline only so that a changed environment gets a new client: botocore
    reads the endpoint itself (AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL, then the ~/.aws config), as the aws command
    does."""
    import s3fs

    class DeadlineS3FileSystem(s3fs.S3FileSystem):
        """s3fs whose calls are tried within the deadline (`_within_deadline`; at most AWS_MAX_ATTEMPTS times where it
        is set) instead of s3fs's 5 tries of botocore's 5 (each up to its read timeout, 15 s: minutes against a server
        that stopped answering)."""

        gave_up_at: float | None = None
        retries = 1  # s3fs's own: one try; botocore's: one (below)

        async def _call_s3(self, method, *akwarglist, **kwargs):
            return await _within_deadline(
                self,
                lambda: s3fs.S3FileSystem._call_s3(self, method, *akwarglist, **kwargs),
                _s3_retriable,
                _aws_max_attempts(),
            )

        async def set_session(self, refresh=False, kwargs={}):  # noqa: B006 (s3fs's signature)
            client = await super().set_session(refresh=refresh, kwargs=kwargs)
            if not getattr(client, "_lmzoo_without_continue", False):
                # botocore sends a body read from a stream after "Expect: 100-continue", and aiohttp waits for the
                # "100 Continue" with no timeout: a server that stopped answering would hold the upload forever.
                client.meta.events.register_last("before-call.s3", _without_expect_continue)
                client._lmzoo_without_continue = True
            return client

    timeout = _request_timeout(deadline)
    config = {
        "max_pool_connections": CONCURRENT_REQUESTS,
        "connect_timeout": timeout,
        "read_timeout": timeout,
        "retries": {"mode": "standard", "total_max_attempts": 1},
    }
    return DeadlineS3FileSystem(use_listings_cache=False, skip_instance_cache=True, config_kwargs=config)
