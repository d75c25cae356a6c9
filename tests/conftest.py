import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def cuda_only(reason: str = "needs a CUDA GPU; this machine has none"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)
