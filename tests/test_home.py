"""An app run under a UID whose HOME it cannot write gets a private one (a MAP run as any host user)."""

from __future__ import annotations

import os
from pathlib import Path

from medserve.home import ensure_writable_home
from tests.conftest import run_unprivileged


def test_a_writable_home_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    ensure_writable_home()
    assert os.environ["HOME"] == str(tmp_path)


def test_a_home_that_does_not_exist_is_replaced_by_a_private_writable_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "absent"))
    ensure_writable_home()
    home = Path(os.environ["HOME"])
    assert home != tmp_path / "absent" and home.is_dir() and os.access(home, os.W_OK)
    assert home.stat().st_mode & 0o077 == 0  # private: mkdtemp's 0700


def test_a_home_without_write_permission_is_replaced_and_removed_at_exit(tmp_path):
    read_only = tmp_path / "home"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    result = run_unprivileged(
        f"import os; os.environ['HOME'] = {str(read_only)!r}; from medserve.home import ensure_writable_home; "
        "ensure_writable_home(); home = os.environ['HOME']; open(os.path.join(home, 'cache'), 'w').close(); "
        "print(home)")
    assert result.returncode == 0, result.stderr
    replaced = Path(result.stdout.strip())
    assert replaced != read_only and replaced.name.startswith("medserve-home-")
    assert not replaced.exists()  # removed when the process ended
