"""`run_python`: ``python ARGS`` in a process of its own, as `subprocess.run` would run it, without paying the
imports of torch, transformers and the Trainer again (about 12 s a process on 2 cores): the command runs in a child
forked from a server that imported them once (`tests/python_server.py`; a new server where the command's environment
differs from the server's in a variable that its imports may read), or in a new interpreter where no server can run
it (interpreter flags, no fork).

For tests of scripts, recipes and checkpoints loaded elsewhere. A test of what importing does (which modules load,
import times, compiler stacks) starts a new interpreter with `subprocess` itself."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import warnings

from .python_server import FOLDER_PREFIX

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_server.py")
# Variables read when used, not by what the server imports: a command may set them differently. pytest sets
# PYTEST_CURRENT_TEST for each test; importing sklearn or joblib in the test process sets KMP_INIT_AT_FORK (for Intel's
# OpenMP, which torch here does not load).
READ_WHEN_USED = {"OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CC", "XDG_CACHE_HOME", "PYTEST_CURRENT_TEST",
                  "KMP_INIT_AT_FORK"}
READ_WHEN_USED_PREFIXES = ("HF_CPT_",)

_lock = threading.Lock()
_server: dict = {}  # the running server: its environment's signature, socket path and process


def run_python(args: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float | None = None,
               check: bool = False) -> subprocess.CompletedProcess:
    """``[sys.executable, *args]`` run to its end, its output captured as text (`subprocess.run`'s result)."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    servable = args and (not args[0].startswith("-") or args[0] in ("-c", "-m"))
    path = _socket_path(env) if servable else None
    if path is None:
        return _new_interpreter(args, env, cwd, timeout, check)
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for name in (stdout, stderr):
            open(name, "w").close()
        request = {"args": list(args), "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr, "timeout": timeout}
        try:
            line = _ask(path, request)
        except OSError:  # no server at that path: stopped for another thread's environment, or killed
            path = _socket_path(env, restart=True)
            if path is None:
                return _new_interpreter(args, env, cwd, timeout, check)
            line = _ask(path, request)
        if not line:
            raise RuntimeError(f"the tests' Python server gave no answer for {args[:2]}: its handler died")
        answer = json.loads(line)
        with open(stdout, errors="replace") as out, open(stderr, errors="replace") as err:
            result = subprocess.CompletedProcess([sys.executable, *args], answer["returncode"], out.read(), err.read())
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(result.args, timeout, result.stdout, result.stderr)
    if check:
        result.check_returncode()
    return result


def _ask(path: str, request: dict) -> str:
    """Send a request to the server at ``path``; its answer's line ('' where the connection closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(path)
        connection.sendall((json.dumps(request) + "\n").encode())
        with connection.makefile("r") as reader:
            return reader.readline()


def _new_interpreter(args: list[str], env: dict, cwd: str, timeout: float | None, check: bool
                     ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, timeout=timeout, check=check, capture_output=True,
                          text=True)


def _socket_path(env: dict, restart: bool = False) -> str | None:
    """The socket of a server started with ``env`` (as far as what it imports may read it), started on first use;
    None where no server can start. A command whose environment differs from the running server's in another
    variable gets a server of its own: the one before is stopped. ``restart``: the server answers no more, start
    another if it is still the one for ``env``."""
    signature = frozenset((name, value) for name, value in env.items()
                          if name not in READ_WHEN_USED and not name.startswith(READ_WHEN_USED_PREFIXES))
    with _lock:
        gone = restart and _server.get("process") is not None and _server["process"].poll() is not None
        if _server.get("signature") != signature or gone:
            if _server.get("process") is not None:
                _stop(_server["process"], _server["path"])
            _server.update(signature=signature, **_start(env))
        return _server["path"]


def _start(env: dict, preload: tuple[str, ...] = ()) -> dict:
    """A server started with ``env``, importing ``preload`` (its own list when empty). Its standard input is a pipe
    from this process, which it watches: it ends when this process does, whichever thread started it."""
    if not hasattr(os, "fork") or not hasattr(socket, "AF_UNIX"):
        return {"path": None, "process": None}
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    path = os.path.join(folder, "socket")
    log = os.path.join(folder, "stderr")
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, SERVER, path, *preload], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    line = process.stdout.readline()
    if line.strip() != "ready":
        with open(log) as said:
            warnings.warn(f"the Python server did not start ({said.read()[-500:]}); commands run in new interpreters",
                          stacklevel=4)
        _stop(process, path)
        return {"path": None, "process": None}
    atexit.register(_stop, process, path)
    return {"path": path, "process": process}


def _stop(process: subprocess.Popen, path: str) -> None:
    """Stop a server and remove its folder (socket, log)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for stream in (process.stdin, process.stdout):
        stream.close()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
