#!/usr/bin/env bash
# The systemd host of the role's end-to-end test (tests/role_e2e.rs): a Debian rootfs booted
# with systemd-nspawn, sharing the host's network, sshd on 127.0.0.1:$SSH_PORT.
#
#   role_e2e.sh boot WORK ROOTFS   prepare ROOTFS (keys, sshd, tofu, fake forgejo-runner), boot it
#   role_e2e.sh play WORK VARS     ansible-playbook examples/ansible/site.yml against it, with the
#                                  example's inventory and group_vars, its connection in
#                                  WORK/connection.yml and -e @VARS over them
#   role_e2e.sh example-vars WORK STANDINS OUT   the example's group_vars with STANDINS swapped
#                                  in (tests/role/example_vars.py), into OUT
#   role_e2e.sh exec WORK CMD...   run CMD inside the container (nsenter into all its namespaces)
#   role_e2e.sh down WORK          stop the container (SIGTERM to nspawn = clean poweroff), tidy cgroups
#
# Needs root, systemd-container, and ANSIBLE_VENV (a venv with ansible-core). WORK holds the keys,
# the connection variables, nspawn's log and pid. `down` is safe to call any number of times.
# Two containers at once: give each its own SSH_PORT and E2E_CGROUP (a cgroup below ours that its
# nspawn runs in: nspawn makes payload/ and supervisor/ cgroups beside itself, fixed names).
# E2E_NSPAWN_ARGS: more arguments for systemd-nspawn (a --bind-ro=...).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
SSH_PORT=${SSH_PORT:-2222}
E2E_CGROUP=${E2E_CGROUP:-}
[[ $E2E_CGROUP =~ ^([a-z][a-z0-9-]*)?$ ]] || { echo "E2E_CGROUP must be a plain name" >&2; exit 2; }

# Our cgroup in hierarchy $1 (systemd or unified), and the container's (E2E_CGROUP below it).
cgroup_of() {
    local rel
    rel=$(awk -F: -v h=$1 '(h=="systemd" && $2=="name=systemd") || (h=="unified" && $1=="0") {print $3}' /proc/self/cgroup)
    echo "/sys/fs/cgroup/$1${rel%/}${E2E_CGROUP:+/$E2E_CGROUP}"
}

cmd=${1:?usage: role_e2e.sh boot|play|example-vars|exec|down WORK ...}
work=${2:?WORK directory missing}
shift 2
mkdir -p "$work"

container_pid() {
    local nspawn c
    nspawn=$(cat "$work/nspawn.pid" 2>/dev/null) || return 1
    for c in $(pgrep -P "$nspawn" || true); do
        if [ "$(cat "/proc/$c/comm" 2>/dev/null)" = systemd ]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

case "$cmd" in
boot)
    rootfs=${1:?ROOTFS missing}
    if (echo > "/dev/tcp/127.0.0.1/$SSH_PORT") 2>/dev/null; then
        echo "port $SSH_PORT is taken; the container's sshd needs it" >&2
        exit 1
    fi
    # Keys: one for Ansible, one the pool's module hands to the launch command (the "VM" key).
    for k in id_ansible id_vm; do
        [ -f "$work/$k" ] || ssh-keygen -q -t ed25519 -N '' -C "$k" -f "$work/$k"
    done
    echo e2e-host > "$rootfs/etc/hostname"
    # mmdebstrap writes no /etc/hosts; every real host has one (the "VM" is reached as localhost).
    [ -f "$rootfs/etc/hosts" ] || printf '127.0.0.1\tlocalhost e2e-host\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$rootfs/etc/hosts"
    printf 'Port %s\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n' "$SSH_PORT" \
        > "$rootfs/etc/ssh/sshd_config.d/e2e.conf"
    install -d -m 700 "$rootfs/root/.ssh"
    cat "$work/id_ansible.pub" "$work/id_vm.pub" > "$rootfs/root/.ssh/authorized_keys"
    chmod 600 "$rootfs/root/.ssh/authorized_keys"
    # The module reads the VM key from here (the service user must be able to read it).
    install -d -m 755 "$rootfs/etc/e2e"
    install -m 644 "$work/id_vm" "$rootfs/etc/e2e/id_vm"
    # The host's static tofu/terraform, and the stand-in for forgejo-runner on the "VM".
    tofu=$(command -v tofu || command -v terraform)
    install -m 755 "$tofu" "$rootfs/usr/local/bin/tofu"
    install -m 755 "$here/forgejo-runner" "$rootfs/usr/local/bin/forgejo-runner"
    # The hostile probe and the `ssh` that runs it under the default launch command (the pools'
    # PATH starts with /etc/e2e/probe-bin); the module runs its own copy of probe.sh. The ssh is
    # kept out of module/: every play copies the module file by file, a few remote calls each.
    install -d -m 755 "$rootfs/etc/e2e/probe-bin"
    install -m 755 "$here/module/probe.sh" "$rootfs/etc/e2e/probe.sh"
    install -m 755 "$here/probe-bin/ssh" "$rootfs/etc/e2e/probe-bin/ssh"
    # known_hosts for the launch command: the container's own host key.
    printf '[localhost]:%s,[127.0.0.1]:%s %s\n' "$SSH_PORT" "$SSH_PORT" "$(cut -d' ' -f1,2 "$rootfs/etc/ssh/ssh_host_ed25519_key.pub")" \
        > "$work/known_hosts"
    # The example's inventory names the operator's host: the container stands in for it, as
    # extra variables (over the inventory's). Already root there: no become.
    cat > "$work/connection.yml" <<EOF
