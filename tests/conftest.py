import os
from pathlib import Path

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


#: the files that take longest (seconds of their tests on 2 busy cores, ``pytest --durations=0``), longest
#: first: pytest-xdist's ``--dist loadfile`` hands out files in collection order, so starting these first
#: lets the two workers finish together instead of one running a long file alone at the end
LONGEST_FIRST = (
    "test_train.py", "test_runtime_dist.py", "test_kernel_cache.py", "test_hierarchy.py", "test_warmup.py",
    "test_faults_buckets.py", "test_exit.py", "test_readme.py", "test_integrations.py", "test_faults.py",
    "test_cli_errors.py", "test_fsdp.py", "test_advise.py", "test_powersgd.py", "test_properties.py",
    "test_auto.py", "test_partial.py", "test_empty_tensors.py", "test_agreement.py", "test_cltk.py",
)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file's tests keep their order


#: files whose tests read the one shared 2-process run of the README's examples and the frameworks
#: (``frameworks_harness.shared_run``, made once per process): one scope, so one worker makes that run
SHARING_THE_FRAMEWORKS_RUN = ("test_readme.py", "test_integrations.py", "test_frameworks.py")

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # the suite runs in one process without pytest-xdist
    pass
else:
    class _FilesSharingARun(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "the frameworks run" if Path(scope).name in SHARING_THE_FRAMEWORKS_RUN else scope

    def pytest_xdist_make_scheduler(config, log):
        """``--dist loadfile``, with :data:`SHARING_THE_FRAMEWORKS_RUN` as one file."""
        if config.getoption("dist") == "loadfile":
            return _FilesSharingARun(config, log)
        return None
