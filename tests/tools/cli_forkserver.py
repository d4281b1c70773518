"""Runs `quantkit` command lines in forked copies of one process that has imported quantkit's CLI already.

Each request (one JSON line on stdin: args, cwd, env, umask) is served by a fresh fork: the child takes the cwd,
the whole environment and the umask of the request, runs `python -m quantkit ARGS` as that module would
(quantkit.cli.main), and exits; the reply (one JSON line on stdout) is its exit status, stdout and stderr. To the
command a fork is a new process: its own cwd, environment, file descriptors and exit. Only what Python had
imported before the fork is shared, so a request whose environment changes what an import reads (PYTHONPATH,
HF_HUB_OFFLINE) must be run in a real new process instead (tests/test_cli_errors.py's `cli` decides).
Saves the ~5 s of importing torch and transformers per command.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def serve_one(request: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                if request["umask"] is not None:
                    os.umask(request["umask"])
                for fd, path in ((1, out), (2, err)):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the child exits below)
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                sys.argv = ["quantkit", *request["args"]]
                from quantkit.cli import main

                try:
                    main()
                    code = 0
                except SystemExit as exit_:  # as the interpreter would: a non-integer code is printed, status 1
                    code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
                    if not isinstance(exit_.code, int | None):
                        print(exit_.code, file=sys.stderr)
                except BaseException:  # as the interpreter would: the trace on stderr, status 1
                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        with open(out, encoding="utf-8", errors="replace") as f_out, \
                open(err, encoding="utf-8", errors="replace") as f_err:
            return {"returncode": os.waitstatus_to_exitcode(status), "stdout": f_out.read(), "stderr": f_err.read()}


def main() -> None:
    import quantkit.cli  # noqa: F401  (the import every fork shares)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(serve_one(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
