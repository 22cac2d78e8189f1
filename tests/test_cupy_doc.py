"""docs/cupy.md's examples, run: its python blocks in order in one namespace on the device, each
held to the numpy `ref` ops by its own asserts, and its `kernel --check` lines through the CLI.
The gpu ones run in CI's emulated step; the plain run checks that the page still has them."""
import re
import shlex
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cupy.md"
KERNEL = "python -m freetoken kernel "


def _blocks(lang: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of each ```lang block."""
    text = PAGE.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)]


def _kernel_commands() -> list[list[str]]:
    """The page's `python -m freetoken kernel ...` lines as CLI arguments (after `freetoken`)."""
    lines = [line.split("#")[0].strip()
             for _, code in _blocks("bash") for line in code.splitlines()]
    return [shlex.split(line[line.index(KERNEL) + len("python -m freetoken "):])
            for line in lines if KERNEL in line]


def _run_blocks(blocks) -> dict:
    # leading newlines: a traceback names the block's own line in docs/cupy.md
    ns = {"__name__": "cupy_doc"}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(PAGE), "exec"), ns)
    return ns


def test_page_has_its_examples():
    blocks = _blocks("python")
    assert len(blocks) >= 4, f"{PAGE.name}: {len(blocks)} python blocks; the page has 4"
    for line, code in blocks:      # every example checks itself against the spec
        assert "assert" in code and "ref(" in code, f"{PAGE.name}:{line}: a block lacks its check"
    commands = _kernel_commands()
    assert commands and all("--check" in c for c in commands), commands
    assert "from freetoken.cupy_loader import cupy" in blocks[0][1]


@pytest.mark.gpu
def test_python_blocks_match_ref():
    ns = _run_blocks(_blocks("python"))
    assert ns["moe"].pool is None, "the MoE example must close its runtime"


@pytest.mark.gpu
def test_a_wrong_kernel_fails_the_page(monkeypatch):
    """The examples' asserts bite: rms_norm's gpu version off by 1% fails the first block."""
    from freetoken.kernels import rms_norm
    real = rms_norm.gpu

    def off(x, w, eps, out):
        real(x, w, eps, out)
        out *= 1.01
        return out
    monkeypatch.setattr(rms_norm, "gpu", off)
    with pytest.raises(AssertionError):
        _run_blocks(_blocks("python")[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("args", _kernel_commands(), ids=" ".join)
def test_kernel_check_lines_pass(args, capsys):
    from freetoken.cli import main
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ".gpu (" in out and "PASS" in out and "FAIL" not in out, out
