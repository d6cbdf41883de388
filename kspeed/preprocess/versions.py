"""The preprocessing libraries and decoders of this process, with their versions.

Servers report them at registration and clients compare them with their own: a sample must get
the same bytes wherever its stages run, so a placement that would mix versions is refused.
"""

from __future__ import annotations

import contextlib
import functools
from importlib import metadata

__all__ = ["LIBRARIES", "libraries", "mismatch"]

#: Distributions whose versions decide a pipeline's output.
LIBRARIES = ("numpy", "Pillow", "torch", "torchvision", "scipy")


@functools.cache
def libraries() -> dict[str, str]:
    """Installed versions of :data:`LIBRARIES`, of Pillow's JPEG and zlib codecs and of the libjpeg-turbo
    the region decoder (:mod:`kspeed.preprocess.jpeg_region`) was built against (absent ones left out)."""
    found = {}
    for name in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    with contextlib.suppress(ImportError):
        from PIL import features

        for codec, key in (("jpg", "libjpeg"), ("zlib", "zlib")):
            version = features.version(codec)
            if version:
                found[key] = str(version)
        from kspeed.preprocess import jpeg_region

        region = jpeg_region.version()
        if region:
            found["jpeg_region"] = region
    return found


def mismatch(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The libraries both sides have whose versions differ."""
    names = sorted(set(ours) & set(theirs))
    return [
        f"{name} {ours.get(name, 'missing')} here, {theirs.get(name, 'missing')} there"
        for name in names
        if ours.get(name) != theirs.get(name)
    ]
