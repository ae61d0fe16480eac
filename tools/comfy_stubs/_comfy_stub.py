"""Import stand-ins for packages ComfyUI imports at module level but the native bench path never calls.

Only ``tools/unpack_comfyui.py`` puts this folder on ``PYTHONPATH``, on a machine without those packages (the
offline GPU machine, docs/benchmarks.md: "ComfyUI on the offline GPU machine"); the pack never imports it. A stand-in
package imports, and so does any of its submodules; any name read from it is a placeholder that raises ImportError
naming the missing package the moment it is called, used as a base class and instantiated, or iterated. Dunder
names are absent (``hasattr(pkg, "__version__")`` is False), so feature checks see no package.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED: dict = {}          # root package name -> why it is stubbed


def _error(name: str) -> ImportError:
    root = name.split(".")[0]
    return ImportError(f"{name}: {root} is not installed here; tools/comfy_stubs stands in for it only so that "
                       f"ComfyUI's modules import ({STUBBED.get(root, 'not needed on the native bench path')})")


class Missing:
    """Any attribute of a stand-in module: fails, naming the package, when it is used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise _error(self._name)

    def __iter__(self):
        raise _error(self._name)

    def __mro_entries__(self, bases):
        name = self._name

        class MissingBase:
            def __init__(self, *args, **kwargs):
                raise _error(name)

            def __init_subclass__(cls, **kwargs):
                pass
        MissingBase.__qualname__ = MissingBase.__name__ = name.rsplit(".", 1)[-1]
        return (MissingBase,)

    def __repr__(self) -> str:
        return f"<stand-in for {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{module_name}.{attr}")
    return __getattr__


def _fill(module: types.ModuleType) -> None:
    module.__path__ = []                      # a package: its submodules come from the finder below
    module.__getattr__ = _module_getattr(module.__name__)
    module.__wan_accel_stub__ = True


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        _fill(module)


_FINDER = _Finder()


def stub_package(module_name: str, why: str) -> None:
    """Make the package ``module_name`` (being imported) a stand-in: called from its ``__init__.py``."""
    STUBBED[module_name] = why
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    _fill(sys.modules[module_name])
