"""A dataset cached preprocessed: its listing as the cached stages leave the samples, reads through
the preprocessing workers, and a preload that stores them (no daemon)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from kspeed.control.logs import LogSettings
from kspeed.errors import PreprocessError, StateError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.preprocess.pipeline import HEADER
from kspeed.preprocess.runner import Runner
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.cached_source import CachedSource
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.checksum import crc32c
from kspeed.server.prep.workers import PrepWorkers

SIDE = 12
FIXED = Output(shape=(SIDE, SIDE, 3), dtype="uint8")


def jpeg(seed: int, height: int, width: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def pipeline(output: Output = FIXED) -> Pipeline:
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("resize", {"size": [SIDE, SIDE]}, output=output),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
        ]
    )


@pytest.fixture(scope="module")
def prep():
    """Two workers, shared by the module's tests (each takes a second or two to start)."""
    workers = PrepWorkers(2, (), LogSettings())
    yield workers
    workers.close()


@pytest.fixture
def images(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    for k in range(6):
        (root / f"{k}.jpg").write_bytes(jpeg(k, 20 + k, 30))
    return root


def test_the_listing_is_the_declared_output_and_a_read_runs_the_cached_stages(backend, images, prep):
    raw = open_source(backend, "imgs", str(images))
    cached = CachedSource(raw, pipeline(), 2, prep)
    assert (cached.count, int(cached.sizes[0]), cached.total_bytes) == (6, FIXED.nbytes, 6 * FIXED.nbytes)
    assert cached.fingerprint.digest != raw.fingerprint.digest  # another form, another identity
    assert CachedSource(raw, pipeline(), 2, None).fingerprint == cached.fingerprint  # prep plays no part
    out = np.zeros(6 * FIXED.nbytes, dtype=np.uint8)
    crcs, errors = cached.read_run(list(range(6)), out, [k * FIXED.nbytes for k in range(6)], [FIXED.nbytes] * 6)
    assert errors == []
    runner = Runner(pipeline())
    for k in range(6):
        got = out[k * FIXED.nbytes : (k + 1) * FIXED.nbytes]
        want = runner.run(raw.read(k), seed=0, epoch=0, sample=k, stop=2)
        assert np.array_equal(got.reshape(SIDE, SIDE, 3), want) and crcs[k] == crc32c(got)
    spent = prep.seconds_of("imgs")
    assert spent.keys() >= {"0:decode_image", "1:resize"} and "2:flip" not in spent
    single = np.empty(FIXED.nbytes, dtype=np.uint8)
    assert cached.read_into(3, single) == FIXED.nbytes and np.array_equal(
        single, out[3 * FIXED.nbytes : 4 * FIXED.nbytes]
    )
    with pytest.raises(StateError, match="no preprocessing workers"):
        CachedSource(raw, pipeline(), 2, None).read_into(0, single)


def test_a_variable_output_is_stored_at_its_most_with_a_zeroed_tail(backend, images, prep):
    variable = Output(max_bytes=FIXED.nbytes + 64)
    cached = CachedSource(open_source(backend, "imgs", str(images)), pipeline(variable), 2, prep)
    size = int(cached.sizes[0])
    assert size == HEADER + FIXED.nbytes + 64
    out = np.full(size, 0xFF, dtype=np.uint8)
    crcs, errors = cached.read_run([1], out, [0], [size])
    assert errors == [] and crcs[0] == crc32c(out)
    assert variable.decode(out).shape == (SIDE, SIDE, 3)
    assert not out[HEADER + FIXED.nbytes :].any()  # the same bytes (and checksum) on every read


def test_a_sample_the_cached_stages_cannot_take_is_named_with_its_file(backend, images, prep):
    (images / "2.jpg").write_bytes(b"not a jpeg")
    cached = CachedSource(open_source(backend, "imgs", str(images)), pipeline(), 2, prep)
    out = np.zeros(3 * FIXED.nbytes, dtype=np.uint8)
    crcs, errors = cached.read_run([1, 2, 3], out, [0, FIXED.nbytes, 2 * FIXED.nbytes], [FIXED.nbytes] * 3)
    assert [e.sample for e in errors] == [2] and isinstance(errors[0], PreprocessError)
    assert "stage 0 (decode_image) failed" in str(errors[0]) and str(images / "2.jpg") in str(errors[0])
    assert crcs[1] == 0 and crcs[0] and crcs[2]


def test_a_preload_stores_the_samples_as_the_cached_stages_leave_them(backend, images, prep, pool):
    raw = open_source(backend, "imgs", str(images))
    cached = CachedSource(raw, pipeline(), 2, prep)
    pool.allocate("imgs", range(Preloader.regions_needed(cached, pool.region_size)))
    preloader = Preloader(cached, pool)
    result = preloader.preload(timeout=60)
    assert result.complete and result.read_bytes == 6 * FIXED.nbytes
    runner = Runner(pipeline())
    region, offsets = preloader.home(np.arange(6))
    for k in range(6):
        stored = pool.array(int(region[k]))[int(offsets[k]) : int(offsets[k]) + FIXED.nbytes]
        assert np.array_equal(stored.reshape(SIDE, SIDE, 3), runner.run(raw.read(k), seed=0, epoch=0, sample=k, stop=2))
