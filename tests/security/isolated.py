"""Running dangerous cases in a child interpreter under a memory cap and time limits, so that
a regression fails its test instead of taking the machine down.

The cases of a module run in one child (starting one costs seconds on a busy machine): each
is Python code run in its own folder, under a per-case alarm; the child reports each case
as it ends. The child's address space is capped (``RLIMIT_AS``), so a case that allocates
without bound ends in a MemoryError (reported, and failing its test) rather than swapping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The address space a child may map (the libraries take a few hundred MiB of it).
MEMORY_CAP = 1536 * 2**20
#: Seconds a case may run (its alarm), and the whole child at most.
CASE_TIMEOUT = 20
CHILD_TIMEOUT = 120

_CHILD = """
import json, os, resource, signal, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))

def _alarm(signum, frame):
    raise TimeoutError("the case ran past {timeout} s")

def _peak_mib():
    # VmHWM restarts at exec; ru_maxrss would count the parent's peak before the exec
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

signal.signal(signal.SIGALRM, _alarm)
for case in json.load(open(sys.argv[1])):
    os.chdir(case["cwd"])
    start = time.perf_counter()
    signal.alarm({timeout})
    try:
        exec(compile(case["code"], case["id"], "exec"), {{}})
    except BaseException as exc:
        error, message, mro = type(exc).__name__, str(exc), [c.__name__ for c in type(exc).__mro__]
    else:
        error, message, mro = None, "", []
    finally:
        signal.alarm(0)
    report = dict(id=case["id"], error=error, message=message, mro=mro,
                  seconds=time.perf_counter() - start, peak_mib=_peak_mib())
    print("RESULT " + json.dumps(report), flush=True)
"""


def run_cases(cases: dict[str, tuple[str | os.PathLike, str]], cap: int = MEMORY_CAP) -> dict:
    """Run ``{id: (folder, code)}`` in one capped child; ``{id: report}`` where a report
    holds ``error`` (the exception's type name, None when the code returned), ``message``,
    ``mro``, ``seconds`` and ``peak_mib`` (the child's peak resident memory so far). A case
    the child did not report (it died or hung) has the error ``'no report'``."""
    listed = [
        {"id": key, "cwd": os.fspath(folder), "code": textwrap.dedent(code)}
        for key, (folder, code) in cases.items()
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.update({"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(listed, file)
    try:
        result = subprocess.run(
            [sys.executable, "-c", _CHILD.format(cap=cap, timeout=CASE_TIMEOUT), file.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        stdout, stderr = result.stdout, result.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = f"the child ran past {CHILD_TIMEOUT} s"
    finally:
        os.unlink(file.name)
    reports = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            report = json.loads(line[len("RESULT ") :])
            reports[report["id"]] = report
    for key in cases:
        reports.setdefault(
            key, {"id": key, "error": "no report", "message": stderr[-2000:], "mro": []}
        )
    return reports


def refused(report: dict, kind: str, *fragments: str) -> None:
    """Assert that the case raised ``kind`` (or a subclass) with every fragment in its
    message."""
    assert report["error"] is not None, f"{report['id']}: the case was accepted"
    assert kind in report["mro"], f"{report['id']}: {report['error']}: {report['message']}"
    for fragment in fragments:
        assert fragment in report["message"], report["message"]


def accepted(report: dict) -> None:
    """Assert that the case ran to its end."""
    assert report["error"] is None, f"{report['id']}: {report['error']}: {report['message']}"
