"""``ctl``: talk to a running server: health, cache status, cache rebuild (stdlib HTTP client)."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def register(sub) -> None:
    p = sub.add_parser("ctl", help="control a running server (health, cache status|rebuild)")
    p.add_argument("--url", default=os.environ.get("FREETOKEN_URL", "http://127.0.0.1:1919"),
                   help="server base URL (default: %(default)s; env FREETOKEN_URL)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"),
                   help="API key, if the server wants one (env FREETOKEN_API_KEY)")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("FREETOKEN_CTL_TIMEOUT", 600)),
                   help="seconds to wait (default: %(default)s; env FREETOKEN_CTL_TIMEOUT)")
    what = p.add_subparsers(dest="ctl_command", metavar="WHAT", required=True)
    what.add_parser("health", help="GET /health")
    cache = what.add_parser("cache", help="expert cache and KV pool")
    action = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    action.add_parser("status", help="GET /v1/cache/status")
    rebuild = action.add_parser("rebuild", help="POST /v1/cache/rebuild (only while the server is idle)")
    rebuild.add_argument("--moe-cache-size", type=int, help="new expert cache size in slots")
    rebuild.add_argument("--num-kv-tokens", type=int, help="new KV pool size in tokens")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.ctl_command == "health":
        status, body = request(args, "GET", "/health")
    elif args.cache_command == "status":
        status, body = request(args, "GET", "/v1/cache/status")
    else:
        sizes = {k: v for k, v in (("moe_cache_size", args.moe_cache_size),
                                   ("num_kv_tokens", args.num_kv_tokens)) if v is not None}
        if not sizes:
            print("give --moe-cache-size and/or --num-kv-tokens", file=sys.stderr)
            return 2
        status, body = request(args, "POST", "/v1/cache/rebuild", sizes)
    _print(json.dumps(body, indent=2))
    return 0 if status < 400 else 1


def _print(text: str) -> None:
    """Print, quietly giving up when the reader has gone (``ctl ... | head``)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # point stdout at /dev/null, or the flush at exit raises again and prints a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def request(args, method: str, path: str, payload: dict | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body); a server that cannot be reached is a RuntimeError."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": {"message": str(e)}}
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"cannot reach the server at {args.url}: {e}") from None
