"""Import-only stand-in for torchvision (see feather_sched/integrations/sglang/stand_ins/README.md).

Every ``torchvision.*`` submodule imports as an empty module whose attributes raise
when used.
"""

import importlib.abc
import importlib.machinery
import sys

from torchvision._unavailable import module_getattr as __getattr__


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__getattr__ = __getattr__
        module.__path__ = []


sys.meta_path.insert(0, _StandInFinder())
