import os

import pytest
import torch

# Hypothesis profile: CI runs on 2 cores; keep example counts modest but non-trivial.
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cache entries or recompile counts leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
