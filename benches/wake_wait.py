"""Part 7 of benches/run: a slot's timer and its .path unit in small. Waits until TICK seconds
have passed (exit 1: the timer starts the next run) or FILE was modified after SINCE_NS (exit 0:
a webhook delivery woke the slot; a .path unit does not watch while its service runs, so only a
change after the run's end counts). Looks every 10 ms.

usage: wake_wait.py FILE TICK SINCE_NS
"""
import os, sys, time

path, tick, since = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + tick
while time.monotonic() < end:
    try:
        if os.stat(path).st_mtime_ns > since:
            sys.exit(0)
    except FileNotFoundError:
        pass
    time.sleep(0.01)
sys.exit(1)
