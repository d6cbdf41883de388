"""The op registry: lookup, parameter checks before anything runs, and JSON pipelines against torchvision."""

from __future__ import annotations

import inspect
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import functional as F

from kspeed.errors import ConfigError
from kspeed.preprocess import image, ops
from kspeed.preprocess.rng import sample_rng
from tests.preprocess.photos import jpeg_crop

# name -> (random, takes_bytes)
EXPECTED = {
    "decode_image": (False, True),
    "resize": (False, False),
    "center_crop": (False, False),
    "random_resized_crop": (True, False),
    "decode_random_resized_crop": (True, True),
    "flip": (True, False),
    "to_chw": (False, False),
    "cast": (False, False),
    "normalize": (False, False),
    "npy": (False, True),
    "wav": (False, True),
    "resample": (False, False),
    "log1p": (False, False),
    "random_crop_3d": (True, False),
    "flip_3d": (True, False),
}


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    """A real photograph, 360x480, as JPEG q90."""
    return jpeg_crop(1, slice(20, 380), slice(50, 530))


def test_registry_holds_the_builtin_ops_with_their_kinds():
    assert {name: (op.random, op.takes_bytes) for name, op in ops.OPS.items()} == EXPECTED
    for name, op in ops.OPS.items():
        assert ops.get(name) is op and op.name == name
        positional = [
            p for p in inspect.signature(op.fn).parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        assert len(positional) == (2 if op.random else 1), name
    with pytest.raises(TypeError):
        ops.OPS["mine"] = ops.OPS["flip"]


def test_unknown_op_names_it_and_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown op 'random_crop'") as info:
        ops.get("random_crop")
    assert "random_crop_3d" in str(info.value) and "resize" in str(info.value)
    assert info.value.value == "random_crop"
    with pytest.raises(ConfigError, match="unknown op"):
        ops.check_params("blur", {})


GOOD = [
    ("decode_image", {}),
    ("decode_image", {"mode": "L"}),
    ("resize", {"size": 256}),
    ("resize", {"size": [256], "max_size": 400, "interpolation": "bicubic", "antialias": True}),
    ("resize", {"size": [224, 200]}),
    ("center_crop", {"size": [224]}),
    ("random_resized_crop", {"size": [224, 224], "scale": [0.08, 1.0], "ratio": [0.75, 1.3333333333333333]}),
    ("flip", {"p": 1}),
    ("flip", {"layout": "chw"}),
    ("to_chw", {}),
    ("cast", {"dtype": "float32"}),
    ("cast", {"dtype": "uint8", "scale": False}),
    ("normalize", {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}),
    ("normalize", {"mean": 0.5, "std": [0.2, 0.3, 0.4], "layout": "hwc"}),
    ("npy", {}),
    ("wav", {}),
    ("resample", {"orig_rate": 44100, "new_rate": 16000}),
    ("log1p", {}),
    ("random_crop_3d", {"size": [128, 128, 128]}),
    ("flip_3d", {"p": 0.25, "axes": [-2, -1]}),
]


@pytest.mark.parametrize(("name", "params"), GOOD)
def test_good_parameters_pass(name, params):
    ops.check_params(name, json.loads(json.dumps(params)))


BAD = [
    ("resize", {"size": 256, "sizes": 3}, "resize.sizes", "no parameter 'sizes'"),
    ("decode_random_resized_crop", {}, "decode_random_resized_crop.size", "needs parameter 'size'"),
    ("decode_random_resized_crop", {"size": 8, "ratio": [2, 1]}, "decode_random_resized_crop.ratio", "low <= high"),
    ("resize", {}, "resize.size", "needs parameter 'size'"),
    ("resample", {"orig_rate": 16000}, "resample.new_rate", "needs parameter 'new_rate'"),
    ("to_chw", {"layout": "chw"}, "to_chw.layout", "no parameter 'layout'"),
    ("flip", {"rng": 3}, "flip.rng", "no parameter 'rng'"),
    ("resize", {"size": -1}, "resize.size", "positive integer"),
    ("resize", {"size": 0}, "resize.size", "positive integer"),
    ("resize", {"size": [1, 2, 3]}, "resize.size", "list of 1 or 2"),
    ("resize", {"size": 224.0}, "resize.size", "positive integer"),
    ("resize", {"size": True}, "resize.size", "positive integer"),
    ("resize", {"size": 224, "interpolation": "cubic"}, "resize.interpolation", "one of nearest, bilinear"),
    ("resize", {"size": 224, "antialias": "yes"}, "resize.antialias", "true or false"),
    ("resize", {"size": 224, "max_size": 0}, "resize.max_size", "positive integer"),
    ("resize", {"size": 224, "max_size": 224}, "resize.max_size", "greater than the shorter side"),
    ("resize", {"size": [224, 200], "max_size": 300}, "resize.max_size", "only when size is the shorter side"),
    ("center_crop", {"size": [224, -5]}, "center_crop.size", "positive integer"),
    ("random_resized_crop", {"size": [0, 224]}, "random_resized_crop.size", "positive integer"),
    ("random_resized_crop", {"size": 224, "scale": [1.0, 0.5]}, "random_resized_crop.scale", "low <= high"),
    ("random_resized_crop", {"size": 224, "scale": [0.08]}, "random_resized_crop.scale", "[low, high]"),
    ("random_resized_crop", {"size": 224, "ratio": [0, 1]}, "random_resized_crop.ratio", "0 < low"),
    ("random_resized_crop", {"size": 224, "interpolation": 2}, "random_resized_crop.interpolation", "one of"),
    ("flip", {"p": 1.5}, "flip.p", "in [0, 1]"),
    ("flip", {"p": -0.1}, "flip.p", "in [0, 1]"),
    ("flip", {"p": "0.5"}, "flip.p", "in [0, 1]"),
    ("flip", {"layout": "nchw"}, "flip.layout", "one of hwc, hw, chw"),
    ("cast", {"dtype": "float8"}, "cast.dtype", "one of uint8"),
    ("cast", {"dtype": "float32", "scale": 1}, "cast.scale", "true or false"),
    ("normalize", {"mean": [0.5, 0.5], "std": [0.2, 0.2, 0.2]}, "normalize.std", "as many values as mean"),
    ("normalize", {"mean": [], "std": 0.2}, "normalize.mean", "non-empty list"),
    ("normalize", {"mean": [0.5, "x"], "std": 0.2}, "normalize.mean", "finite numbers"),
    ("normalize", {"mean": 0.5, "std": [0.2, 0.0, 0.2]}, "normalize.std", "must not contain 0"),
    ("normalize", {"mean": 0.5, "std": 0.2, "layout": "nhwc"}, "normalize.layout", "one of chw, hwc"),
    ("decode_image", {"mode": "CMYK"}, "decode_image.mode", "one of RGB, RGBA, L"),
    ("resample", {"orig_rate": 16000, "new_rate": 0}, "resample.new_rate", "positive integer"),
    ("random_crop_3d", {"size": 64}, "random_crop_3d.size", "list of 3 positive integers"),
    ("random_crop_3d", {"size": [64, 64]}, "random_crop_3d.size", "list of 3"),
    ("random_crop_3d", {"size": [64, -64, 64]}, "random_crop_3d.size", "list of 3"),
    ("flip_3d", {"p": 2}, "flip_3d.p", "in [0, 1]"),
    ("flip_3d", {"axes": []}, "flip_3d.axes", "non-empty list"),
    ("flip_3d", {"axes": [-1, -1]}, "flip_3d.axes", "distinct"),
    ("flip_3d", {"axes": [0.5]}, "flip_3d.axes", "integer axes"),
]


@pytest.mark.parametrize(("name", "params", "field", "message"), BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_parameters_raise_config_error_naming_op_and_parameter(name, params, field, message):
    with pytest.raises(ConfigError) as info:
        ops.check_params(name, params)
    error = info.value
    assert error.field == field
    param = field.split(".", 1)[1]
    assert f"'{name}'" in str(error) and f"'{param}'" in str(error)
    assert message in str(error)
    assert error.value == params.get(param)


def test_apply_passes_the_generator_only_to_random_ops(jpeg):
    decoded = ops.apply(ops.get("decode_image"), jpeg, None, {})
    assert np.array_equal(decoded, image.decode_image(jpeg))
    crop = ops.apply(ops.get("center_crop"), decoded, None, {"size": [100, 120]})
    assert crop.shape == (100, 120, 3)
    flipped = ops.apply(ops.get("flip"), crop, np.random.default_rng(0), {"p": 1.0})
    assert np.array_equal(flipped, crop[:, ::-1])
    with pytest.raises(ValueError, match="needs the stage's generator"):
        ops.apply(ops.get("flip"), crop, None, {})


def test_json_pipeline_equals_torchvision_transforms(jpeg):
    """decode -> random resized crop -> flip -> to CHW -> float -> normalize, from JSON, against torchvision."""
    pipeline = json.loads(
        """[
        ["decode_image", {}],
        ["random_resized_crop", {"size": [224, 224], "scale": [0.08, 1.0], "ratio": [0.75, 1.3333333333333333]}],
        ["flip", {"p": 0.5}],
        ["to_chw", {}],
        ["cast", {"dtype": "float32"}],
        ["normalize", {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}]
    ]"""
    )
    for name, params in pipeline:
        ops.check_params(name, params)
    pil = Image.open(io.BytesIO(jpeg)).convert("RGB")
    flips = 0
    for sample in range(6):
        value: object = jpeg
        for stage, (name, params) in enumerate(pipeline):
            op = ops.get(name)
            value = ops.apply(op, value, sample_rng(42, 3, sample, stage) if op.random else None, params)
        assert isinstance(value, np.ndarray) and value.shape == (3, 224, 224) and value.dtype == np.float32

        crop = pipeline[1][1]
        top, left, h, w = image.resized_crop_params(
            pil.height, pil.width, sample_rng(42, 3, sample, 1), crop["scale"], crop["ratio"]
        )
        reference = F.resized_crop(pil, top, left, h, w, [224, 224])
        if sample_rng(42, 3, sample, 2).random() < 0.5:
            reference = F.hflip(reference)
            flips += 1
        tensor = F.convert_image_dtype(F.pil_to_tensor(reference), torch.float32)
        expected = F.normalize(tensor, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]).numpy()
        diff = np.abs(value.view(np.int32).astype(np.int64) - expected.view(np.int32).astype(np.int64))
        assert diff.max() <= 1, sample  # measured: 0
    assert 0 < flips < 6
