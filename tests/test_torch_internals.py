"""The registry of private torch names: every entry is there in the pinned torch, and a missing one
costs its feature after one warning, never the job."""

from __future__ import annotations

import importlib
import logging

import pytest

from warmstart import torch_internals, torch_support


def test_every_private_name_resolves_on_the_pinned_torch():
    version = torch_support.torch_version()
    assert version is not None
    checked_here = [
        name
        for name, internal in torch_internals.INTERNALS.items()
        if torch_support.is_checked(version, internal.checked)
    ]
    assert checked_here, f"no entry was checked on torch {version}"
    assert [name for name in checked_here if torch_internals.resolve(name) is None] == []


def test_every_module_name_listed_is_a_private_torch_module():
    names = (*torch_internals.COMPILE_ENTRY_MODULES, *(i.module for i in torch_internals.INTERNALS.values()))
    assert all(name.split(".")[0] == "torch" for name in names)
    for name in torch_internals.COMPILE_ENTRY_MODULES:
        importlib.import_module(name)


@pytest.fixture
def missing_entry(monkeypatch):
    torch_internals.reset()
    real = torch_internals.INTERNALS["tree_map"]
    monkeypatch.setitem(
        torch_internals.INTERNALS,
        "tree_map",
        torch_internals.Internal(real.module, "tree_map_that_is_not_there", real.without),
    )
    yield "tree_map"
    torch_internals.reset()


def test_a_missing_name_degrades_with_one_warning(missing_entry, caplog):
    caplog.set_level(logging.DEBUG, logger="warmstart.cache")
    assert torch_internals.resolve(missing_entry) is None
    assert torch_internals.resolve(missing_entry) is None
    with pytest.raises(torch_internals.MissingTorchInternal, match="tree_map_that_is_not_there"):
        torch_internals.require(missing_entry)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "torch.utils._pytree.tree_map_that_is_not_there" in message
    assert torch_internals.INTERNALS[missing_entry].without in message
    assert not isinstance(torch_internals.MissingTorchInternal(), (AttributeError, ImportError))


def test_a_missing_module_degrades_too(monkeypatch, caplog):
    torch_internals.reset()
    monkeypatch.setitem(
        torch_internals.INTERNALS, "funcname_cache", torch_internals.Internal("torch._no_such_module", None, "nothing")
    )
    caplog.set_level(logging.WARNING, logger="warmstart.cache")
    assert torch_internals.missing(["funcname_cache", "funcname_cache"]) == ["funcname_cache", "funcname_cache"]
    assert len(caplog.records) == 1
    torch_internals.reset()
