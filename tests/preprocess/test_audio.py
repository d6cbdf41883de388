"""The WAV decoder against Python's ``wave`` module, and resampling against the signal it carries."""

from __future__ import annotations

import io
import math
import struct
import wave

import numpy as np
import pytest
from scipy.signal import resample_poly

from kspeed.preprocess import audio

DTYPES = {1: np.uint8, 2: np.dtype("<i2"), 4: np.dtype("<i4")}


def write_wav(samples: np.ndarray, rate: int) -> bytes:
    """``samples`` (frames, channels) written by the ``wave`` module."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(samples.shape[1])
        out.setsampwidth(samples.dtype.itemsize)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buf.getvalue()


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """What the ``wave`` module reads back: samples (frames, channels) and the rate."""
    with wave.open(io.BytesIO(data), "rb") as src:
        frames = src.readframes(src.getnframes())
        dtype = DTYPES[src.getsampwidth()]
        return np.frombuffer(frames, dtype=dtype).reshape(-1, src.getnchannels()), src.getframerate()


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize(("channels", "frames"), [(1, 1001), (2, 480), (6, 7)])
def test_wav_equals_wave_module(width, channels, frames):
    info = np.iinfo(DTYPES[width])
    rng = np.random.default_rng(width * 10 + channels)
    samples = rng.integers(info.min, info.max, size=(frames, channels), endpoint=True).astype(DTYPES[width])
    data = write_wav(samples, 22050)
    expected, rate = read_wav(data)
    got = audio.wav(data)
    assert got.dtype == expected.dtype and got.shape == (frames, channels)
    assert np.array_equal(got, expected)
    assert np.array_equal(got, samples)
    assert audio.wav_rate(data) == rate == 22050


def test_wav_is_a_view_of_the_payload():
    samples = np.arange(-100, 100, dtype=np.int16).reshape(-1, 2)
    data = bytearray(write_wav(samples, 8000))
    got = audio.wav(data)
    assert np.shares_memory(got, np.frombuffer(data, dtype=np.uint8))
    assert not audio.wav(bytes(data)).flags.writeable
    assert np.array_equal(audio.wav(np.frombuffer(bytes(data), dtype=np.uint8)), samples)
    assert np.array_equal(audio.wav(memoryview(data)), samples)


def canonical(
    *,
    riff: bytes = b"RIFF",
    wave_id: bytes = b"WAVE",
    fmt: bytes = b"fmt ",
    fmt_size: int = 16,
    tag: int = 1,
    channels: int = 1,
    rate: int = 8000,
    bits: int = 16,
    byte_rate: int | None = None,
    block_align: int | None = None,
    data_id: bytes = b"data",
    payload: bytes = bytes(8),
    data_size: int | None = None,
    riff_size: int | None = None,
) -> bytes:
    """A canonical 44-byte-header WAV file with any field overridden."""
    block_align = channels * bits // 8 if block_align is None else block_align
    byte_rate = rate * block_align if byte_rate is None else byte_rate
    data_size = len(payload) if data_size is None else data_size
    riff_size = 36 + len(payload) if riff_size is None else riff_size
    head = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        riff,
        riff_size,
        wave_id,
        fmt,
        fmt_size,
        tag,
        channels,
        rate,
        byte_rate,
        block_align,
        bits,
        data_id,
        data_size,
    )
    return head + payload


def test_canonical_helper_matches_wave_module():
    data = write_wav(np.zeros((4, 1), np.int16), 8000)
    assert canonical() == data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"RIFF", "shorter than its 44-byte header"),
        (canonical(riff=b"RIFX"), "no RIFF/WAVE signature"),
        (canonical(wave_id=b"AVI "), "no RIFF/WAVE signature"),
        (canonical()[:-2], "RIFF chunk size 44"),
        (canonical(riff_size=100), "RIFF chunk size 100"),
        (canonical(fmt=b"LIST"), "'fmt ' chunk first"),
        (canonical(fmt_size=18), "'fmt ' chunk first"),
        (canonical(tag=3, bits=32), "format tag 3"),
        (canonical(bits=24, payload=bytes(6)), "bits per sample 24"),
        (canonical(channels=0), "0 channels"),
        (canonical(rate=0), "at 0 Hz"),
        (canonical(block_align=4), "block align 4"),
        (canonical(byte_rate=1), "byte rate 1"),
        (canonical(data_id=b"fact"), "expected the 'data' chunk"),
        (canonical(data_size=10), "data chunk size 10 exceeds"),
        (canonical(payload=bytes(7)), "not a whole number of 2-byte frames"),
    ],
)
def test_wav_rejects_bad_headers_naming_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        audio.wav(data)
    with pytest.raises(ValueError, match=message):
        audio.wav_rate(data)


def sine(frequency: float, rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave_ = 0.5 * np.sin(2 * np.pi * frequency * t)
    return np.repeat(wave_[:, None], channels, axis=1).astype(np.float32) if channels > 1 else wave_.astype(np.float32)


def peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[np.argmax(spectrum)])


def test_resample_keeps_the_tone_and_the_length():
    x = sine(440, 16000, 1.0)
    y = audio.resample(x, orig_rate=16000, new_rate=8000)
    assert y.dtype == np.float32
    assert len(y) == math.ceil(len(x) * 8000 / 16000)
    assert abs(peak_hz(y, 8000) - 440) <= 1.0  # one FFT bin at 1 s
    assert abs(peak_hz(x, 16000) - 440) <= 1.0


def test_resample_odd_ratio_length_and_band_limit():
    x = sine(440, 44100, 0.5) + sine(12000, 44100, 0.5)  # 12 kHz lies above the new Nyquist frequency
    y = audio.resample(x, orig_rate=44100, new_rate=16000)
    assert len(y) == math.ceil(len(x) * 16000 / 44100)
    assert abs(peak_hz(y, 16000) - 440) <= 2.0
    # The 12 kHz tone is filtered out rather than aliased to 4 kHz.
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    freqs = np.fft.rfftfreq(len(y), 1 / 16000)
    assert spectrum[np.abs(freqs - 4000) < 20].max() < 0.01 * spectrum.max()
    assert np.allclose(y, resample_poly(x, 160, 441), rtol=0, atol=1e-6)


def test_resample_same_rate_is_identity_and_channels_follow_axis_0():
    x = sine(440, 16000, 0.25, channels=2)
    assert np.array_equal(audio.resample(x, orig_rate=16000, new_rate=16000), x)
    y = audio.resample(x, orig_rate=16000, new_rate=24000)
    assert y.shape == (math.ceil(len(x) * 3 / 2), 2)
    assert np.array_equal(y[:, 0], y[:, 1])
    pcm = (x * 20000).astype(np.int16)
    z = audio.resample(pcm, orig_rate=16000, new_rate=8000)
    assert z.dtype == np.float32 and 9500 < np.abs(z).max() < 10500  # amplitude 10000: PCM is not rescaled


@pytest.mark.parametrize(("orig", "new"), [(0, 8000), (16000, -1), (16000, 8000.0), (True, 8000)])
def test_resample_rejects_bad_rates(orig, new):
    with pytest.raises(ValueError, match="must be a positive integer"):
        audio.resample(np.zeros(10, np.float32), orig_rate=orig, new_rate=new)
