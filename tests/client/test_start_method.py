"""How transform workers start, without starting any: the start method, the forkserver's preload
list, and whether a wrapped folder needs workers at all."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import multiprocessing
import multiprocessing.forkserver
import sys
import types

import pytest
import torch
import torch.multiprocessing
from torchvision import transforms
from torchvision.datasets.folder import default_loader

from kspeed.client import KSpeedClient
from kspeed.client.folders import client_workers_needed
from kspeed.client.prep.offload import folder_pipeline
from kspeed.client.prep.start_method import installed, modules_of, script_modules, start_method, worker_context
from kspeed.client.prep.workers import Stages, pil_file_loader, preload_of, resolve_loader

needs_forkserver = pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="this platform has no forkserver"
)


def double(x):
    return 2 * x


def targets_only(items):
    return [target for _, target in items]


@pytest.fixture
def preload_list(monkeypatch):
    """The forkserver's preload list, restored after the test (it is global to the process)."""
    server = multiprocessing.forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", list(server._preload_modules))
    return server


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own (not installed), imported."""
    (tmp_path / "my_transforms.py").write_text("def flip(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_transforms", raising=False)
    module = importlib.import_module("my_transforms")
    yield module
    sys.modules.pop("my_transforms", None)


def test_forkserver_where_the_platform_has_one_else_spawn(monkeypatch, preload_list):
    available = "forkserver" in multiprocessing.get_all_start_methods()
    assert start_method() == ("forkserver" if available else "spawn")
    before = list(preload_list._preload_modules)
    monkeypatch.setattr(torch.multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    assert start_method() == "spawn"
    assert worker_context(["torch"]).get_start_method() == "spawn"
    assert preload_list._preload_modules == before  # no forkserver, nothing to preload


def test_installed_modules_are_the_standard_library_distributions_and_kspeed(user_module):
    assert installed("json") and installed("torch") and installed("torchvision.transforms.transforms")
    assert installed("kspeed.client.prep.workers") and installed("kspeed.preprocess.runner")
    assert not installed("my_transforms")  # the user's own: imported by each worker, with the script's sys.path
    assert not installed("sys")  # built into the interpreter: nothing to import
    assert not installed("a_module_nobody_imported")


def test_modules_of_are_what_unpickling_imports():
    compose = transforms.Compose([transforms.RandomResizedCrop(32), transforms.ToTensor()])
    assert "torchvision.transforms.transforms" in modules_of([compose])
    assert {"functools", __name__} <= modules_of([functools.partial(double)])
    # One that cannot be pickled raises nothing (check_picklable names it) and hides nothing after it.
    assert "torchvision.transforms.transforms" in modules_of([lambda x: x, compose])


def test_preload_of_names_torch_this_package_and_the_stages_libraries():
    compose = transforms.Compose([transforms.RandomResizedCrop(32), transforms.ToTensor()])
    folder = preload_of(Stages(loader=resolve_loader(default_loader), transform=compose))
    assert folder[:2] == ["torch", "kspeed.client.prep.workers"]
    assert {"torchvision.transforms.transforms", "PIL.Image", "torch.utils.data._utils.collate"} <= set(folder)
    pipeline, _ = folder_pipeline(pil_file_loader, compose)
    assert pipeline is not None
    offloaded = preload_of(Stages(None, pipeline=pipeline))
    assert {"torch", "kspeed.preprocess.runner", "torchvision.transforms"} <= set(offloaded)
    assert len(offloaded) == len(set(offloaded))


def test_script_modules_are_what_the_main_script_imported(monkeypatch):
    script = types.ModuleType("__main__")
    script.__file__ = "/somewhere/train.py"
    script.torch = torch
    script.KSpeedClient = KSpeedClient
    script.dumps = json.dumps
    script.double = double
    script.main = types.FunctionType(double.__code__, {})  # defined in the script itself
    script.main.__module__ = "__main__"
    script.epochs = 3
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert script_modules() == {"torch", "kspeed.client.client", "json", __name__}
    interactive = types.ModuleType("__main__")
    interactive.torch = torch
    monkeypatch.setitem(sys.modules, "__main__", interactive)
    assert script_modules() == set()  # no script: a worker imports nothing again
    package = types.ModuleType("__main__")  # python -m pytest: pytest/__main__.py, which workers skip
    package.__spec__ = importlib.util.find_spec("pytest.__main__")
    package.__file__ = package.__spec__.origin
    package.pytest = pytest
    monkeypatch.setitem(sys.modules, "__main__", package)
    assert script_modules() == set()


@needs_forkserver
def test_the_preload_list_gains_installed_modules_and_never_the_script(preload_list, user_module, monkeypatch):
    preload_list._preload_modules = ["__main__", "json"]  # multiprocessing's default, and one of the user's
    script = types.ModuleType("__main__")
    script.__file__ = "/somewhere/train.py"
    script.np = importlib.import_module("numpy")
    script.flip = user_module.flip
    monkeypatch.setitem(sys.modules, "__main__", script)
    wanted = ["torch", "torchvision.transforms", "kspeed.client.prep.workers", "my_transforms", "__mp_main__"]
    context = worker_context([*wanted, "a_module_nobody_imported"])
    assert context.get_start_method() == "forkserver"
    first = list(preload_list._preload_modules)
    assert first == ["json", "torch", "torchvision.transforms", "kspeed.client.prep.workers", "numpy"]
    # A second pool (a second wrap): the list only grows; a running server would keep its own.
    worker_context(["PIL.Image", "torch"])
    assert preload_list._preload_modules == [*first, "PIL.Image"]


def test_a_folder_needs_workers_unless_the_servers_run_every_stage():
    loader = resolve_loader(default_loader)
    to_tensor = Stages(
        loader=loader, transform=transforms.Compose([transforms.RandomResizedCrop(32), transforms.ToTensor()])
    )
    uint8 = Stages(
        loader=loader, transform=transforms.Compose([transforms.RandomResizedCrop(32), transforms.PILToTensor()])
    )
    client_part, _ = folder_pipeline(loader, to_tensor.transform)
    servers_only, _ = folder_pipeline(loader, uint8.transform)
    assert client_part is not None and servers_only is not None
    assert client_workers_needed(uint8, None, offload=None)  # not offloaded: the client runs it all
    assert client_workers_needed(to_tensor, client_part, offload=None)  # ToTensor stays on the client
    assert not client_workers_needed(uint8, servers_only, offload=None)  # only collation is left: in-process
    assert not client_workers_needed(uint8, servers_only, offload=1.0)
    assert client_workers_needed(uint8, servers_only, offload=0.5)  # half the samples prepared here
    custom = Stages(loader=loader, transform=uint8.transform, collate_fn=targets_only)
    assert client_workers_needed(custom, servers_only, offload=None)
