"""The public API: ``batchline.__all__`` is complete and importable; the error tree."""

from __future__ import annotations

import importlib
import inspect
import types
from typing import TypeVar

import pytest

import batchline
import batchline.aio
import batchline.aio.inference
import batchline.errors
import batchline.generation
import batchline.inference

PUBLIC_MODULES = [
    batchline,
    batchline.aio,
    batchline.inference,
    batchline.aio.inference,
    batchline.generation,
]


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
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
