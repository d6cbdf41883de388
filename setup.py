"""The one compiled part of KSpeed: the opt-in region decoder (``kspeed.preprocess.jpeg_region``).

It links libjpeg-turbo (Debian: ``libjpeg62-turbo-dev``; Fedora: ``libjpeg-turbo-devel``). It is
optional: without a compiler or those headers the install goes on without it, and only the
``decode_random_resized_crop`` stage (``wrap(..., region_decode=True)``) is refused, with that
reason. Everything else is in ``pyproject.toml``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kspeed.preprocess._jpegregion",
            sources=["kspeed/preprocess/_jpegregion.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
