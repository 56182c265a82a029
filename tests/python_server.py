"""A Python process that imports torch, transformers and the Trainer once, then runs each requested command
(``script.py args``, ``-c code``, ``-m module args``) in a child forked from itself (`tests/fresh_python.py`).

`from transformers import Trainer` takes about 12 s on a 2-core machine, and the suite starts dozens of Python
processes. A forked child is still a process of its own: it never saw the test's models or hf_cpt (this process
imports no hf_cpt module), so a checkpoint it loads crosses a process boundary as on a user's machine; it starts as
a user's script that imports transformers before hf_cpt would. This process runs no tensor operation and no Python
thread, so torch's OpenMP team does not exist yet when it forks; the native pools its imports start (numpy's
OpenBLAS, pyarrow's jemalloc) hand themselves over to a forked child, as a DataLoader's forked workers rely on.

Usage: ``python tests/python_server.py SOCKET [MODULE ...]`` (the modules to import; the list above by default),
its standard input a pipe from the process that started it: the server ends when that pipe closes, that is when that
process ends, however it ends. It prints ``ready`` when it listens. One connection per command: a JSON line {args, env,
cwd, stdout, stderr, timeout} in, {returncode, timed_out} out when the command ends.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import threading
import time

FOLDER_PREFIX = "hf_cpt_python_server_"  # of the temporary folder `fresh_python` makes for a server's socket and log
PRELOAD = ("torch", "transformers", "transformers.trainer", "accelerate", "safetensors.torch", "datasets", "timm",
           "peft", "matplotlib.pyplot")


def main(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra that is not installed: its users import it themselves
            pass
    if any(name == "hf_cpt" or name.startswith("hf_cpt.") for name in sys.modules):
        raise SystemExit("the server must not import hf_cpt: its children would not start fresh")
    if threading.active_count() != 1:  # a Python thread would not survive the fork
        raise SystemExit(f"the server runs {threading.active_count()} Python threads after its imports")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ended connection handlers leave no zombies
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:  # the pipe from the process that started this one closed: it ended (perhaps
            listener.close()        # killed, its atexit cleanup never run): the server removes the folder
            folder = os.path.dirname(os.path.abspath(path))  # fresh_python made for it
            if os.path.basename(folder).startswith(FOLDER_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
            raise SystemExit(0)
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _handle(connection)
        connection.close()


def _handle(connection: socket.socket) -> None:
    """Run one request in a child of its own process group and report how it ended."""
    with connection.makefile("r") as reader:
        request = json.loads(reader.readline())
    pid = os.fork()
    if pid == 0:
        connection.close()
        os._exit(_run(request))
    try:  # here too, so that the group exists before a timeout can kill it (whichever of the two runs first)
        os.setpgid(pid, pid)
    except OSError:  # the child has run already, or its command ended
        pass
    deadline = time.monotonic() + (request["timeout"] or float("inf"))
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    answer = {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
    connection.sendall((json.dumps(answer) + "\n").encode())
    connection.close()
    os._exit(0)


def _run(request: dict) -> int:
    """The command's exit status, ended as `python ...` ends (its atexit functions run, an uncaught exception printed)
    but without tearing its modules down: that would write to every object the server imported, copying their pages
    from the server's (seconds a command)."""
    try:
        _execute(request)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def _execute(request: dict) -> None:
    os.setpgid(0, 0)  # a timeout kills what the command started too
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when torch loaded, before this request
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    args = request["args"]
    if args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif args[0] == "-m":
        sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
