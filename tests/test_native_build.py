"""The native kernels' build: a process killed while loading them does not hang the next one."""

import subprocess
import sys

import pytest

from draftsmith.engine.native import native_available

SCRIPT = """
from pathlib import Path
from torch.utils import cpp_extension
from draftsmith.engine import native
name, _ = native.build_flags(native._capability(), native._bf16_dot())
lock = Path(cpp_extension._get_build_directory(name, False)) / "lock"
lock.touch()  # what torch's loader leaves behind when its process is killed mid-load
print(native.native_available(), lock.exists())
"""


@pytest.mark.skipif(not native_available(), reason="native kernels unavailable here (no compiler or turned off)")
def test_a_stale_lock_left_by_a_killed_load_is_removed_not_waited_on():
    # torch waits on that file forever; the load must finish and remove it
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], out.stdout
    assert "left by a process killed" in out.stderr


def test_the_build_runs_the_environments_own_ninja_first_and_restores_path(tmp_path, monkeypatch):
    """torch runs `ninja` from PATH: the build puts the interpreter's folder (where setup.sh installs ninja) first,
    also when the environment is not activated, and gives PATH back afterwards."""
    from torch.utils import cpp_extension

    from draftsmith.engine import native

    env_bin = tmp_path / "venv" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "ninja").write_text("")
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(native.os.environ["PATH"]))
    native._build("AVX2", False)
    assert seen == [f"{env_bin}:/usr/bin:/bin"]
    assert native.os.environ["PATH"] == "/usr/bin:/bin"
    (env_bin / "ninja").unlink()  # no ninja of its own: PATH as it was
    native._build("AVX2", False)
    assert seen[-1] == "/usr/bin:/bin"
