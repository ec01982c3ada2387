"""An S3-compatible object store, as checkpoints need it: parallel checksummed transfers and conditional writes.

S3 has no rename, so a commit cannot be "write aside, then rename into place". It has conditional writes
instead: ``If-None-Match: *`` creates an object only if none exists (the commit of a checkpoint), and
``If-Match: <ETag>`` replaces one only if nobody changed it since it was read (moving ``latest``). This module
is the thin layer over boto3 that the remote tier (``remote.py``) builds its commit protocol on:

- transfers that checksum the bytes as they stream (the manifest's algorithm), in parallel parts; a
  multipart upload that fails is aborted, so a partial object is never taken for a checkpoint;
- the standard AWS configuration, as boto3 reads it: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
  ``AWS_PROFILE``, an instance role, and ``AWS_ENDPOINT_URL`` (``AWS_ENDPOINT_URL_S3``) for MinIO, Ceph,
  CoreWeave or GCS's S3 API;
- bounded retries with back-off (botocore's ``standard`` mode: throttling and transient errors), short
  connection timeouts, and every failure as one :class:`ObjectStoreError` line naming the URL and the cause,
  never a credential.

Example::

    store = ObjectStore.for_url("s3://ckpt/runs/gpt")
    entry = store.upload_file(Path("state.ckpt"), "step-000000100/state.ckpt")   # FileEntry(size, digest)
    etag = store.put_bytes("step-000000100/manifest.json", data, create_only=True)  # the commit
    store.download_file("step-000000100/state.ckpt", Path("/tmp/state.ckpt"))
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lightning_mlopt.checkpoint.checksum import DEFAULT_ALGORITHM, new_hasher
from lightning_mlopt.checkpoint.manifest import FileEntry
from lightning_mlopt.checkpoint.remote.s3_client import MAX_ATTEMPTS, make_client, translate_error
from lightning_mlopt.exceptions import MissingObjectError, ObjectStoreError

SCHEMES = ("s3",)
PART_BYTES = 8 * 2**20  # boto3's own multipart chunk size and threshold
CONCURRENCY = 10  # boto3's own max_concurrency

_T = TypeVar("_T")


@dataclass(frozen=True)
class ObjectURL:
    """``s3://bucket/prefix``: where a run's checkpoints live in an object store.

    Example::

        >>> url = ObjectURL.parse("s3://ckpt/runs/gpt/")
        >>> url.bucket, url.prefix, url.key("latest"), str(url)
        ('ckpt', 'runs/gpt', 'runs/gpt/latest', 's3://ckpt/runs/gpt')
    """

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, text: str) -> ObjectURL:
        """Parse ``s3://bucket[/prefix]``; ValueError naming the problem otherwise."""
        scheme, separator, rest = text.partition("://")
        if not separator or scheme not in SCHEMES:
            raise ValueError(f"{text!r} is not an object-store URL; expected s3://bucket/prefix")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{text!r} names no bucket; expected s3://bucket/prefix")
        return cls(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        """The object key of ``name`` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> ObjectURL:
        """The URL of ``name`` under this one."""
        return ObjectURL(self.bucket, self.key(name))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_object_url(text: str) -> bool:
    """Whether ``text`` names an object store this package writes to (``s3://...``)."""
    return any(text.startswith(f"{scheme}://") for scheme in SCHEMES)


def store_url(dirpath: str | None) -> str | None:
    """``dirpath`` when it names an object store (``s3://...``), else None.

    Example::

        >>> store_url("s3://ckpt/run"), store_url("/shared/ckpt"), store_url(None)
        ('s3://ckpt/run', None, None)
    """
    return dirpath if dirpath is not None and is_object_url(dirpath) else None


class ObjectStore:
    """The objects under one ``s3://bucket/prefix``; keys given to its methods are relative to the prefix.

    Args:
        url: the bucket and prefix.
        client: a boto3 S3 client (default: one from the standard AWS configuration, see :func:`make_client`).
        part_bytes: the size of a transfer's parts (>= 5 MiB, S3's minimum for all but the last).
        concurrency: parts in flight at once, per transfer.
        max_attempts: tries per request, the first included, with exponential back-off between them.

    """

    def __init__(
        self,
        url: ObjectURL,
        client: Any = None,
        part_bytes: int = PART_BYTES,
        concurrency: int = CONCURRENCY,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.url = url
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self._client = client
        self._client_lock = threading.Lock()

    @classmethod
    def for_url(cls, text: str, **kwargs: Any) -> ObjectStore:
        """The store of ``s3://bucket/prefix``."""
        return cls(ObjectURL.parse(text), **kwargs)

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use (boto3 is imported only by runs that use an object store)."""
        with self._client_lock:
            if self._client is None:
                self._client = make_client(self.concurrency, self.max_attempts)
            return self._client

    # ------------------------------------------------------------------ small objects

    def put_bytes(self, key: str, data: bytes, create_only: bool = False, if_match: str | None = None) -> str:
        """Write one small object; return its ETag.

        ``create_only``: only if no object has the key (``If-None-Match: *``); ``if_match``: only if the
        object still has this ETag. Either condition failing raises :class:`ConcurrentWriterError`.
        """
        conditions: dict[str, str] = {}
        if create_only:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = if_match
        response = self._call(
            key,
            "write",
            lambda: self.client.put_object(Bucket=self.url.bucket, Key=self._key(key), Body=data, **conditions),
        )
        return str(response["ETag"])

    def get_bytes(self, key: str) -> tuple[bytes, str] | None:
        """One small object's bytes and ETag, or None when there is no such object."""
        try:
            response = self._call(
                key, "read", lambda: self.client.get_object(Bucket=self.url.bucket, Key=self._key(key))
            )
        except MissingObjectError:
            return None
        with response["Body"] as body:
            data = self._call(key, "read", body.read)
        return data, str(response["ETag"])

    def list_keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (relative to the store's prefix), sorted."""
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix`` (relative to the store's prefix) with its size in bytes."""
        sizes: dict[str, int] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        base = self._key(prefix)

        def pages() -> None:
            for page in paginator.paginate(Bucket=self.url.bucket, Prefix=base):
                sizes.update((self._relative(item["Key"]), int(item["Size"])) for item in page.get("Contents", []))

        self._call("", "list", pages)  # named by the store URL: a key prefix such as "step-" reads oddly
        return sizes

    def delete_keys(self, keys: list[str]) -> None:
        """Delete objects (a thousand per request, S3's limit); a key already gone is not an error."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(key)} for key in keys[start : start + 1000]]
            request = functools.partial(
                self.client.delete_objects, Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            response = self._call(keys[start], "delete", request)
            failed = response.get("Errors") or []
            if failed:
                raise ObjectStoreError(
                    f"{self.url.child(self._relative(failed[0]['Key']))}: delete refused ({failed[0].get('Code')})"
                )

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort the multipart uploads left under ``prefix`` by interrupted saves; return how many."""
        found = self._call(
            prefix,
            "list uploads",
            lambda: self.client.list_multipart_uploads(Bucket=self.url.bucket, Prefix=self._key(prefix)),
        )
        uploads = found.get("Uploads", [])
        for upload in uploads:
            self._abort(upload["Key"], upload["UploadId"])
        return len(uploads)

    def check_access(self) -> None:
        """One cheap request that fails the way a save would: missing bucket, refused credentials, no endpoint."""
        self._call(
            "", "list", lambda: self.client.list_objects_v2(Bucket=self.url.bucket, Prefix=self._key(""), MaxKeys=1)
        )

    # ------------------------------------------------------------------ files

    def upload_file(self, path: Path, key: str, algorithm: str = DEFAULT_ALGORITHM) -> FileEntry:
        """Upload a file, checksumming it as it is read once; parts go up in parallel.

        Returns the size and checksum of the bytes uploaded. A file above one part goes up as a multipart
        upload that is aborted on any failure: the object then does not exist, rather than existing partly.
        """
        size = path.stat().st_size
        hasher = new_hasher(algorithm)
        if size <= self.part_bytes:
            data = path.read_bytes()
            hasher.update(data)
            self._call(
                key, "upload", lambda: self.client.put_object(Bucket=self.url.bucket, Key=self._key(key), Body=data)
            )
            return FileEntry(len(data), hasher.hexdigest())
        checksum = self._part_checksum()
        created = self._call(
            key,
            "upload",
            lambda: self.client.create_multipart_upload(Bucket=self.url.bucket, Key=self._key(key), **checksum),
        )
        upload_id = created["UploadId"]
        try:
            parts = self._upload_parts(path, key, upload_id, hasher, checksum)
            self._call(
                key,
                "upload",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.url.bucket, Key=self._key(key), UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            self._abort(self._key(key), upload_id)
            raise
        return FileEntry(size, hasher.hexdigest())

    def _part_checksum(self) -> dict[str, str]:
        """``ChecksumAlgorithm=CRC32`` for a multipart upload, as boto3's transfer manager declares it.

        The store then checks each part against the CRC32 botocore sends with it and keeps a composite of the
        parts' checksums; without it, S3 (and moto) compute a full-object CRC64 at completion, which made our
        completion the slow half of an upload. Where the configuration asks for checksums only when required
        (``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``, for stores that lack them), none is declared.
        """
        if self.client.meta.config.request_checksum_calculation != "when_supported":
            return {}
        return {"ChecksumAlgorithm": "CRC32"}

    def _upload_parts(
        self, path: Path, key: str, upload_id: str, hasher: Any, checksum: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Read the file in order (checksumming it), with at most ``concurrency`` parts uploading at once."""

        def send(number: int, data: bytes) -> dict[str, Any]:
            response = self._call(
                key,
                "upload",
                lambda: self.client.upload_part(
                    Bucket=self.url.bucket,
                    Key=self._key(key),
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    **checksum,
                ),
            )
            part = {"ETag": response["ETag"], "PartNumber": number}
            if "ChecksumCRC32" in response:  # the completion must name each part's checksum when one was declared
                part["ChecksumCRC32"] = response["ChecksumCRC32"]
            return part

        parts: list[dict[str, Any]] = []
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-upload") as pool, path.open("rb") as handle:
            in_flight: deque[Future[dict[str, Any]]] = deque()
            number = 0
            try:
                while data := handle.read(self.part_bytes):
                    hasher.update(data)
                    number += 1
                    in_flight.append(pool.submit(send, number, data))
                    if len(in_flight) >= self.concurrency:  # bounded memory: concurrency parts at most
                        parts.append(in_flight.popleft().result())
                while in_flight:
                    parts.append(in_flight.popleft().result())
            finally:
                for future in in_flight:
                    future.cancel()
        return parts

    def download_file(self, key: str, path: Path, algorithm: str = DEFAULT_ALGORITHM) -> FileEntry:
        """Download an object into ``path``, checksumming it as it is written; ranges are fetched in parallel.

        Returns the size and checksum of what was written. The caller compares it with the manifest.
        """
        head = self._call(key, "read", lambda: self.client.head_object(Bucket=self.url.bucket, Key=self._key(key)))
        size = int(head["ContentLength"])
        hasher = new_hasher(algorithm)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            for data in self._ranges_in_order(key, size):
                hasher.update(data)
                handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return FileEntry(size, hasher.hexdigest())

    def _ranges_in_order(self, key: str, size: int) -> Iterator[bytes]:
        """The object's bytes, part by part in order, with up to ``concurrency`` ranged GETs ahead."""

        def fetch(start: int) -> bytes:
            end = min(start + self.part_bytes, size) - 1

            def get() -> bytes:
                response = self.client.get_object(
                    Bucket=self.url.bucket, Key=self._key(key), Range=f"bytes={start}-{end}"
                )
                with response["Body"] as body:
                    return bytes(body.read())

            data = self._call(key, "read", get)
            if len(data) != end - start + 1:
                raise ObjectStoreError(
                    f"{self.url.child(key)}: read {len(data)} bytes of a {end - start + 1}-byte range"
                )
            return data

        starts = iter(range(0, size, self.part_bytes))
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-download") as pool:
            ahead: deque[Future[bytes]] = deque(
                pool.submit(fetch, start) for start in itertools.islice(starts, self.concurrency)
            )
            try:
                while ahead:
                    data = ahead.popleft().result()
                    following = next(starts, None)  # one more in flight for the one taken
                    if following is not None:
                        ahead.append(pool.submit(fetch, following))
                    yield data
            finally:
                for future in ahead:
                    future.cancel()

    # ------------------------------------------------------------------ plumbing

    def _key(self, name: str) -> str:
        return self.url.key(name) if name else self.url.prefix

    def _relative(self, key: str) -> str:
        return key[len(self.url.prefix) + 1 :] if self.url.prefix else key

    def _abort(self, full_key: str, upload_id: str) -> None:
        # Best effort: what is left is never read, and the next run's abort_uploads() sweeps it.
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=full_key, UploadId=upload_id)

    def _call(self, key: str, what: str, request: Callable[[], _T]) -> _T:
        """Run one request (botocore retries it); any failure becomes one line naming the URL and the cause."""
        try:
            return request()
        except Exception as error:
            raise translate_error(
                error, str(self.url.child(key) if key else self.url), what, self.max_attempts
            ) from None
