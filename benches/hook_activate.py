"""Part 7 of benches/run: systemd's Accept=yes socket activation in small, for the webhook
receiver. Listens on 127.0.0.1 (its port into PORT_FILE) and runs `BIN hook ARGS...` once per
connection, the connection as fd 3, LISTEN_FDS=1 and LISTEN_PID the child's pid, as a socket
unit does. Each process's own cost is appended to USAGE as one line: exit status, CPU ms (user +
system) and peak RSS in KiB (wait4's rusage). Runs until killed.

usage: hook_activate.py PORT_FILE USAGE BIN ARGS...
"""
import os, socket, sys, threading

port_file, usage, binary, *args = sys.argv[1:]
lock = threading.Lock()


def serve(conn):
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(conn.fileno(), 3, inheritable=True)
            env = {"PATH": "/usr/bin:/bin", "LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid())}
            os.execve(binary, [binary, "hook", *args], env)
        finally:
            os._exit(127)
    conn.close()
    _, status, ru = os.wait4(pid, 0)
    cpu_ms = (ru.ru_utime + ru.ru_stime) * 1000
    with lock, open(usage, "a") as f:
        f.write(f"{os.waitstatus_to_exitcode(status)} {cpu_ms:.2f} {ru.ru_maxrss}\n")


listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(64)
with open(port_file + ".tmp", "w") as f:
    f.write(f"{listener.getsockname()[1]}\n")
os.rename(port_file + ".tmp", port_file)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
