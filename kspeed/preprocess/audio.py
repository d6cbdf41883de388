"""Audio ops: the PCM payload of canonical WAV files, and band-limited resampling.

:func:`wav` reads the 44-byte canonical RIFF/WAVE layout that Python's ``wave`` module, sox and most
dataset tools write (one 16-byte ``fmt`` chunk of PCM, then the ``data`` chunk) and returns the
samples as a view, without copying.
"""

from __future__ import annotations

import math
import struct

import numpy as np

__all__ = ["resample", "wav", "wav_rate"]

# "RIFF" size "WAVE" | "fmt " 16 format channels rate byte_rate block_align bits | "data" size
_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")
_PCM = 1
_FMT_SIZE = 16
# 8-bit WAV is unsigned, wider samples are signed little-endian.
_SAMPLE_DTYPES: dict[int, np.dtype] = {8: np.dtype("u1"), 16: np.dtype("<i2"), 32: np.dtype("<i4")}


def wav(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """The samples of a canonical PCM WAV file as a ``(frames, channels)`` view of its payload.

    Args:
        data: the file's bytes; a ``uint8`` array is read as its bytes.

    Returns:
        ``uint8`` (8-bit), ``<i2`` (16-bit) or ``<i4`` (32-bit) samples, read-only when ``data`` is.

    Raises:
        ValueError: the header is not canonical PCM WAV or disagrees with the file's size, naming which field.
    """
    buf = _buffer(data)
    _rate, channels, bits, size = _parse(buf)
    dtype = _SAMPLE_DTYPES[bits]
    samples = np.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize, offset=_HEADER.size)
    return samples.reshape(-1, channels)


def wav_rate(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The sample rate (frames per second) of a canonical PCM WAV file, validated as :func:`wav` does."""
    return _parse(_buffer(data))[0]


def resample(x: np.ndarray, *, orig_rate: int, new_rate: int) -> np.ndarray:
    """Resample along axis 0 from ``orig_rate`` to ``new_rate`` with a band-limited polyphase filter.

    ``scipy.signal.resample_poly`` with the ratio reduced by its gcd (its default Kaiser-windowed
    FIR, which low-passes at the lower Nyquist frequency). The output has ``ceil(n * new / orig)``
    frames. Values are not rescaled: integer PCM stays in its integer range, as ``float32``.

    Args:
        x: samples, frames first (``(frames,)`` or ``(frames, channels)``).
        orig_rate: the input's rate in Hz.
        new_rate: the output's rate in Hz.

    Returns:
        ``float32`` samples; a copy of ``x`` as ``float32`` when the rates are equal.

    Raises:
        ValueError: a rate that is not a positive integer.
    """
    for name, rate in (("orig_rate", orig_rate), ("new_rate", new_rate)):
        if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
            raise ValueError(f"{name} must be a positive integer, got {rate!r}")
    if orig_rate == new_rate:
        return x.astype(np.float32)
    # scipy is heavy and only audio pipelines need it; it ships no type information.
    from scipy.signal import resample_poly  # type: ignore[import-untyped]

    divisor = math.gcd(int(orig_rate), int(new_rate))
    signal = x if x.dtype.kind == "f" else x.astype(np.float32)
    out = resample_poly(signal, int(new_rate) // divisor, int(orig_rate) // divisor, axis=0)
    return np.asarray(out, dtype=np.float32)


def _buffer(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).data
    return memoryview(data).cast("B")


def _parse(buf: memoryview) -> tuple[int, int, int, int]:
    """Validate the canonical header; return ``(rate, channels, bits, data_size)``."""
    if len(buf) < _HEADER.size:
        raise ValueError(f"WAV file of {len(buf)} bytes is shorter than its {_HEADER.size}-byte header")
    riff, riff_size, wave, fmt, fmt_size, fmt_tag, channels, rate, byte_rate, block_align, bits, data_id, size = (
        _HEADER.unpack_from(buf)
    )
    if riff != b"RIFF" or wave != b"WAVE":
        raise ValueError("not a WAV file: no RIFF/WAVE signature")
    if riff_size != len(buf) - 8:
        raise ValueError(f"RIFF chunk size {riff_size} does not match the file's {len(buf)} bytes")
    if fmt != b"fmt " or fmt_size != _FMT_SIZE:
        raise ValueError(f"not a canonical WAV: expected a {_FMT_SIZE}-byte 'fmt ' chunk first")
    if fmt_tag != _PCM:
        raise ValueError(f"unsupported WAV format tag {fmt_tag} (only PCM, 1)")
    if bits not in _SAMPLE_DTYPES:
        raise ValueError(f"unsupported WAV bits per sample {bits} (8, 16 or 32)")
    if channels == 0 or rate == 0:
        raise ValueError(f"bad WAV fmt chunk: {channels} channels at {rate} Hz")
    if block_align != channels * bits // 8 or byte_rate != rate * block_align:
        raise ValueError(f"bad WAV fmt chunk: block align {block_align} or byte rate {byte_rate} inconsistent")
    if data_id != b"data":
        raise ValueError(f"not a canonical WAV: expected the 'data' chunk, found {data_id!r}")
    if size > len(buf) - _HEADER.size:
        raise ValueError(f"WAV data chunk size {size} exceeds the {len(buf) - _HEADER.size} payload bytes")
    if size % block_align:
        raise ValueError(f"WAV data chunk size {size} is not a whole number of {block_align}-byte frames")
    return rate, channels, bits, size
