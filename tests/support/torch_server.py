"""A Python that imported torch once and forks the judge tests' PyTorch jobs (tests only).

    python3 tests/support/torch_server.py SOCKET SPEC

SPEC is JSON: `{"preload": [module, ...], "idle_seconds": S}`. The server imports the preload
modules, listens on the Unix socket SOCKET, and for each connection forks a child that reads
one request line (JSON: `{"cwd", "env", "port", "phases", "stdout", "stderr"}`), runs
the job's phases exactly as `forked_job.py` does (each phase's ranks forked with torchrun's
environment), with the request's working directory, environment and output files, and writes
back `{"status": N}`. A client that goes away stops its job: its ranks are killed. The server
exits once no job has run for `idle_seconds`.

Why: `forked_job.py` imports torch once per job (about 4 s here with the distributed modules),
and the judge's tests run some sixty jobs; under nextest every test is its own process, so only
a process that outlives the tests can share the import. `tests/fixtures.rs` starts one server
per interpreter, path, preload list and version of these files, under a file lock, and its
name changes with any of them, so a server never serves a job from another checkout's scripts.
"""

import importlib
import json
import os
import select
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forked_job  # noqa: E402 - beside this file


def client_gone(conn):
    """Whether the client closed its end (it sends nothing after its request)."""
    readable, _, _ = select.select([conn], [], [], 0)
    return bool(readable) and not conn.recv(1, socket.MSG_PEEK)


def serve_one(conn):
    """Runs the one job `conn` asks for, in this (forked) process; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request = json.loads(conn.makefile("r").readline())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        status = 0
        for phase in request["phases"]:
            status = forked_job.run_phase(phase, request["port"], lambda: client_gone(conn))
            if status:
                break
    except BaseException:  # noqa: BLE001 - the job's failure, reported as its status
        import traceback

        traceback.print_exc()
        status = status or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.sendall((json.dumps({"status": status}) + "\n").encode())
        except OSError:
            pass
        os._exit(0)


def main():
    path, spec = sys.argv[1], json.loads(sys.argv[2])
    for module in spec.get("preload", []):
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under a temporary name, then renamed: a client never connects to a half-ready
    # server.
    partial = f"{path}.{os.getpid()}"
    listener.bind(partial)
    listener.listen(64)
    os.rename(partial, path)
    idle = float(spec.get("idle_seconds", 30))
    children = set()
    last = time.monotonic()
    while True:
        readable, _, _ = select.select([listener], [], [], 0.5)
        if readable:
            serve(listener, children)
        while children:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
        if children or readable:
            last = time.monotonic()
        elif time.monotonic() - last > idle:
            break
    # Gone from the file system first, so a new client starts a new server; then whoever
    # connected before that is still served.
    os.unlink(path)
    listener.setblocking(False)
    while True:
        try:
            serve(listener, children)
        except BlockingIOError:
            break


def serve(listener, children):
    """Accepts one connection and forks its job."""
    conn, _ = listener.accept()
    conn.setblocking(True)
    pid = os.fork()
    if pid == 0:
        listener.close()
        serve_one(conn)
    conn.close()
    children.add(pid)

if __name__ == "__main__":
    main()
