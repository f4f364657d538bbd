"""Every module imports: a name moved between modules in a merge fails here, not in the one
command that happens to use it (the layout test reads imports statically and checks no names)."""

from __future__ import annotations

import importlib

import pytest
from repo.test_layout import module_files


# `__main__` runs the command line when imported.
@pytest.mark.parametrize("name", sorted(set(module_files()) - {"kvstack.__main__"}))
def test_module_imports(name: str) -> None:
    importlib.import_module(name)
