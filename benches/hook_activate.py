"""Part 7 of benches/run: systemd's Accept=yes socket activation in small, for the webhook
receiver. Listens on 127.0.0.1 (its port into PORT_FILE) and runs `BIN hook ARGS...` once per
connection, the connection as fd 3, LISTEN_FDS=1 and LISTEN_PID its pid, as a socket unit does.
Each process's cost is appended to USAGE as one line: exit status, then either `cpu MS` (user +
system, wait4's rusage; every odd connection, the hook exec'd from a fork of this process) or
`rss KIB` (its peak, every even one: by /usr/bin/time through a `sh -c exec` shim, since the
peak of a fork of this Python is Python's). Runs until killed.

usage: hook_activate.py PORT_FILE USAGE BIN ARGS...
"""
import os, socket, sys, threading

port_file, usage, binary, *args = sys.argv[1:]
lock = threading.Lock()


def serve(conn, n):
    rss = f"{usage}.rss.{n}"
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(conn.fileno(), 3, inheritable=True)
            env = {"PATH": "/usr/bin:/bin", "LISTEN_FDS": "1"}
            if n % 2:
                env["LISTEN_PID"] = str(os.getpid())
                os.execve(binary, [binary, "hook", *args], env)
            shim = 'LISTEN_PID=$$ exec "$0" hook "$@"'
            os.execve("/usr/bin/time", ["time", "-f", "%M", "-o", rss, "/bin/sh", "-c", shim, binary, *args], env)
        finally:
            os._exit(127)
    conn.close()
    _, status, ru = os.wait4(pid, 0)
    if n % 2:
        cost = f"cpu {(ru.ru_utime + ru.ru_stime) * 1000:.2f}"
    else:
        with open(rss) as f:
            cost = f"rss {f.read().split()[-1]}"
        os.remove(rss)
    with lock, open(usage, "a") as f:
        f.write(f"{os.waitstatus_to_exitcode(status)} {cost}\n")


listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(64)
with open(port_file + ".tmp", "w") as f:
    f.write(f"{listener.getsockname()[1]}\n")
os.rename(port_file + ".tmp", port_file)
n = 0
while True:
    conn, _ = listener.accept()
    n += 1
    threading.Thread(target=serve, args=(conn, n), daemon=True).start()
