"""The object-store layer against a real S3-compatible server on loopback (moto), with faults from a proxy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint.checksum import digest_of
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore, ObjectURL
from lightning_mlopt.exceptions import ConcurrentWriterError, ObjectStoreError
from tests.support.s3_server import SECRET_KEY, FaultyProxy, MotoServer, free_port

MiB = 2**20
ATTEMPTS = 3  # botocore's back-off doubles: 3 attempts keep each failing test to seconds


def _store(bucket: str, prefix: str = "runs/a", **kwargs) -> ObjectStore:
    return ObjectStore.for_url(f"s3://{bucket}/{prefix}", max_attempts=ATTEMPTS, **kwargs)


def _random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_urls_parse_and_anything_else_is_refused():
    assert ObjectURL.parse("s3://b").key("latest") == "latest"
    assert str(ObjectURL.parse("s3://b/x/y/").child("step-1")) == "s3://b/x/y/step-1"
    for bad in ("gs://b/x", "s3://", "/local/path"):
        with pytest.raises(ValueError, match="expected s3://bucket/prefix"):
            ObjectURL.parse(bad)


def test_a_create_only_write_and_a_stale_compare_and_swap_are_refused(s3_bucket):
    store = _store(s3_bucket)
    first = store.put_bytes("latest", b"step-1", create_only=True)
    with pytest.raises(ConcurrentWriterError, match=r"latest: write failed: another writer changed it first"):
        store.put_bytes("latest", b"step-2", create_only=True)
    second = store.put_bytes("latest", b"step-2", if_match=first)
    with pytest.raises(ConcurrentWriterError):
        store.put_bytes("latest", b"step-3", if_match=first)  # the ETag it read is stale
    assert store.get_bytes("latest") == (b"step-2", second)
    assert store.get_bytes("missing") is None


@pytest.mark.slow
def test_a_multipart_upload_and_a_ranged_download_checksum_the_bytes_they_move(s3_bucket, tmp_path):
    store = _store(s3_bucket, part_bytes=5 * MiB, concurrency=3)
    source = _random_file(tmp_path / "state.ckpt", 17 * MiB + 123)  # 4 parts, the last one short
    uploaded = store.upload_file(source, "step-000000001/state.ckpt")
    assert (uploaded.size, uploaded.digest) == (source.stat().st_size, digest_of(source))
    copy = tmp_path / "copy" / "state.ckpt"
    downloaded = store.download_file("step-000000001/state.ckpt", copy)
    assert downloaded == uploaded
    assert copy.read_bytes() == source.read_bytes()
    assert store.list_keys() == ["step-000000001/state.ckpt"]
    # The parts were sent with CRC32s the store checked, and it kept their composite (as boto3's own uploads).
    head = store.client.head_object(Bucket=s3_bucket, Key="runs/a/step-000000001/state.ckpt", ChecksumMode="ENABLED")
    assert "ChecksumCRC32" in head and "ChecksumCRC64NVME" not in head, head  # not a full-object CRC64


def test_a_store_without_checksums_gets_an_upload_that_declares_none(s3_bucket, tmp_path, monkeypatch):
    # What a user of an S3-compatible store that lacks them configures (botocore reads it when the client is made).
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    store = _store(s3_bucket, part_bytes=5 * MiB, concurrency=2)
    source = _random_file(tmp_path / "state.ckpt", 11 * MiB)
    assert store.upload_file(source, "state.ckpt").digest == digest_of(source)
    head = store.client.head_object(Bucket=s3_bucket, Key="runs/a/state.ckpt", ChecksumMode="ENABLED")
    assert "ChecksumCRC32" not in head, head


@pytest.mark.slow
def test_an_upload_whose_connection_drops_mid_way_is_aborted_and_leaves_no_object(
    moto_server, s3_bucket, tmp_path, monkeypatch
):
    source = _random_file(tmp_path / "state.ckpt", 12 * MiB)
    # Part 2 never gets an answer, on every attempt: the connection is closed under it.
    with FaultyProxy(moto_server.port, fail=lambda request: request.part_number == 2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = _store(s3_bucket, part_bytes=5 * MiB, concurrency=2)
        with pytest.raises(ObjectStoreError) as failure:
            store.upload_file(source, "step-000000001/state.ckpt")
    message = str(failure.value)
    assert message.startswith(f"s3://{s3_bucket}/runs/a/step-000000001/state.ckpt: upload failed: ")
    assert "\n" not in message and SECRET_KEY not in message
    assert proxy.failed == ATTEMPTS  # bounded retries, then it gave up
    behind = moto_server.client()
    assert behind.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0  # no partial object
    assert behind.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []  # aborted


@pytest.mark.slow
def test_throttling_is_retried_with_back_off_then_reported_in_one_line(moto_server, s3_bucket, monkeypatch):
    calls = []

    def throttle_the_first(request) -> bool:
        calls.append(time.monotonic())
        return len(calls) == 1

    with FaultyProxy(moto_server.port, fail=throttle_the_first, how="slowdown") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = _store(s3_bucket)
        store.put_bytes("k", b"v")  # a 503 SlowDown answer, then it went through
        assert proxy.failed == 1
        assert calls[1] - calls[0] > 0.01  # it backed off between the attempts
        proxy.fail = lambda request: True
        with pytest.raises(ObjectStoreError, match=rf"k: write failed: throttled by the service \({ATTEMPTS} attempts"):
            store.put_bytes("k", b"w")
    assert moto_server.client().get_object(Bucket=s3_bucket, Key="runs/a/k")["Body"].read() == b"v"


@pytest.mark.slow
def test_an_unreachable_endpoint_a_missing_bucket_and_no_credentials_each_end_in_one_line(
    moto_server, s3_bucket, monkeypatch
):
    started = time.monotonic()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(
        ObjectStoreError, match=r"write failed: cannot reach http://127.0.0.1:\d+ \(check AWS_ENDPOINT_URL"
    ):
        _store(s3_bucket).put_bytes("k", b"v")
    assert time.monotonic() - started < 10
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)

    with pytest.raises(ObjectStoreError, match="s3://no-such-bucket/runs/a: list failed: the bucket does not exist"):
        _store("no-such-bucket").check_access()

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ObjectStoreError, match="write failed: no AWS credentials found") as failure:
        _store(s3_bucket).put_bytes("k", b"v")
    assert "\n" not in str(failure.value)


@pytest.mark.slow
def test_stale_multipart_uploads_are_aborted_and_deletes_go_in_batches(moto_server, s3_bucket):
    client = moto_server.client()
    client.create_multipart_upload(Bucket=s3_bucket, Key="runs/a/step-000000003/data/state.ckpt")  # a killed save
    store = _store(s3_bucket)
    assert store.abort_uploads() == 1
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    keys = [f"step-000000001/f{i}" for i in range(5)]
    for key in keys:
        store.put_bytes(key, b"x")
    store.delete_keys([*keys, "already-gone"])
    assert store.list_keys() == []


@pytest.mark.slow
def test_refused_credentials_end_in_one_line_that_holds_no_secret(monkeypatch):
    with MotoServer(check_credentials=True) as server:  # refuses keys it does not know, as S3 does
        for variable, value in server.environment().items():
            monkeypatch.setenv(variable, value)
        with pytest.raises(ObjectStoreError) as failure:
            _store("ckpt").put_bytes("latest", b"step-000000001")
    message = str(failure.value)
    assert (
        message
        == "s3://ckpt/runs/a/latest: write failed: the access key was refused: check AWS_ACCESS_KEY_ID / the profile"
    )
    assert SECRET_KEY not in message
