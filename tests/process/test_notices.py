"""Cloud preemption notices, polled from a metadata server on loopback that speaks the AWS (IMDSv2 token
included) and GCE protocols (tests/support/metadata_server.py), and raised as the preemption flag with the notice's
deadline."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator

import pytest

from lightning_mlopt.process import notices
from lightning_mlopt.process.notices import NoticePoller, PreemptionNotices, providers_for
from lightning_mlopt.process.signals import PreemptionSignals
from tests.support.metadata_server import FakeMetadataServer


@pytest.fixture
def metadata() -> Iterator[FakeMetadataServer]:
    with FakeMetadataServer() as server:
        yield server


def test_an_aws_spot_notice_is_found_with_its_deadline_and_one_token(metadata):
    poller = NoticePoller(["aws"], lambda *_: None, env=metadata.environment())
    assert poller.poll_once() is None and poller.poll_once() is None  # 404: no notice yet
    metadata.post_aws_notice(seconds_from_now=110)
    description, seconds_left = poller.poll_once()
    assert "AWS spot notice (terminate" in description
    assert 105 <= seconds_left <= 111
    assert metadata.tokens_issued == 1 and metadata.requests_without_token == 0  # the token is reused


def test_gce_preemption_and_maintenance_notices(metadata):
    poller = NoticePoller(["gce"], lambda *_: None, env=metadata.environment())
    assert poller.poll_once() is None
    metadata.gce_maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
    assert poller.poll_once() == ("a GCE maintenance notice (TERMINATE_ON_HOST_MAINTENANCE)", 60.0)
    metadata.gce_preempted = "TRUE"
    assert poller.poll_once() == ("a GCE preemption notice", 30.0)


def test_a_notice_raises_the_preemption_flag_with_its_deadline_as_the_grace(metadata):
    flag = PreemptionSignals()
    flag.install(["SIGUSR2"], deadline_s=120.0, graces={"*": 300.0})
    try:
        poller = NoticePoller(["aws", "gce"], flag.notify, interval_s=0.1, env=metadata.environment()).start()
        time.sleep(0.3)
        assert flag.received() is None
        metadata.post_aws_notice(seconds_from_now=40, action="stop")
        deadline = time.monotonic() + 10
        while flag.received() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        poller.stop()
        assert flag.received() == signal.SIGTERM and "AWS spot notice" in flag.describe()
        assert 30 <= flag.seconds_left() <= 40  # the notice's 40 s, not the 300 s grace
        assert flag.current_deadline_s() <= 40  # the last resort sits below it
    finally:
        flag.release()  # a notice is not a signal: nothing is delivered again


def test_an_endpoint_that_does_not_answer_costs_one_timeout_and_no_error():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again: nothing listens there
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}", "GCE_METADATA_HOST": f"127.0.0.1:{port}"}
    poller = NoticePoller(["aws", "gce"], lambda *_: None, timeout_s=0.5, env=env)
    started = time.monotonic()
    assert poller.poll_once() is None
    assert time.monotonic() - started < 3


def test_auto_polls_only_the_cloud_this_vm_belongs_to(tmp_path, monkeypatch):
    monkeypatch.setattr(notices, "_DMI", tmp_path)  # an on-premises machine: no cloud vendor
    assert providers_for("auto", env={}) == []
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    assert providers_for("auto", env={}) == ["aws"]
    assert providers_for("auto", env={"GCE_METADATA_HOST": "x"}) == ["aws", "gce"]
    assert providers_for("off") == [] and providers_for(["gce"]) == ["gce"]
    with pytest.raises(ValueError, match=r"unknown provider\(s\) \['azure'\]"):
        PreemptionNotices(notices=["azure"])
