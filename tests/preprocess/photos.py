"""Real photographs for the preprocessing tests: scikit-learn's sample images and JPEG crops of them.

scikit-learn is imported only when a photograph is asked for: importing it (through joblib's
loky) renames every multiprocessing semaphore the process creates afterwards, which other tests'
checks of /dev/shm would otherwise meet in the middle of the session.
"""

from __future__ import annotations

import functools
import io

import numpy as np
from PIL import Image


@functools.cache
def sample_photographs() -> tuple[np.ndarray, ...]:
    """scikit-learn's two sample photographs (china, flower) as HWC uint8 arrays."""
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)


def jpeg_crop(photo: int, rows: slice, cols: slice, quality: int = 90) -> bytes:
    """Sample photograph ``photo`` (0: china, 1: flower) cropped to ``rows`` x ``cols``, as JPEG."""
    buffer = io.BytesIO()
    Image.fromarray(sample_photographs()[photo][rows, cols]).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
