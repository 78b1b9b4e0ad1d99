"""A stand-in for NeMo-Gym's `ng_run`, installed as `<venv>/bin/ng_run` by the launcher tests.

It reads the config it is given the way Gym does (`+config_paths=[file]`), starts a grandchild
(as Gym starts its servers), writes both pids next to the config and serves a head server with
`/readyz` and `/server_instances`. The config's `fake_gym` block picks a behaviour: `mode`
`ready` (default), `never_ready`, `exit` or `crash` (a server's import error, then a long
shutdown); `stubborn_child` makes the grandchild ignore SIGTERM. The roots Gym would search for
servers first (`NEMO_GYM_EXTRA_ROOTS`) and the Ray cluster it would join (`RAY_ADDRESS`) are
written next to the config, `unset` when not set.
"""

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

(argument,) = sys.argv[1:]
config_path = Path(argument.removeprefix("+config_paths=[").removesuffix("]"))
config = yaml.safe_load(config_path.read_text())
fake = config.get("fake_gym") or {}
mode = fake.get("mode", "ready")
if mode == "exit":
    print("fake gym: refusing this config", flush=True)
    sys.exit(3)
if mode == "crash":  # a server fails at import, then the launcher shuts everything down
    print("(grl_sokoban) starting resources server", flush=True)
    print("(grl_sokoban) Traceback (most recent call last):", flush=True)
    print('(grl_sokoban)   File "app.py", line 3, in <module>', flush=True)
    print("(grl_sokoban)     import gymnasium", flush=True)
    print("(grl_sokoban) ModuleNotFoundError: No module named 'gymnasium'", flush=True)
    for server in range(120):
        print(f"shutting down server {server}: terminated, no error", flush=True)
    sys.exit(1)
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if fake.get("stubborn_child") else ""
child = subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}time.sleep(600)"])
(config_path.parent / "pids").write_text(f"{os.getpid()} {child.pid}")
# Where Gym would look for servers first (nemo_gym.component_search_roots).
(config_path.parent / "extra_roots").write_text(os.environ.get("NEMO_GYM_EXTRA_ROOTS", "unset"))
# Which Ray cluster Gym's `ray.init()` would join (RAY_ADDRESS; "local" starts its own).
(config_path.parent / "ray_address").write_text(os.environ.get("RAY_ADDRESS", "unset"))
INSTANCES = [
    {"process_name": "my_agent", "server_type": "responses_api_agents", "url": "http://h:1"},
    {"process_name": "policy_model", "server_type": "responses_api_models", "url": "http://h:2"},
]


class Head(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/readyz":
            code, body = (200 if mode == "ready" else 503), b"{}"
        elif self.path == "/server_instances":
            code, body = 200, json.dumps(INSTANCES).encode()
        else:
            code, body = 404, b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


head = config["head_server"]
ThreadingHTTPServer((head["host"], head["port"]), Head).serve_forever()
