"""Compile progress: numba compiles inside a warm-up are counted, drawn on a terminal, logged, and a
cold warm-up's count becomes the next start's total; a start whose kernels are cached says nothing."""
import io
import json
import logging
import os
import subprocess
import sys

import numpy as np

from freetoken.kernels import compile_watch
from freetoken.kernels._numba import SERIAL, njit


def _fresh_kernel():
    """A kernel no other test compiled (no disk cache: each call of this makes a new one)."""
    @njit(**{**SERIAL, "cache": False})
    def twice(x):
        return x * 2
    return twice


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_compile_is_counted_logged_drawn_and_remembered(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    kernel, tty = _fresh_kernel(), Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    log = logging.getLogger("compile-watch-test")
    with caplog.at_level(logging.INFO, logger="compile-watch-test"):
        with compile_watch.watch_compiles(log, "test/kind") as progress:
            assert kernel(np.float32(2)) == 4
    assert progress.done >= 1 and "twice" in progress.current
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "compiling the CPU kernels" in text and f"compiled {progress.done} kernels" in text
    assert "compiling kernels [" in tty.getvalue() and f"{progress.done}/" in tty.getvalue()
    counts = json.loads((tmp_path / "compile_counts.json").read_text())
    assert counts["test/kind"] == progress.done               # a cold block: the next total
    assert compile_watch.expected("test/kind") == progress.done


def test_nothing_compiled_means_nothing_said_and_nothing_recorded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    kernel = _fresh_kernel()
    kernel(np.float32(1))                                      # compiled before the block
    with caplog.at_level(logging.INFO, logger="compile-watch-test"):
        with compile_watch.watch_compiles(logging.getLogger("compile-watch-test"), "test/kind") as progress:
            kernel(np.float32(3))
    assert progress.done == 0 and not caplog.records
    assert not (tmp_path / "compile_counts.json").exists()
    assert compile_watch.expected("moe/bf16") == compile_watch.ESTIMATES["moe/bf16"]


def test_an_unwritable_home_is_not_an_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "file" / "home"))   # even root cannot mkdir it
    compile_watch.remember("test/kind", 3)                    # best effort: no exception
    assert compile_watch.expected("test/kind") == 0


def test_first_start_through_the_cli_shows_the_compile(tmp_path):
    """A cold numba cache (a fresh install): the CLI logs the compile and its count, records it,
    and the next start loads everything from the cache without a word about compiling."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "FREETOKEN_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "freetoken", "--log-level", "INFO", "generate", "--model", "synth:tiny",
           "--prompt", "x", "--max-tokens", "2", "--ignore-eos"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "compiling the CPU kernels" in first.stderr and "compiled " in first.stderr
    counts = json.loads((tmp_path / "home" / "compile_counts.json").read_text())
    assert counts["moe/bf16"] > 10
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compil" not in again.stderr
