"""Test set-up shared by the whole suite.

* 8 fake CPU devices for JAX meshes: XLA reads XLA_FLAGS when jax is first imported, so it is set here,
  before any test module imports jax (a GPU machine still gets its GPUs as the default backend).
* ``@pytest.mark.gpu`` tests are skipped where CUDA is not available (CI has no GPU).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
