"""Where the suite's time goes: each test file's seconds, summed from its tests' reports.

A pytest plugin that ``tests/conftest.py`` registers in the process that runs the session
(pytest alone, or the pytest-xdist controller; never in a worker). Each test phase's report
reaches that process as it ends, workers' included, so summing ``report.duration`` per file
there counts every phase once. A file's seconds are its tests' set-up, call and tear-down:
module-scoped fixtures (a shared engine, a started server) fall in the set-up of the first
test that uses them and the tear-down of the last, so they are counted; the import and
collection of the file are not. With ``--dist loadfile`` a file runs in one worker, so its
seconds are that worker's time on it.

At the session's end the terminal summary shows the slowest files (the top 15) and the
sum over all of them. When ``JAXPAR_TEST_TIMES`` names a file, the whole table is written
there as JSON, ``{"wall_s", "total_s", "finished", "files": [{"file", "seconds", "tests",
"failed"}, ...]}`` with the files slowest first, after each test and at the end
(``"finished": true``): a run stopped early still says where its time went.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

TOP = 15


class FileTimes:
    """Sums test phases' wall seconds per file; reports them when the session ends."""

    def __init__(self, out_path: str | None) -> None:
        self.out_path = out_path
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.failed: dict[str, int] = defaultdict(int)
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += report.duration
        if report.when == "call":
            self.tests[path] += 1
        if report.failed:
            self.failed[path] += 1
        if self.out_path and report.when == "teardown":
            self.write(finished=False)

    def write(self, finished: bool) -> None:
        """The table as JSON, to ``out_path``."""
        rows = self.table()
        report = {
            "wall_s": round(time.monotonic() - self.started, 2),
            "total_s": round(sum(row["seconds"] for row in rows), 2),
            "finished": finished,
            "files": rows,
        }
        with open(self.out_path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")

    def table(self) -> list[dict]:
        """One row a file, slowest first."""
        rows = [
            {
                "file": path,
                "seconds": round(seconds, 2),
                "tests": self.tests[path],
                "failed": self.failed[path],
            }
            for path, seconds in self.seconds.items()
        ]
        return sorted(rows, key=lambda row: (-row["seconds"], row["file"]))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = self.table()
        if not rows:
            return
        wall_s = time.monotonic() - self.started
        total_s = sum(row["seconds"] for row in rows)
        write = terminalreporter.write_line
        terminalreporter.section("seconds per test file (set-up + call + tear-down)")
        for row in rows[:TOP]:
            write(f"{row['seconds']:9.1f} s  {row['tests']:4d} tests  {row['file']}")
        if len(rows) > TOP:
            rest = sum(row["seconds"] for row in rows[TOP:])
            write(f"{rest:9.1f} s  in the other {len(rows) - TOP} files")
        write(f"{total_s:9.1f} s  in all {len(rows)} files; {wall_s:.1f} s of wall time")
        if self.out_path:
            self.write(finished=True)
            write(f"(written to {self.out_path})")


def register(config) -> None:
    """Registers the plugin in the session's own process (not in an xdist worker)."""
    if not hasattr(config, "workerinput"):
        out_path = os.environ.get("JAXPAR_TEST_TIMES") or None
        config.pluginmanager.register(FileTimes(out_path), "jaxpar-file-times")
