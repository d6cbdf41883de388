"""The throttled file system: latency per request, a shared bandwidth cap, any target file system."""

from __future__ import annotations

import threading
import time

import fsspec
import pytest

from kspeed.testing.throttle import Bucket, SlowFileSystem, ThrottledFileSystem


def test_each_request_waits_its_latency_and_requests_in_flight_overlap(tmp_path):
    for i in range(8):
        (tmp_path / f"{i}.bin").write_bytes(b"x" * 100)
    fs = SlowFileSystem(latency=0.05, list_latency=0.02, skip_instance_cache=True)
    started = time.monotonic()
    assert fs.info(str(tmp_path / "0.bin"))["size"] == 100
    assert 0.02 <= time.monotonic() - started < 0.05  # a listing request waits its own latency
    started = time.monotonic()
    with fs.open(str(tmp_path / "0.bin"), "rb") as f:
        assert f.read() == b"x" * 100
    assert time.monotonic() - started >= 0.05
    threads = [threading.Thread(target=lambda i=i: fs.cat_file(str(tmp_path / f"{i}.bin"))) for i in range(8)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 8 * 0.05  # eight at once took less than eight in a row
    assert fs.requests == 10 and fs.bytes_read == 900


def test_the_ranged_reads_of_one_call_are_in_flight_together(tmp_path):
    for i in range(8):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * 100)
    fs = SlowFileSystem(latency=0.05, skip_instance_cache=True)
    paths = [str(tmp_path / f"{i}.bin") for i in range(8)] + [str(tmp_path / "missing.bin")]
    started = time.monotonic()
    got = fs.cat_ranges(paths, [10] * 9, [20] * 9)
    assert 0.05 <= time.monotonic() - started < 2 * 0.05  # one latency for the nine
    assert got[:8] == [bytes([i]) * 10 for i in range(8)] and isinstance(got[8], FileNotFoundError)
    assert fs.requests == 9 and fs.bytes_read == 80


def test_reads_that_arrive_in_a_pause_of_the_store_wait_until_it_ends(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"z" * 10)
    fs = SlowFileSystem(latency=0.01, pause_every=0.5, pause=0.2, skip_instance_cache=True)
    started = time.monotonic()  # (the first pause starts when the file system is made)
    assert fs.cat_file(str(tmp_path / "a.bin")) == b"z" * 10
    assert time.monotonic() - started >= 0.2 + 0.01  # in the pause: its end, then the latency
    time.sleep(max(0.0, 0.3 - (time.monotonic() - started)))
    between = time.monotonic()
    fs.cat_file(str(tmp_path / "a.bin"))
    assert time.monotonic() - between < 0.15  # between pauses: the latency alone
    fs.info(str(tmp_path / "a.bin"))  # listing requests are not paused (they take list_latency)
    with pytest.raises(ValueError, match="shorter than its period"):
        SlowFileSystem(pause_every=0.1, pause=0.1, skip_instance_cache=True)


def test_the_bandwidth_cap_holds_over_every_reader_together(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"y" * 200_000)
    fs = SlowFileSystem(latency=0, bandwidth=1_000_000, skip_instance_cache=True)  # 1 MB/s

    def read() -> None:
        buf = bytearray(200_000)
        with fs.open(str(tmp_path / "a.bin"), "rb") as f:
            assert f.readinto(buf) == 200_000

    started = time.monotonic()
    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.55  # 600 kB at 1 MB/s, however many readers
    assert fs.bytes_read == 600_000


def test_it_wraps_any_protocol_and_is_read_only():
    mem = fsspec.filesystem("memory")
    mem.pipe("/bucket/k/1.bin", b"abc")
    fs = ThrottledFileSystem(latency=0, target_protocol="memory", skip_instance_cache=True)
    assert fs.cat_file("/bucket/k/1.bin") == b"abc" and fs.info("/bucket/k/1.bin")["size"] == 3
    assert [p.rsplit("/", 1)[-1] for p in fs.find("/bucket")] == ["1.bin"]
    with pytest.raises(PermissionError, match="read-only"):
        fs.open("/bucket/k/2.bin", "wb")
    # through fsspec's URL form, with the options a server's configuration gives
    opened = fsspec.filesystem("throttled", latency=0, target_protocol="memory")
    assert opened._strip_protocol("throttled:///bucket/k/1.bin") == "/bucket/k/1.bin"


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="bandwidth -1"):
        Bucket(-1)
    with pytest.raises(ValueError, match=r"latency -0\.1 and list_latency 0"):
        SlowFileSystem(latency=-0.1, skip_instance_cache=True)
