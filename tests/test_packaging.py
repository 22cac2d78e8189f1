"""A non-editable wheel carries the CUDA sources (as freetoken/_cuda_src/, where the loader looks
in an installed package) and the demo model. Built from a copy of the tree, so the checkout gets
no build/ or egg-info from it."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = "freetoken/data/tiny-agent-moe"


def _isolation_flags():
    """Build in this environment when its setuptools can make wheels (has bdist_wheel: >= 70.1,
    or the wheel package); else let pip fetch pyproject's build requirements (needs PyPI)."""
    import setuptools
    try:
        import wheel  # noqa: F401
        return ["--no-build-isolation"]
    except ImportError:
        pass
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) else []


def _copy_tree(dst: Path):
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc", "_cuda_src")
    for name in ("freetoken", "cuda"):
        shutil.copytree(ROOT / name, dst / name, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)


@pytest.mark.slow
def test_wheel_has_cuda_sources_and_demo_model(tmp_path):
    src, out = tmp_path / "src", tmp_path / "wheels"
    _copy_tree(src)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *_isolation_flags(), str(src), "-w", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel_path,) = out.glob("freetoken-*.whl")
    names = set(zipfile.ZipFile(wheel_path).namelist())
    for cu in sorted((ROOT / "cuda").glob("*.cu*")):
        assert f"freetoken/_cuda_src/{cu.name}" in names, cu.name
    for f in sorted((ROOT / DEMO).iterdir()):
        assert f"{DEMO}/{f.name}" in names, f.name
    assert "freetoken/kernels/_cuda.py" in names
    assert not any(n.endswith((".nbi", ".nbc")) for n in names)
    _loader_finds_installed_sources(wheel_path, tmp_path)


def _loader_finds_installed_sources(wheel_path, tmp_path):
    """Installed (not editable) and imported from elsewhere, _cuda.cuda_dir() is the wheel's copy."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel_path) as z:     # what pip install --target would lay down
        z.extractall(site)
    code = "from freetoken.kernels import _cuda; print(_cuda.cuda_dir())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == site / "freetoken" / "_cuda_src"
