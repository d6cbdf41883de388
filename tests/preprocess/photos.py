"""Real photographs for the preprocessing tests: crops of scikit-learn's sample images as JPEG."""

from __future__ import annotations

import io

from PIL import Image
from sklearn.datasets import load_sample_images


def jpeg_crop(photo: int, rows: slice, cols: slice, quality: int = 90) -> bytes:
    """Sample photograph ``photo`` (0: china, 1: flower) cropped to ``rows`` x ``cols``, as JPEG."""
    buffer = io.BytesIO()
    Image.fromarray(load_sample_images().images[photo][rows, cols]).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
