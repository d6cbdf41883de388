"""How transform worker processes start: forked from a forkserver that has imported what they need,
or spawned where the platform has no forkserver.

A worker forked from the training process would inherit the client's gRPC channels and receive
ring, which do not survive ``fork``. A spawned worker starts a new interpreter that imports torch
(seconds) before its first batch. multiprocessing's forkserver is a process started once per
training process, from a new interpreter (no thread or channel of the caller's in it): it imports
the modules named in its preload list once, and then forks every worker from that state, which
costs milliseconds.

The forkserver and its preload list are global to the process: the list is read when the server
starts, by the first pool to start one, and later pools share that server (their other modules are
imported by each worker). :func:`worker_context` adds to the list and never removes from it, except
``__main__``: the training script's top level would run in a process that outlives the dataset and
forks every later worker. Each worker imports the script itself after the fork, as a spawned one
does (:mod:`kspeed.client.main_guard`), so the modules the script imported are preloaded too
(:func:`script_modules`). The server stays up, idle, until the training process exits.

Only installed modules are preloaded (the standard library, ``site-packages``/``dist-packages`` and
KSpeed): the server imports them with neither the script's ``sys.argv`` nor its ``sys.path``, so
the user's own modules are imported by each worker, after multiprocessing has set both up.
"""

from __future__ import annotations

import io
import logging
import multiprocessing.forkserver
import os
import pickle
import sys
import sysconfig
import types
from collections.abc import Iterable
from multiprocessing.context import BaseContext
from typing import Any

import torch.multiprocessing

__all__ = ["FORKSERVER", "SPAWN", "installed", "modules_of", "script_modules", "start_method", "worker_context"]

log = logging.getLogger(__name__)

FORKSERVER = "forkserver"
SPAWN = "spawn"
#: Module names that are never preloaded: the training script (see the module docstring).
_MAIN = frozenset({"__main__", "__mp_main__"})
_INSTALLED_DIRS = frozenset({"site-packages", "dist-packages"})


def start_method() -> str:
    """``"forkserver"`` where the platform has one (Linux, macOS), else ``"spawn"``."""
    return FORKSERVER if FORKSERVER in torch.multiprocessing.get_all_start_methods() else SPAWN


def _stdlib() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.join(os.path.realpath(paths[key]), "") for key in ("stdlib", "platstdlib") if key in paths)


def installed(name: str) -> bool:
    """Whether ``name`` is an imported module of the standard library, of an installed distribution
    (under ``site-packages`` or ``dist-packages``) or of KSpeed: one that imports the same in any
    process of this interpreter."""
    if name.split(".", 1)[0] == "kspeed":
        return True
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False  # built into the interpreter, a namespace package, or not imported here
    path = os.path.realpath(path)
    return path.startswith(_stdlib()) or not _INSTALLED_DIRS.isdisjoint(path.split(os.sep))


def _module_of(value: Any) -> str | None:
    if isinstance(value, types.ModuleType):
        return value.__name__
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        module = getattr(value, "__module__", None)
        return module if isinstance(module, str) else None
    return None


class _ModuleFinder(pickle.Pickler):
    """Pickles into nothing, noting the module of every class and function met on the way: what
    unpickling imports."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()

    def persistent_id(self, obj: Any) -> None:
        module = _module_of(obj)
        if module is not None:
            self.modules.add(module)
        return None  # pickled as usual


def modules_of(objects: Iterable[Any]) -> set[str]:
    """The modules that unpickling ``objects`` imports: those of every class and function they
    reach, e.g. ``torchvision.transforms.transforms`` for a ``Compose`` of its transforms.

    An object that cannot be pickled is passed over (:func:`~kspeed.client.prep.workers.check_picklable` names it).
    """
    finder = _ModuleFinder()
    for obj in objects:
        try:
            finder.dump(obj)
        except Exception as exc:
            log.debug("modules of %r not found: %s", obj, exc)
    return finder.modules


def _imported_again(main: Any) -> bool:
    """Whether a worker imports ``main`` again, as multiprocessing's preparation decides: a script or
    a module run with ``-m``, but no package's ``__main__`` and no interactive session."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


def script_modules() -> set[str]:
    """The modules whose modules, classes or functions the main script holds at its top level
    (``import torch``, ``from kspeed import KSpeedClient``): a worker imports the script again, and
    them with it. None when workers do not import it (an interactive session, ``python -c``, a
    package's ``__main__``)."""
    main = sys.modules.get("__main__")
    if not _imported_again(main):
        return set()
    names = {_module_of(value) for value in list(vars(main).values())}
    return {name for name in names if name is not None and name not in _MAIN}


def worker_context(preload: Iterable[str]) -> BaseContext:
    """The multiprocessing context workers start with; with a forkserver, ``preload`` and the
    :func:`script_modules` (the installed ones among them, see :func:`installed`) are added to what
    it imports when it starts.

    The list only takes effect if the server is not running yet: a server started earlier (by a
    previous pool, or by the training script) keeps its own, and each worker imports the rest.
    """
    method = start_method()
    context = torch.multiprocessing.get_context(method)
    if method != FORKSERVER:
        return context
    candidates = [*preload, *sorted(script_modules())]
    wanted = [name for name in dict.fromkeys(candidates) if name not in _MAIN and installed(name)]
    # multiprocessing has no getter for the list (its default is ["__main__"]).
    current = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_preload_modules", None) or []
    modules = [name for name in dict.fromkeys([*current, *wanted]) if name not in _MAIN]
    context.set_forkserver_preload(modules)
    log.debug("transform workers start from the forkserver (preload: %s)", ", ".join(modules))
    return context
