"""Build hooks only (the package is described in pyproject.toml): the CUDA sources live in the
repo-root cuda/, outside the package, so build_py copies them into the built package as
freetoken/_cuda_src/ (where freetoken/kernels/_cuda.py looks in an installed wheel), and sdist
carries them so a wheel built from the sdist gets them too."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
PATTERNS = ("*.cu", "*.cuh", "launch_limits.json")


def cuda_sources():
    found = sorted(p for pattern in PATTERNS for p in (ROOT / "cuda").glob(pattern))
    if not found:
        raise RuntimeError(f"no CUDA sources in {ROOT / 'cuda'}: the wheel would not run on a GPU")
    return found


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        dst = Path(self.build_lib) / "freetoken" / "_cuda_src"
        dst.mkdir(parents=True, exist_ok=True)
        for src in cuda_sources():
            shutil.copy2(src, dst / src.name)


class SdistWithCuda(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dst = Path(base_dir) / "cuda"
        dst.mkdir(exist_ok=True)
        for src in cuda_sources():
            shutil.copy2(src, dst / src.name)


setup(cmdclass={"build_py": BuildPyWithCuda, "sdist": SdistWithCuda})
