"""Imported first by the `python -S` loader scripts beside it: make `hf_latentlm` unimportable and add the
interpreter's site-packages folders (passed on the command line) without processing .pth files, so that the editable
install's finder is not installed either. What then loads must be the checkpoint's own code."""

import importlib.abc
import sys


class BlockPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_latentlm" or name.startswith("hf_latentlm."):
            raise ImportError("hf_latentlm is deliberately not importable here")


def block_package(purelib: str, platlib: str) -> None:
    sys.meta_path.insert(0, BlockPackage())
    sys.path += [p for p in (purelib, platlib) if p not in sys.path]


def assert_package_not_loaded() -> None:
    assert not [m for m in sys.modules if m.startswith("hf_latentlm")]
