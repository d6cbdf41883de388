"""Torchvision transforms sent as data: re-created exactly, seeded alike on both sides, placed by dtype.

Every check runs real torchvision transforms on real JPEG photographs (scikit-learn's sample images,
cropped, encoded with Pillow and decoded the way torchvision's ``pil_loader`` does).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from PIL import Image

from kspeed.errors import ConfigError, PreprocessError
from kspeed.preprocess import rng
from kspeed.preprocess.transforms import (
    SENDABLE,
    Produces,
    apply,
    build,
    default_cut,
    describe,
    from_array,
    is_random,
    produces,
    to_array,
)

pytestmark = pytest.mark.filterwarnings("ignore:The transform `ToTensor\\(\\)` is deprecated")

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
PIL_IMAGE = Produces("pil", "uint8", None)


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    """Three JPEG photographs of 300 to 500 pixels a side, decoded as ``pil_loader`` does."""
    datasets = pytest.importorskip("sklearn.datasets", reason="the sample photographs ship with scikit-learn")
    china, flower = datasets.load_sample_images().images
    crops = [china[10:410, 40:370], flower[20:320, 100:550], flower[0:427, 137:500]]
    decoded = []
    for crop in crops:
        buffer = io.BytesIO()
        Image.fromarray(crop).save(buffer, format="JPEG", quality=90)
        buffer.seek(0)
        decoded.append(Image.open(buffer).convert("RGB"))
    return decoded


def _tensor(value: object) -> torch.Tensor:
    return torch.from_numpy(to_array(value).copy())


def _run(stages: list[tuple[str, dict]], value: object, seeds: list[int | None] | None = None) -> object:
    for index, (op, params) in enumerate(stages):
        value = apply(build(op, params), value, None if seeds is None else seeds[index])
    return value


DETERMINISTIC = {
    "resize-short-side": lambda: T.Resize(256),
    "resize-both-bicubic": lambda: T.Resize([200, 300], interpolation=T.InterpolationMode.BICUBIC),
    "resize-nearest-max-size": lambda: T.Resize(100, interpolation=T.InterpolationMode.NEAREST, max_size=150),
    "resize-pillow-constant": lambda: T.Resize(180, interpolation=Image.Resampling.LANCZOS),
    "center-crop": lambda: T.CenterCrop(224),
    "center-crop-pads": lambda: T.CenterCrop([300, 500]),
    "eval-uint8": lambda: T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()]),
    "eval-float": lambda: T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)]),
    "tensor-path": lambda: T.Compose(
        [
            T.PILToTensor(),
            T.Resize(128, antialias=False),
            T.ConvertImageDtype(torch.float32),
            T.Normalize(MEAN, STD, inplace=True),
        ]
    ),
    "float64-tensor-mean": lambda: T.Compose(
        [T.PILToTensor(), T.ConvertImageDtype(torch.float64), T.Normalize(torch.tensor(MEAN), torch.tensor(STD))]
    ),
    "scalar-normalize": lambda: T.Compose([T.ToTensor(), T.Normalize(0.5, 0.25)]),
    "v2-eval": lambda: v2.Compose(
        [v2.Resize(256), v2.CenterCrop(224), v2.PILToTensor(), v2.ConvertImageDtype(), v2.Normalize(MEAN, STD)]
    ),
    "v2-pillow-constant-to-tensor": lambda: v2.Compose([v2.Resize((160, 200), interpolation=3), v2.ToTensor()]),
    "mixed-nested": lambda: T.Compose([v2.Resize(200), T.Compose([T.CenterCrop(150), T.PILToTensor()])]),
}


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_deterministic_transforms_are_recreated_exactly(photos, name):
    transform = DETERMINISTIC[name]()
    stages = describe(transform)
    for photo in photos:
        expected, got = transform(photo.copy()), _run(stages, photo.copy())
        assert type(got) is type(expected)
        assert torch.equal(_tensor(got), _tensor(expected))


def test_describe_writes_every_parameter_as_json_data():
    assert describe(T.Resize(256)) == [
        (
            "torchvision.transforms:Resize",
            {"size": 256, "interpolation": "bilinear", "max_size": None, "antialias": True},
        )
    ]
    assert describe(T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.CenterCrop(100)])) == [
        (
            "torchvision.transforms:RandomResizedCrop",
            {
                "size": [224, 224],
                "scale": [0.08, 1.0],
                "ratio": [3.0 / 4.0, 4.0 / 3.0],
                "interpolation": "bilinear",
                "antialias": True,
            },
        ),
        ("torchvision.transforms:RandomHorizontalFlip", {"p": 0.5}),
        ("torchvision.transforms:CenterCrop", {"size": [100, 100]}),
    ]
    assert describe(T.ConvertImageDtype(torch.float32)) == [
        ("torchvision.transforms:ConvertImageDtype", {"dtype": "float32"})
    ]
    assert describe(T.Normalize(MEAN, STD)) == [
        ("torchvision.transforms:Normalize", {"mean": list(MEAN), "std": list(STD), "inplace": False})
    ]
    assert describe(v2.Resize(256)) == [
        (
            "torchvision.transforms.v2:Resize",
            {"size": [256], "interpolation": "bilinear", "max_size": None, "antialias": True},
        )
    ]


def test_params_survive_json_and_the_round_trip_through_build():
    transform = T.Compose(
        [
            T.RandomResizedCrop(176, scale=(0.25, 1), ratio=(0.7, 1.4), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(0.3),
            T.Resize(160, max_size=200, antialias=None),
            T.PILToTensor(),
            T.ConvertImageDtype(torch.float16),
            T.Normalize(torch.tensor(MEAN, dtype=torch.float32), STD),
        ]
    )
    stages = describe(transform)
    carried = [(op, params) for op, params in json.loads(json.dumps(stages))]
    assert carried == stages
    assert describe(T.Compose([build(op, params) for op, params in carried])) == stages
    v2_stages = describe(v2.Compose([v2.RandomResizedCrop(96), v2.RandomHorizontalFlip(), v2.ToTensor()]))
    assert describe(v2.Compose([build(*stage) for stage in v2_stages])) == v2_stages


def test_nested_composes_flatten():
    nested = T.Compose([T.Resize(256), T.Compose([T.CenterCrop(224), T.Compose([T.PILToTensor()])])])
    flat = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    assert describe(nested) == describe(flat)
    assert len(describe(nested)) == 3


class Sharpen:
    def __call__(self, image):
        return image


class MyResize(T.Resize):
    pass


@pytest.mark.parametrize(
    ("transform", "named"),
    [
        (
            T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor(), T.ColorJitter(0.4)]),
            "transform 3 (ColorJitter)",
        ),
        (T.Compose([T.Resize(256), T.Lambda(lambda image: image)]), "transform 1 (Lambda)"),
        (T.Compose([T.Resize(256), lambda image: image]), "transform 1 (<lambda>)"),
        (Sharpen(), "transform 0 (Sharpen)"),
        (T.Compose([T.Resize(8), T.Compose([Sharpen()])]), "transform 1.0 (Sharpen)"),
        (v2.Compose([v2.RandomRotation(10)]), "transform 0 (RandomRotation)"),
    ],
)
def test_describe_refuses_what_it_cannot_send(transform, named):
    with pytest.raises(ConfigError, match="is not one KSpeed can send as data; it runs on the client") as info:
        describe(transform)
    assert named in str(info.value)


def test_describe_refuses_subclasses_and_parameters_that_are_not_data():
    with pytest.raises(ConfigError, match=r"transform 0 \(MyResize\).*subclass of torchvision.transforms:Resize"):
        describe(MyResize(10))
    not_data = [
        (T.Resize(10, interpolation="cubic"), "interpolation"),
        (T.Resize(10, interpolation=object()), "interpolation"),
        (T.ConvertImageDtype("float32"), "dtype"),
        (T.Normalize([float("nan")] * 3, STD), "mean"),
        (T.Normalize(MEAN, ["a", "b", "c"]), "std"),
        (T.RandomHorizontalFlip(p=torch.tensor(0.5)), "p"),
    ]
    for transform, param in not_data:
        with pytest.raises(ConfigError, match=rf"transform 1 \({type(transform).__name__}\) has a {param} "):
            describe(T.Compose([T.CenterCrop(5), transform]))


def test_build_names_what_is_wrong():
    cases = [
        ("torchvision.transforms:ColorJitter", {}, "unknown transform op 'torchvision.transforms:ColorJitter'"),
        ("torchvision.transforms:Resize", {"size": 8, "fill": 0}, "no parameter 'fill'"),
        ("torchvision.transforms:Resize", {"size": "big"}, "parameter 'size'"),
        ("torchvision.transforms:Resize", {"size": 8, "interpolation": "cubic"}, "parameter 'interpolation'"),
        ("torchvision.transforms:ConvertImageDtype", {"dtype": "float99"}, "parameter 'dtype'"),
        ("torchvision.transforms:Resize", {"size": [1, 2, 3]}, "cannot be built"),
        ("torchvision.transforms:CenterCrop", {}, "cannot be built"),
    ]
    for op, params, message in cases:
        with pytest.raises(ConfigError, match=message):
            build(op, params)
    assert isinstance(build("torchvision.transforms:Resize", {"size": 8}), T.Resize)  # the rest default


def test_sendable_and_is_random():
    assert "torchvision.transforms:RandomResizedCrop" in SENDABLE
    assert "torchvision.transforms.v2:Normalize" in SENDABLE
    assert not any(op.endswith(":Compose") for op in SENDABLE)
    random = {op for op in SENDABLE if is_random(op)}
    assert random == {
        f"{ns}:{name}"
        for ns in ("torchvision.transforms", "torchvision.transforms.v2")
        for name in ("RandomResizedCrop", "RandomHorizontalFlip")
    }
    with pytest.raises(ConfigError, match="unknown transform op"):
        is_random("torchvision.transforms:ColorJitter")


RANDOM = {
    "v1": lambda: T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()]),
    "v1-tensor": lambda: T.Compose(
        [T.PILToTensor(), T.RandomResizedCrop(128, scale=(0.3, 0.9), antialias=False), T.RandomHorizontalFlip(0.7)]
    ),
    "v2": lambda: v2.Compose(
        [v2.RandomResizedCrop(160, ratio=(0.5, 2.0)), v2.RandomHorizontalFlip(), v2.PILToTensor()]
    ),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_a_client_and_a_server_seeded_alike_agree(photos, name):
    transform = RANDOM[name]()
    members = transform.transforms
    stages = describe(transform)
    for sample, photo in enumerate(photos):
        for epoch in range(4):
            seeds = [
                rng.torch_seed(7, epoch, sample, stage) if is_random(op) else None
                for stage, (op, _) in enumerate(stages)
            ]
            client = photo
            for member, seed in zip(members, seeds):
                if seed is not None:
                    torch.manual_seed(seed)
                client = member(client)
            server = _run(stages, photo, seeds)
            assert torch.equal(_tensor(server), _tensor(client))
            assert torch.equal(_tensor(_run(stages, photo, seeds)), _tensor(server))  # the same seed again


def test_different_seeds_give_different_crops_and_flips(photos):
    crop = build(*describe(T.RandomResizedCrop(224))[0])
    flip = build(*describe(T.RandomHorizontalFlip())[0])
    photo = photos[0]
    seeds = [rng.torch_seed(1, 0, sample, 0) for sample in range(32)]
    crops = {_tensor(apply(crop, photo, seed)).numpy().tobytes() for seed in seeds}
    assert len(crops) >= 28
    flipped = sum(not torch.equal(_tensor(apply(flip, photo, seed)), _tensor(photo)) for seed in seeds)
    assert 6 <= flipped <= 26


def test_apply_leaves_the_callers_random_stream_alone(photos):
    crop = build("torchvision.transforms:RandomResizedCrop", {"size": 64})
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    apply(crop, photos[0], 12345)
    assert torch.equal(torch.rand(4), expected)


def test_produces_and_default_cut_place_float_stages_on_the_client():
    train = describe(
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    )
    assert default_cut(train, PIL_IMAGE) == 2
    state = PIL_IMAGE
    for op, params in train[:2]:
        state = produces(op, params, state)
    assert state == Produces("pil", "uint8", (224, 224))

    evaluate = describe(T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()]))
    assert default_cut(evaluate, PIL_IMAGE) == 3
    after = [PIL_IMAGE]
    for op, params in evaluate:
        after.append(produces(op, params, after[-1]))
    assert after[1:] == [
        Produces("pil", "uint8", None),  # only the shorter side is fixed
        Produces("pil", "uint8", (224, 224)),
        Produces("tensor", "uint8", (224, 224)),
    ]

    assert default_cut(describe(T.Compose([T.ToTensor()])), PIL_IMAGE) == 0
    assert produces(*describe(T.Resize([224, 200]))[0], PIL_IMAGE).size == (224, 200)
    as_float = produces(*describe(T.ConvertImageDtype(torch.float32))[0], Produces("tensor", "uint8", (5, 6)))
    assert as_float == Produces("tensor", "float32", (5, 6))


def test_produces_refuses_inputs_a_stage_cannot_take_except_v2_pass_through():
    uint8_tensor = Produces("tensor", "uint8", (8, 8))
    with pytest.raises(ConfigError, match="needs a float tensor"):
        produces(*describe(T.Normalize(MEAN, STD))[0], uint8_tensor)
    with pytest.raises(ConfigError, match="needs a pil but receives a tensor"):
        produces(*describe(T.ToTensor())[0], uint8_tensor)
    with pytest.raises(ConfigError, match="needs a tensor but receives a pil"):
        produces(*describe(v2.Normalize(MEAN, STD))[0], PIL_IMAGE)
    assert produces(*describe(v2.PILToTensor())[0], uint8_tensor) == uint8_tensor
    assert produces(*describe(v2.ConvertImageDtype())[0], PIL_IMAGE) == PIL_IMAGE
    with pytest.raises(ConfigError, match="unknown kind"):
        Produces("array", "uint8", None)


@pytest.mark.parametrize("name", sorted(DETERMINISTIC) + sorted(RANDOM))
def test_produces_matches_what_the_stages_really_yield(photos, name):
    stages = describe({**DETERMINISTIC, **RANDOM}[name]())
    value, state = photos[1], PIL_IMAGE
    for op, params in stages:
        value, state = apply(build(op, params), value, 5 if is_random(op) else None), produces(op, params, state)
        if state.kind == "pil":
            assert isinstance(value, Image.Image) and value.mode == "RGB"
            height, width = value.height, value.width
        else:
            assert isinstance(value, torch.Tensor) and str(value.dtype) == f"torch.{state.dtype}"
            height, width = value.shape[-2:]
        assert state.size in (None, (height, width))


def test_arrays_round_trip_exactly(photos):
    for image in (photos[0], photos[0].convert("L"), photos[0].convert("RGBA")):
        array = to_array(image)
        assert array.flags.c_contiguous and array.dtype == np.uint8
        assert array.shape == (
            (image.height, image.width)
            if image.mode == "L"
            else (image.height, image.width, 3 + (image.mode == "RGBA"))
        )
        back = from_array(array, "pil")
        assert back.mode == image.mode and back.tobytes() == image.tobytes()
    tensors = [
        T.PILToTensor()(photos[1]),
        T.ToTensor()(photos[1]),
        T.ToTensor()(photos[1]).permute(1, 2, 0),  # not contiguous
        torch.arange(12, dtype=torch.float64).reshape(3, 4)[:, ::2],
    ]
    for tensor in tensors:
        array = to_array(tensor)
        assert array.flags.c_contiguous
        assert torch.equal(from_array(array, "tensor"), tensor)
    read_only = to_array(tensors[0])
    read_only.flags.writeable = False
    assert torch.equal(from_array(read_only, "tensor"), tensors[0])


def test_arrays_refuse_what_does_not_round_trip(photos):
    with pytest.raises(PreprocessError, match="mode 'P'"):
        to_array(photos[0].convert("P"))
    with pytest.raises(PreprocessError, match="a list cannot be sent"):
        to_array([1, 2])
    with pytest.raises(PreprocessError, match="not an RGB, RGBA or L image"):
        from_array(np.zeros((4, 4, 3), dtype=np.float32), "pil")
    with pytest.raises(ConfigError, match="unknown kind"):
        from_array(np.zeros(3, dtype=np.uint8), "numpy")
