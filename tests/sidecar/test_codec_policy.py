"""The codec policy: which chunks of a stream go as XOR deltas, and what measuring that costs.

Unit tests of :class:`~snapshotd.sidecar.transfer.CodecPolicy`, then streams between in-process sidecars: on a
link too fast for delta to pay, no chunk goes compressed (the probes only sample); on a slow one, the chunks go
as deltas and the buddy decodes and verifies every one. Compression speed is measured in the compressing
thread's CPU time, so a loaded machine does not change the choices.
"""

from __future__ import annotations

import math
import uuid

import pytest
import torch

from snapshotd.sidecar.transfer import CodecPolicy

from ..deployments import InProcess, snapshot_then_crash

CHUNK = 1 << 20


def _measured() -> CodecPolicy:
    """An auto policy that has probed once: a sample compressed to a tenth at 1 GB/s."""
    policy = CodecPolicy("auto")
    assert policy.choose(math.inf) == "probe"  # nothing measured yet
    policy.record_delta(CodecPolicy.PROBE_BYTES, CodecPolicy.PROBE_BYTES // 10, CodecPolicy.PROBE_BYTES / 1e9)
    return policy


def test_auto_probes_the_first_chunk_and_every_32nd_that_goes_raw() -> None:
    fast, slow = _measured(), _measured()
    fast_choices = [fast.choose(math.inf) for _ in range(2 * CodecPolicy.PROBE_EVERY)]
    probes = [i for i, how in enumerate(fast_choices) if how == "probe"]
    # counted from the first probe
    assert probes == [
        CodecPolicy.PROBE_EVERY - 2,
        2 * CodecPolicy.PROBE_EVERY - 2,
    ]
    assert set(fast_choices) == {"raw", "probe"}  # an unlimited link: compressing never finishes sooner
    # 10 MB/s: a tenth of the bytes at 1 GB/s of compression finishes sooner, and every delta chunk measures anew
    assert {slow.choose(10e6) for _ in range(2 * CodecPolicy.PROBE_EVERY)} == {"delta"}


def test_a_sample_is_probe_bytes_at_a_place_that_moves_through_the_chunk() -> None:
    policy = CodecPolicy("auto")
    size = CodecPolicy.PROBE_BYTES
    samples = [policy.sample(4 * size + 100) for _ in range(6)]
    assert samples == [
        (0, size),
        (size, 2 * size),
        (2 * size, 3 * size),
        (3 * size, 4 * size),
        (0, size),
        (size, 2 * size),
    ]
    assert policy.sample(1000) == (0, 1000)  # a chunk smaller than a sample: all of it


def test_fixed_modes_never_probe() -> None:
    raw, delta = CodecPolicy("raw"), CodecPolicy("delta-lz4")
    assert {raw.choose(1e3) for _ in range(100)} == {"raw"}
    assert {delta.choose(math.inf) for _ in range(100)} == {"delta"}


def _state(rank: int, step: int) -> dict:
    """4 MiB of float32 of which one page changes per step: XOR deltas against the step before compress well."""
    w = torch.arange(1 << 20, dtype=torch.float32) + rank
    w[: 1024 * step] += step
    return {"w": w, "loop": {"step": step}}


@pytest.fixture
def samples(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every probe's sample window, as the real :meth:`CodecPolicy.sample` gives it."""
    taken: list[tuple[int, int]] = []
    sample = CodecPolicy.sample

    def recording(self: CodecPolicy, nbytes: int) -> tuple[int, int]:
        taken.append(sample(self, nbytes))
        return taken[-1]

    monkeypatch.setattr(CodecPolicy, "sample", recording)
    return taken


def _chunks_sent(max_rate: float) -> dict[str, int]:
    """Stream 3 steps of two ranks between two in-process sidecars at ``max_rate``; the chunks A sent, by codec."""
    with InProcess(chunk_bytes=CHUNK, max_rate=max_rate) as dep:
        ipcs = {0: dep.start_sidecar("A"), 1: dep.start_sidecar("B")}
        # every step durable on its buddy
        snapshot_then_crash(ipcs, f"codec-{uuid.uuid4().hex[:6]}", 3, _state)
        return dict(dep.sidecars["A"].state.counters.chunks_sent)


def test_on_a_fast_link_every_chunk_goes_raw_though_it_would_compress(samples: list[tuple[int, int]]) -> None:
    sent = _chunks_sent(max_rate=1e12)
    assert sent == {"raw": 12, "delta-lz4": 0}  # 3 steps of 4 chunks of 1 MiB
    # each sidecar's policy (A's for B, B's for A) probed step 2's first chunk (the first with a base); the next
    # probe would be 32 chunks on
    assert samples == [(0, CodecPolicy.PROBE_BYTES)] * 2


def test_on_a_slow_link_chunks_go_as_deltas_and_the_buddy_verifies_them(
    samples: list[tuple[int, int]],
) -> None:
    sent = _chunks_sent(max_rate=40e6)
    # step 1 has no base; step 2's first chunk is the probe, and every later chunk goes as a delta
    assert sent == {"raw": 5, "delta-lz4": 7} and len(samples) == 2
