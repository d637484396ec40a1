"""The public API: ``batchline.__all__`` and the service modules' ``__all__`` are complete,
importable and free of private names; the error tree."""

from __future__ import annotations

import importlib
import inspect
import types
from pathlib import Path
from typing import TypeVar

import pytest

import batchline
import batchline.acl
import batchline.aio
import batchline.aio.inference
import batchline.codec
import batchline.config
import batchline.core
import batchline.errors
import batchline.generation
import batchline.inference
import batchline.keys
import batchline.producer
import batchline.worker

PUBLIC_MODULES = [
    batchline,
    batchline.aio,
    batchline.inference,
    batchline.aio.inference,
    batchline.generation,
]

#: The service half and the core: what web backends, workers and other clients import.
SERVICE_MODULES = [
    batchline.producer,
    batchline.worker,
    batchline.core,
    batchline.codec,
    batchline.config,
    batchline.keys,
    batchline.acl,
]


@pytest.mark.parametrize("module", PUBLIC_MODULES + SERVICE_MODULES, ids=lambda m: m.__name__)
def test_every_name_in_all_resolves(module: types.ModuleType) -> None:
    assert len(module.__all__) == len(set(module.__all__)), "no duplicates"
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"
    namespace: dict[str, object] = {}
    exec(f"from {module.__name__} import *", namespace)  # noqa: S102
    assert set(module.__all__) <= set(namespace)


def _helper(name: str, value: object, module: types.ModuleType) -> bool:
    """Names a module has without meaning to export them."""
    if inspect.ismodule(value):
        # Submodules become attributes as a side effect of importing them; they are public
        # only where __all__ says so (batchline.aio, batchline.inference).
        return name not in module.__all__
    if isinstance(value, TypeVar) or name == "annotations":  # from __future__ import
        return True
    return getattr(value, "__module__", None) in ("typing", "collections.abc")


def test_all_is_complete() -> None:
    public = {
        name
        for name, value in vars(batchline).items()
        if not name.startswith("_") and not _helper(name, value, batchline)
    }
    missing = sorted(public - set(batchline.__all__))
    assert not missing, f"public but not in batchline.__all__: {missing}"


def _defined_in(value: object, module: types.ModuleType) -> bool:
    """Whether ``value`` comes from ``module`` (or, for a package, one of its submodules),
    rather than being imported from elsewhere; constants (no ``__module__``) count."""
    home = getattr(value, "__module__", None)
    if home is None or isinstance(value, str | int | float | bytes | frozenset):
        return True
    name = module.__name__
    return home == name or (hasattr(module, "__path__") and home.startswith(name + "."))


@pytest.mark.parametrize("module", SERVICE_MODULES, ids=lambda m: m.__name__)
def test_service_module_exports_exactly_its_public_names(module: types.ModuleType) -> None:
    exported = set(module.__all__)
    private = sorted(name for name in exported if name.startswith("_"))
    assert not private, f"{module.__name__}.__all__ exports private names: {private}"
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)  # submodules: public by their own name only
        and not _helper(name, value, module)
        and _defined_in(value, module)
    }
    missing = sorted(public - exported)
    assert not missing, f"public in {module.__name__} but not in its __all__: {missing}"


@pytest.mark.parametrize("module", SERVICE_MODULES, ids=lambda m: m.__name__)
def test_service_exports_come_from_no_private_top_level_module(module: types.ModuleType) -> None:
    # A package re-exports from its own private submodules (batchline.codec._results); what
    # it exports never lives in a private module of another part (batchline._redis, say),
    # which users could not then import by a public path.
    for name in module.__all__:
        value = getattr(module, name)
        if _defined_in(value, module) or value.__module__ == "typing":  # a type alias
            continue
        parts = str(value.__module__).split(".")
        public_homes = [
            ".".join(parts[:i])
            for i in range(1, len(parts) + 1)
            if not any(p.startswith("_") for p in parts[:i])
        ]
        assert any(
            getattr(importlib.import_module(home), name, None) is value for home in public_homes
        ), f"{module.__name__}.{name} comes from the private module {value.__module__}"


def test_wire_helpers_are_private() -> None:
    # docs/protocol.md is the contract; the worker's and producer's own helpers are not.
    for name in ("decode_requests", "salvage_id", "result_fields", "result_map"):
        assert not hasattr(batchline.codec, name), f"batchline.codec.{name} should be private"
        assert name not in batchline.codec.__all__


def test_each_module_has_one_import_name() -> None:
    """No module re-exports another module whole (``from x import *``): each has one path."""
    package = Path(batchline.__file__).parent
    shims = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "import *" in path.read_text(encoding="utf-8")
    ]
    assert not shims, f"modules re-exporting another module whole: {shims}"


def test_public_names_are_reexported_from_their_home() -> None:
    for name in batchline.__all__:
        value = getattr(batchline, name)
        if inspect.ismodule(value):
            assert importlib.import_module(f"batchline.{name}") is value


def test_version() -> None:
    assert isinstance(batchline.__version__, str)
    assert batchline.__version__.count(".") >= 2


ERRORS = [
    getattr(batchline.errors, name) for name in batchline.errors.__all__ if name != "BatchlineError"
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
def test_every_error_subclasses_batchline_error(error: type[Exception]) -> None:
    assert issubclass(error, batchline.BatchlineError)
    assert getattr(batchline, error.__name__) is error, "exported from the top level"


def test_error_tree_matches_the_builtins_it_promises() -> None:
    assert issubclass(batchline.BatchlineError, Exception)
    assert issubclass(batchline.RequestTimeout, TimeoutError)
    assert issubclass(batchline.RequestExpired, batchline.RequestTimeout)
    assert issubclass(batchline.ItemTooLarge, ValueError)
    for error in (batchline.QueueFull, batchline.BatcherClosed, batchline.BatchFunctionError):
        assert not issubclass(error, TimeoutError | ValueError)


def test_inference_error_carries_the_remote_type_and_message() -> None:
    err = batchline.InferenceError("ValueError", "bad shape")
    assert err.error_type == "ValueError"
    assert err.error_message == "bad shape"
    assert str(err) == "ValueError: bad shape"
