import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_global_seed():
    """Tests build their data from a fixed seed; gradpress itself never touches the global RNG."""
    torch.manual_seed(0)
    yield
