"""boto3 as checkpoints use it: a client with bounded retries, and its failures as one line each.

The client takes the standard AWS configuration (bounded retries, short timeouts); a failure becomes one
line a user can act on, naming the URL and the cause, never holding a credential.

boto3 is imported inside the functions: only runs that use an object store pay for it.

Example::

    client = make_client(concurrency=10)
    try:
        client.put_object(Bucket="ckpt", Key="runs/a/latest", Body=b"step-000000100")
    except Exception as error:
        raise translate_error(error, "s3://ckpt/runs/a/latest", "write") from None
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from lightning_mlopt.exceptions import ConcurrentWriterError, MissingObjectError, ObjectStoreError, first_line

MAX_ATTEMPTS = 6  # per request, the first included; botocore backs off exponentially with jitter between them
CONNECT_TIMEOUT_S = 5.0  # an unreachable endpoint fails in seconds, not minutes
READ_TIMEOUT_S = 60.0


def make_client(concurrency: int, max_attempts: int = MAX_ATTEMPTS) -> Any:
    """A boto3 S3 client from the standard AWS configuration, with bounded retries and short timeouts."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        max_pool_connections=2 * concurrency,  # an upload's parts and a download's ranges at once
    )
    return boto3.session.Session().client("s3", config=config)


# What each S3 error code means for the user, and what to do about it.
_CAUSES = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix the bucket in the URL",
    "AccessDenied": "access denied: the credentials lack permission for this bucket or prefix",
    "InvalidAccessKeyId": "the access key was refused: check AWS_ACCESS_KEY_ID / the profile",
    "SignatureDoesNotMatch": "the secret key was refused: check AWS_SECRET_ACCESS_KEY / the profile",
    "ExpiredToken": "the session token has expired: renew the credentials",
    "SlowDown": "throttled by the service ({attempts} attempts with back-off)",
    "ServiceUnavailable": "the service is unavailable ({attempts} attempts with back-off)",
    "InternalError": "the service failed ({attempts} attempts with back-off)",
}
_PRECONDITION_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


def translate_error(error: BaseException, url: str, what: str, attempts: int = MAX_ATTEMPTS) -> ObjectStoreError:
    """One line for a failed request: ``s3://bucket/key: <what> failed: <cause>``, never a credential.

    Example::

        >>> from botocore.exceptions import NoCredentialsError
        >>> str(translate_error(NoCredentialsError(), "s3://ckpt/run/latest", "write"))
        's3://ckpt/run/latest: write failed: no AWS credentials found (set AWS_ACCESS_KEY_ID and ...'
    """
    from botocore import exceptions as boto

    if isinstance(error, ObjectStoreError):
        return error
    if isinstance(error, boto.ClientError):
        code = str(error.response.get("Error", {}).get("Code", "")) or str(
            error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        )
        if code in _PRECONDITION_CODES:
            return ConcurrentWriterError(f"{url}: {what} failed: another writer changed it first (PreconditionFailed)")
        if code in _MISSING_CODES:
            return MissingObjectError(f"{url}: no such object")
        cause = _CAUSES.get(code, f"the service answered {code or 'an error'}").format(attempts=attempts)
        return ObjectStoreError(f"{url}: {what} failed: {cause}")
    if isinstance(error, (boto.NoCredentialsError, boto.PartialCredentialsError)):
        cause = (
            "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an "
            "instance role applies)"
        )
        return ObjectStoreError(f"{url}: {what} failed: {cause}")
    if isinstance(error, boto.ReadTimeoutError):
        return ObjectStoreError(f"{url}: {what} failed: the endpoint stopped answering ({READ_TIMEOUT_S:.0f} s)")
    if isinstance(error, boto.ConnectionClosedError):
        return ObjectStoreError(
            f"{url}: {what} failed: {_endpoint(error)} closed the connection before answering ({attempts} attempts)"
        )
    if isinstance(error, boto.ConnectionError):
        endpoint = _endpoint(error)
        return ObjectStoreError(
            f"{url}: {what} failed: cannot reach {endpoint} (check AWS_ENDPOINT_URL and the network)"
        )
    return ObjectStoreError(f"{url}: {what} failed: {type(error).__name__}: {first_line(error, 200)}")


def _endpoint(error: BaseException) -> str:
    """``scheme://host:port`` of the request that failed (botocore's message names the whole object URL)."""
    address = urllib.parse.urlsplit(getattr(error, "kwargs", {}).get("endpoint_url") or "")
    return f"{address.scheme}://{address.netloc}" if address.netloc else "the endpoint"
