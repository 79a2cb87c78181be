"""GPU kernel tests: every fast op against its torch reference on identical inputs. They need CUDA
(`pytest -m gpu tests/kernels`); test_interpret.py checks the same kernels' logic on the CPU under
Triton's interpreter."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
