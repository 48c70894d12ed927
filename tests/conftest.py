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


@pytest.fixture(autouse=True)
def _terminal_width_of_a_pipe(monkeypatch):
    """The CLI's output as it is to a pipe or a file (pytest-xdist's workers set COLUMNS=80, which the
    CLI's tables, 200 columns wide off a terminal, take as the user's choice)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    yield
