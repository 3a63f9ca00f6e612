"""What the tests that start worker processes share: a free port, an env."""

import os
import socket
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env() -> dict:
  """This process's environment for a worker: this checkout's ``src`` first,
  and no ``XLA_FLAGS`` (the worker sets its own device count)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (SRC, env.get("PYTHONPATH")) if p
  )
  return env
