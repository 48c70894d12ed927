"""Getting a dataset's source onto this machine and checking it (see :mod:`gradpress.testbed.data`):
Debian packages through apt-get (only as root), and sha256 checksums of what was fetched."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from gradpress.testbed.data.dataset import DataUnavailable, Say, quiet


def ensure_debian_package(package: str, path: Path, install: bool = True, say: Say = quiet) -> None:
    """Make ``path`` exist by installing Debian's ``package`` with apt-get (only as root)."""
    if path.exists():
        return
    how = f"install it with `sudo apt-get install -y {package}` (or run `gradpress data` as root)"
    if not install:
        raise DataUnavailable(f"{path} is missing: it comes with Debian's {package!r} package; {how}")
    if os.geteuid() != 0:
        raise DataUnavailable(f"{path} is missing and only root can install Debian's {package!r} package: "
                              f"{how}")
    if shutil.which("apt-get") is None:
        raise DataUnavailable(f"{path} is missing and this machine has no apt-get to install "
                              f"{package!r} with")
    say(f"installing Debian package {package} (apt-get install -y {package})")
    done = _apt("install", "-y", package)
    if done.returncode != 0:
        say("apt-get could not install it; running apt-get update and trying again")
        _apt("update")
        done = _apt("install", "-y", package)
    if done.returncode != 0 or not path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise DataUnavailable(f"apt-get install -y {package} did not provide {path}:\n{tail}")


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env, check=False)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(data: bytes, expected: str, where: str) -> None:
    if sha256(data) != expected:
        raise DataUnavailable(f"{where} has sha256 {sha256(data)}, expected {expected}: the file is not the "
                              "dataset gradpress was built for (corrupt or a different version)")
