"""`run_python` (tests/fresh_python.py) gives what `subprocess.run([sys.executable, ...])` gives: a process of its own
that starts without hf_cpt or the test's objects, its arguments, environment and directory, its exit status and
output, and a timeout; and its server outlives the thread that started it and ends with the process that did."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from . import fresh_python
from .fresh_python import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_command_runs_in_another_process_without_hf_cpt_and_with_its_arguments_environment_and_directory(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys\n"
                      "print(os.getpid(), os.getppid(), 'hf_cpt' in sys.modules, os.getcwd(), sys.argv[1:],\n"
                      "      os.environ['HF_CPT_PROBE'], sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n")
    result = run_python([str(script), "--flag", "value"], env={**os.environ, "HF_CPT_PROBE": "seen"},
                        cwd=str(tmp_path))
    pid, parent, imported, cwd, *rest = result.stdout.split(maxsplit=4)
    assert result.returncode == 0 and int(pid) != os.getpid() and int(parent) != os.getpid()
    assert imported == "False" and cwd == str(tmp_path)
    assert rest == ["['--flag', 'value'] seen True\n"]


def test_exit_status_output_and_uncaught_exceptions_are_those_of_python():
    stopped = run_python(["-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (3, "out\n", "err\n")
    failed = run_python(["-c", "raise ValueError('no such file: x.json')"])
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: no such file: x.json")
    with pytest.raises(subprocess.CalledProcessError):
        run_python(["-c", "raise SystemExit('bad input')"], check=True)
    said = run_python(["-c", "raise SystemExit('bad input')"])
    assert said.returncode == 1 and said.stderr == "bad input\n"


def test_atexit_functions_run_and_a_module_runs_as_main():
    ended = run_python(["-c", "import atexit; atexit.register(print, 'at exit')"])
    assert ended.stdout == "at exit\n"
    module = run_python(["-m", "hf_cpt", "schedules", "--names", "RR", "--steps", "10"])
    assert module.returncode == 0 and "| RR |" in module.stdout


def test_threads_follow_the_commands_environment():
    script = "import torch; print(torch.get_num_threads())"
    assert run_python(["-c", script], env={**os.environ, "OMP_NUM_THREADS": "3"}).stdout == "3\n"  # neither default


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    started = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import subprocess, sys, time\n"
                          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                          f"open({str(started)!r}, 'w').write(str(child.pid))\n"
                          "time.sleep(60)"], timeout=1.5)
    pid = int(started.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_interpreter_flags_run_in_a_new_interpreter():
    result = run_python(["-X", "importtime", "-c", "print(1)"])
    assert result.returncode == 0 and result.stdout == "1\n" and "import time:" in result.stderr


def test_a_server_outlives_the_thread_that_started_it(tmp_path):
    """A test may call run_python first from a worker thread: the server it starts serves the tests after it."""
    started = {}
    thread = threading.Thread(target=lambda: started.update(fresh_python._start(dict(os.environ), ("json",))))
    thread.start()
    thread.join()
    try:
        time.sleep(0.5)
        assert started["process"].poll() is None
        out, err = tmp_path / "out", tmp_path / "err"
        out.touch(), err.touch()
        answer = fresh_python._ask(started["path"], {"args": ["-c", "print(7)"], "env": dict(os.environ),
                                                     "cwd": str(tmp_path), "stdout": str(out), "stderr": str(err),
                                                     "timeout": 60})
        assert json.loads(answer) == {"returncode": 0, "timed_out": False} and out.read_text() == "7\n"
    finally:
        fresh_python._stop(started["process"], started["path"])


def test_a_server_ends_with_the_process_that_started_it_however_that_ends_and_leaves_no_folder():
    script = (f"import os, sys; sys.path.insert(0, {ROOT!r}); from tests import fresh_python\n"
              "server = fresh_python._start(dict(os.environ), ('json',))\n"
              "print(server['process'].pid, server['path'], flush=True)\n"
              "os._exit(0)  # as a killed pytest: no atexit function runs\n")
    said = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    pid, folder = int(said[0]), os.path.dirname(said[1])
    deadline = time.monotonic() + 10
    while (_alive(pid) or os.path.exists(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert not os.path.exists(folder)  # socket and log gone: killed test runs do not fill the temporary folder