---
ansible_host: 127.0.0.1
ansible_port: $SSH_PORT
ansible_user: root
ansible_become: false
ansible_python_interpreter: /usr/bin/python3
ansible_ssh_private_key_file: $work/id_ansible
ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null
EOF
    # --register=no --keep-unit: no systemd/machined/D-Bus on this host.
    # shellcheck disable=SC2086
    (
        if [ -n "$E2E_CGROUP" ]; then
            for h in systemd unified; do
                mkdir -p "$(cgroup_of $h)"
                echo "$BASHPID" > "$(cgroup_of $h)/cgroup.procs"
            done
        fi
        exec systemd-nspawn -D "$rootfs" -b -M "role-e2e${E2E_CGROUP:+-$E2E_CGROUP}" --register=no --keep-unit \
            --console=passive ${E2E_NSPAWN_ARGS:-}
    ) > "$work/nspawn.log" 2>&1 &
    echo $! > "$work/nspawn.pid"
    for _ in $(seq 300); do container_pid > /dev/null && break; sleep 0.1; done
    cpid=$(container_pid) || { echo "the container's systemd did not start:" >&2; cat "$work/nspawn.log" >&2; exit 1; }
    state=none
    for _ in $(seq 600); do
        state=$(nsenter -t "$cpid" -a systemctl is-system-running 2>/dev/null || true)
        case "$state" in running | degraded) break ;; esac
        sleep 0.1
    done
    case "$state" in running | degraded) ;; *) echo "the container did not finish booting ($state)" >&2; exit 1 ;; esac
    for _ in $(seq 100); do (echo > "/dev/tcp/127.0.0.1/$SSH_PORT") 2>/dev/null && break; sleep 0.1; done
    echo "booted: $state (container init pid $cpid)"
    ;;
play)
    vars=${1:?VARS file missing}
    shift
    export ANSIBLE_HOST_KEY_CHECKING=False ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 ANSIBLE_PIPELINING=True
    example=$here/../../examples/ansible
    exec "${ANSIBLE_VENV:?ANSIBLE_VENV must name a venv with ansible-core}/bin/ansible-playbook" \
        -i "$example/inventory.ini" "$example/site.yml" -e "@$work/connection.yml" -e "@$vars" "$@"
    ;;
example-vars)
    exec "${ANSIBLE_VENV:?ANSIBLE_VENV must name a venv with ansible-core}/bin/python" \
        "$here/example_vars.py" "${1:?STANDINS missing}" "${2:?OUT missing}"
    ;;
exec)
    cpid=$(container_pid) || { echo "the container is not running" >&2; exit 1; }
    exec nsenter -t "$cpid" -a "$@"
    ;;
down)
    if nspawn=$(cat "$work/nspawn.pid" 2>/dev/null) && kill -0 "$nspawn" 2>/dev/null; then
        cpid=$(container_pid || true)
        kill -TERM "$nspawn"
        for _ in $(seq 300); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$nspawn" 2>/dev/null; then
            # A container that cannot power off (its rootfs broken under it, say): killing its
            # init ends every process of its PID namespace, then nspawn exits.
            echo "nspawn $nspawn did not stop in 30 s; killing the container" >&2
            [ -n "$cpid" ] && kill -KILL "$cpid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$nspawn" 2>/dev/null || true
        fi
    fi
    rm -f "$work/nspawn.pid"
    # nspawn --keep-unit makes payload/ and supervisor/ cgroups under ours; an orderly poweroff
    # leaves them empty, a killed container leaves its whole tree. Remove them depth first.
    # (The kernel may release them a moment after nspawn exits: a few tries.)
    for _ in $(seq 25); do
        left=
        for h in systemd unified; do
            cg=$(cgroup_of $h)
            for d in "$cg/payload" "$cg/supervisor"; do
                [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
                [ ! -d "$d" ] || left=1
            done
            [ -z "$E2E_CGROUP" ] || rmdir "$cg" 2>/dev/null || true
        done
        [ -n "$left" ] || break
        sleep 0.2
    done
    true
    ;;
*)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
