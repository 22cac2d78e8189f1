"""``launch HARNESS [-- ARGS]``: run an agent harness (Claude Code, Codex CLI, opencode, aider)
against a FreeToken server. A server already answering at --server (default: the --host/--port
of the serve flags) is reused; else one is started with the serve flags given here, its log going
to a file, and stopped when the harness exits. The harness gets the settings of
freetoken/harnesses.py, one line says what was set, and its exit code becomes ours. Ctrl-C goes
to the harness (it shares the terminal); the launcher waits for it and then cleans up.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from freetoken.flags import add_config_flags, config_from_args

START_TIMEOUT_S = 900     # a first start compiles the kernels (about a minute) and may build a model


def register(sub) -> None:
    from freetoken.config import EngineConfig
    from freetoken.harnesses import HARNESSES
    from freetoken.server.config import ServerConfig
    p = sub.add_parser("launch", help="run Claude Code, Codex CLI, opencode or aider against a FreeToken server",
                       description="Run an agent harness against a FreeToken server: reuses one answering at "
                                   "--server or starts one with the serve flags below (stopped afterwards). "
                                   "Arguments after -- go to the harness.")
    p.add_argument("harness", choices=sorted(HARNESSES), help="which harness to run")
    p.add_argument("--server", default=None, help="URL of a running server (default: http://HOST:PORT of the "
                                                  "serve flags; started there when nothing answers)")
    p.add_argument("--bin", default=None, help="the harness program (default: found on PATH)")
    p.add_argument("--dry-run", action="store_true", help="print what would be set and run, start nothing")
    add_config_flags(p, ServerConfig)
    add_config_flags(p, EngineConfig)
    p.set_defaults(run=run, passthrough=[])      # the harness's arguments: everything after --


def run(args) -> int:
    from freetoken.harnesses import HARNESSES
    harness = HARNESSES[args.harness]
    program = args.bin or shutil.which(harness.program)
    if program is None and not args.dry_run:
        print(f"launch: {harness.program} is not installed (or not on PATH); install it with: {harness.install}",
              file=sys.stderr)
        return 127
    url = (args.server or f"http://{_connect_host(args.host)}:{args.port}").rstrip("/")
    server = None
    if _healthy(url) is None and not args.dry_run:
        if args.server:
            print(f"launch: no FreeToken server answers at {url}", file=sys.stderr)
            return 1
        server = _start_server(args, url)
    try:
        return _run_harness(harness, program or harness.program, url, args)
    finally:
        if server is not None:
            server.stop()


def _run_harness(harness, program: str, url: str, args) -> int:
    from freetoken.harnesses import QUIET, Target
    if _healthy(url) is not None:
        target = _target(url, args)
    else:                        # a dry run with no server: what the serve flags say
        from freetoken.models.demo import BUILTIN, DEMO_NAME
        model = BUILTIN.get(args.model, args.model or DEMO_NAME)         # a built-in by its short name
        target = Target(url, args.served_model_name or Path(model).name,
                        args.max_model_len or 2048, args.api_key or "freetoken")
    home = Path(tempfile.mkdtemp(prefix=f"freetoken-{harness.name}-"))
    plan = harness.plan(target, home)
    argv = [program, *plan.args, *args.passthrough]
    print(f"launch: {harness.name} -> {url} (model {target.model}, context {target.context}, output "
          f"{target.output_tokens}); set {plan.summary()}", file=sys.stderr, flush=True)
    if args.dry_run:
        for key, value in sorted(plan.env.items()):
            print(f"{key}={value}")
        print(shlex.join(argv))
        shutil.rmtree(home, ignore_errors=True)
        return 0
    for path, text in plan.files.items():
        Path(path).write_text(text)
    env = {**os.environ, **QUIET, **plan.env}
    # The harness handles Ctrl-C itself; launch only outlives it. A do-nothing handler, not SIG_IGN:
    # an ignored signal stays ignored across exec, a caught one is reset to the default there.
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        code = subprocess.call(argv, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
        shutil.rmtree(home, ignore_errors=True)
    return code if code >= 0 else 128 - code                 # killed by signal N: 128 + N, as a shell says


def _target(url: str, args):
    """Model id and context length from the server's /v1/models (the first id it serves)."""
    from freetoken.harnesses import Target
    key = (args.api_key or "").split(",")[0] or "freetoken"
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        card = json.load(response)["data"][0]
    return Target(url, card["id"], int(card.get("context_length") or card.get("max_model_len")), key)


def _healthy(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            body = json.load(response)
            return body if body.get("status") == "ok" else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


class _Server:
    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log

    def stop(self) -> None:
        """SIGTERM (the server finishes open requests), then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        print(f"launch: stopped the server it started (log: {self.log})", file=sys.stderr)


def _start_server(args, url: str) -> _Server:
    """`python -m freetoken serve` with this command's serve flags, in its own session (Ctrl-C in
    the terminal reaches only the harness), waited for until /health says ok."""
    log = Path(tempfile.mkstemp(prefix="freetoken-launch-", suffix=".log")[1])
    argv = [sys.executable, "-m", "freetoken", "--log-level", args.log_level, "serve", *_serve_flags(args)]
    print(f"launch: starting a server at {url} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server, t0 = _Server(proc, log), time.monotonic()
    while _healthy(url) is None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError("the server exited during start-up:\n  " + "\n  ".join(tail))
        if time.monotonic() - t0 > START_TIMEOUT_S:
            server.stop()
            raise RuntimeError(f"the server did not become healthy within {START_TIMEOUT_S} s (log: {log})")
        time.sleep(0.5)
    print(f"launch: server ready after {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return server


def _serve_flags(args) -> list[str]:
    """The serve flags given to launch that differ from their defaults, as serve arguments."""
    import dataclasses

    from freetoken.config import EngineConfig
    from freetoken.server.config import ServerConfig
    flags = []
    for cls in (ServerConfig, EngineConfig):
        defaults, given = cls(), config_from_args(args, cls)
        for f in dataclasses.fields(cls):
            value = getattr(given, f.name)
            if value == getattr(defaults, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags
