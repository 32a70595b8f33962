"""Test-only import shim, put on PYTHONPATH for child processes by tests/conftest.py.

The only torchvision wheels these machines can install beside the CPU torch 2.13 are CUDA builds whose
C++ ops fail to register ("operator torchvision::nms does not exist"), which breaks `import timm` and
transformers' vision imports. Stubbing torchvision's two registration modules lets torchvision import
(its C++ ops stay unusable, and nothing here needs them). See docs/testing.md.
"""

import sys
import types

for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
