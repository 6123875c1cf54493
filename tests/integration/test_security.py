"""A job with SNAPSHOTD_SECRET: every TCP socket is CurveZMQ, and a peer without the secret gets nothing."""

from __future__ import annotations

import uuid

import pytest
import torch
import zmq

from snapshotd import proto
from snapshotd.client import Snapshotter
from snapshotd.local_cluster import LocalCluster
from snapshotd.security import secure_client

pytestmark = pytest.mark.integration

SECRET = "correct horse battery staple"


def _ask(addr: str, secret: str | None, msg: proto.Message, timeout_ms: int = 1500) -> proto.Message | None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, secret)
        sock.connect(addr)
        sock.send_multipart(proto.encode(msg))
        if not sock.poll(timeout_ms):
            return None
        return proto.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)
        ctx.term()


def test_secret_job_streams_over_curve_and_refuses_outsiders(tmp_path) -> None:
    job = f"sec-{uuid.uuid4().hex[:6]}"
    with LocalCluster(str(tmp_path), env={"SNAPSHOTD_SECRET": SECRET}) as cluster:
        cluster.start_coordinator()
        cluster.start_sidecar("A")
        node_b = cluster.start_sidecar("B")
        w = torch.arange(4096, dtype=torch.float32)
        with Snapshotter({"w": w}, job=job, rank=0, world_size=1, sidecar=cluster.ipc_path("A"), timeout=10) as snap:
            assert snap.restore(timeout=20) == 0
            assert snap.capture(1) and snap.wait(10), snap.stats
        pull = proto.PullManifest(job=job, rank=0, step=1)
        reply = _ask(node_b.fields["data"], SECRET, pull)
        assert isinstance(reply, proto.StreamBegin) and reply.data_bytes == w.numel() * 4
        assert _ask(node_b.fields["data"], "a wrong secret", pull) is None
        assert _ask(node_b.fields["data"], None, pull) is None
        assert _ask(cluster.coordinator_addr, None, proto.StatusRequest()) is None
