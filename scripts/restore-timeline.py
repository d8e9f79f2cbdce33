#!/usr/bin/env python3
"""Prints the phases of every runsc restore found in a runsc debug-log directory
(runsc --debug --debug-log=DIR/), in milliseconds from the start of the
`runsc restore` command: the sandbox's boot start when the restore made it, the
containerManager.Restore RPC, the seccomp filter built, "loading kernel",
"kernel loaded", the end of page loading, the command's exit.

    python3 scripts/restore-timeline.py DIR [DIR...]
"""
import glob
import os
import re
import sys
from datetime import datetime

STAMP = re.compile(r"^[DIWE]\d{4} (\d\d:\d\d:\d\d\.\d{6})")


def when(line):
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%H:%M:%S.%f") if m else None


def first_time(path):
    with open(path, errors="replace") as f:
        for line in f:
            t = when(line)
            if t:
                return t
    return None


def last_time(path):
    t = None
    with open(path, errors="replace") as f:
        for line in f:
            t = when(line) or t
    return t


MARKS = [
    ("boot", "Timer for runsc boot: Starting"),
    ("rpc", "mid Restore = cm.Restore RPC"),
    ("seccomp", "Seccomp program optimized from 2130"),
    ("loading", "mid Restore = loading kernel"),
    ("loaded", "mid Restore = kernel loaded"),
    ("pages", "Async page loading completed"),
]


def boot_marks(path):
    out = {}
    with open(path, errors="replace") as f:
        for line in f:
            for name, needle in MARKS:
                if needle in line and name not in out:
                    if name in ("rpc", "loading", "loaded"):
                        # the timer's summary line carries the real time
                        m = re.search(r"(\d\d:\d\d:\d\d\.\d{9}) mid", line)
                        out[name] = datetime.strptime(m.group(1)[:15], "%H:%M:%S.%f") if m else when(line)
                    else:
                        out[name] = when(line)
    return out


def main(dirs):
    cols = ["boot", "rpc", "seccomp", "loading", "loaded", "pages", "exit"]
    print("%-28s" % "restore" + "".join("%9s" % c for c in cols))
    for d in dirs:
        restores = sorted(glob.glob(os.path.join(d, "*.restore.txt")))
        starts = [(first_time(r), r) for r in restores]
        for b in sorted(glob.glob(os.path.join(d, "*.boot.txt"))):
            m = boot_marks(b)
            if "rpc" not in m:
                continue
            cands = [(t, r) for t, r in starts if t and t <= m["rpc"]]
            if not cands:
                continue
            t0, r = max(cands)
            m["exit"] = last_time(r)
            if m.get("boot") and m["boot"] < t0:
                del m["boot"]  # made by runsc create before the restore
            row = ["%9.1f" % ((m[c] - t0).total_seconds() * 1000) if m.get(c) else "%9s" % "-" for c in cols]
            print("%-28s" % (os.path.basename(d.rstrip("/")) + " " + os.path.basename(r)[10:25]) + "".join(row))


if __name__ == "__main__":
    main(sys.argv[1:])
