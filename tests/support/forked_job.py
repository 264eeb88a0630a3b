"""Runs a judged PyTorch job's phases in processes forked from a Python that imported torch
(tests only; `torch_server.py` calls `run_phase` for each job it is asked for).

A phase is `{"ranks": N, "argv": [...]}`: its ranks are forked from this process, each
running its `argv` (a script and its arguments) as `__main__`; a phase with `ranks` > 0 gets
the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), a phase with `ranks` 0 is one plain process (a job's `reference`
command). The first rank that fails ends the phase with its exit status, after its other ranks
are stopped, as torchrun stops a job's workers when one fails.

Why: importing torch costs about 4 s here with the distributed modules, and a job under
torchrun imports it four times (the launcher, two ranks, the references). Forked after one
import, the ranks run the same scripts with the same environment; `tests/judge_pytorch.rs`
keeps one job under torchrun itself, so the documented command stays tested.
"""

import os
import runpy
import signal
import sys
import time
import traceback


def run_script(argv):
    """Runs `argv[0]` as `__main__` with `argv` as its arguments: its exit status."""
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the rank's traceback, as Python prints it
        traceback.print_exc()
        return 1


def fork_rank(argv, env):
    """Forks one process running `argv` with `env` added: its pid."""
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(env)
    status = 1
    try:
        status = run_script(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def exit_status(wait_status):
    """A waited-for child's status as a shell gives it (128 + signal when killed)."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def run_phase(phase, port, gone=None):
    """Runs one phase's ranks to their end: 0, or the first failing rank's status. With `gone`
    (a callable, `torch_server.py`'s client check), ranks are killed once it says so."""
    ranks = phase["ranks"]
    argv = phase["argv"]
    if ranks == 0:
        pids = {fork_rank(argv, {}): 0}
    else:
        pids = {}
        for rank in range(ranks):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                # torchrun's run id (its default): trainers that launch their own workers
                # unless started by torchrun (Lightning) look for it.
                "TORCHELASTIC_RUN_ID": "none",
            }
            pids[fork_rank(argv, env)] = rank
    failed = 0
    while pids:
        pid, wait_status = os.waitpid(-1, 0 if gone is None else os.WNOHANG)
        if pid == 0:
            if gone():
                for other in pids:
                    os.kill(other, signal.SIGKILL)
                return 1
            time.sleep(0.02)
            continue
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        status = exit_status(wait_status)
        if status and not failed:
            failed = status
            print(f"forked_job: {argv[0]} {argv[1:2]} rank {rank} exited with {status}; "
                  "stopping the others", file=sys.stderr)
            for other in pids:
                os.kill(other, signal.SIGTERM)
    return failed

