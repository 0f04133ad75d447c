"""When this job started, from the kernel's clock: a job's fixed cost includes the
interpreter and the imports, which no timer started inside Python can see."""

from __future__ import annotations

import os
import time

# Set by a warm interpreter's client (slidesnake.cohort.warm) for the child that runs its
# job: the job started with the client, not with the fork. perf_counter is
# CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
JOB_STARTED_ENV = "SLIDESNAKE_JOB_STARTED"


def process_age_s() -> float | None:
    """Seconds since this process started (10 ms resolution), or None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    started_ticks = int(after_name[19])  # field 22 of proc(5), 'starttime'
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def process_started() -> float:
    """This job's start on the `time.perf_counter` clock: its warm client's start, else
    this process's (now, off Linux)."""
    told = os.environ.get(JOB_STARTED_ENV)
    if told:
        return float(told)
    return time.perf_counter() - (process_age_s() or 0.0)
