"""Test set-up shared by the whole suite.

* 8 fake CPU devices for JAX meshes: XLA reads XLA_FLAGS when jax is first imported, so it is set here,
  before any test module imports jax (a GPU machine still gets its GPUs as the default backend).
* ``@pytest.mark.gpu`` tests are skipped where CUDA is not available (CI has no GPU), and there Triton
  kernels run under the interpreter (``TRITON_INTERPRET=1``).
* ``seed``: a fresh random seed each test, torch seeded with it (the test prints it where it fails); a module may
  define its own (e.g. one an environment variable fixes).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import secrets  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def _cuda_available() -> bool:
    return torch.cuda.is_available()


# Without a GPU, Triton kernels run on CPU tensors under the interpreter; Triton reads the variable when it is
# first imported, which is after this (no test module has been imported yet).
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    value = secrets.randbelow(2**31)
    torch.manual_seed(value)
    return value
