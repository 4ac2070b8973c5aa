#!/usr/bin/env bash
# vm.sh create|destroy: one runner VM of examples/qemu, run by tofu's local-exec (main.tf) as the
# user tofu runs as, with the settings in its environment (VM_*, set by main.tf).
#
# create: everything of the VM lives in $VM_DIR (0700): its login key and host key (new for each
#   VM), the cloud-init NoCloud seed that carries them (seed.img, a FAT image labelled cidata), a
#   copy-on-write overlay over the base image (overlay.qcow2), the console log, and vm.json, which
#   main.tf turns into outputs. QEMU boots the image's kernel and initrd directly (of the one
#   version $VM_IMAGE_DIR/current names, read once), supervised by systemd (a transient unit of
#   the user's own manager, or of the system manager for root, with memory and CPU limits) or,
#   without systemd, daemonized with a pid file (refused inside a systemd unit, whose end would
#   kill the VM). SSH is forwarded from a free port on
#   127.0.0.1. The apply succeeds only once the VM's own systemd has started (its console says
#   so): a VM that does not boot, or whose QEMU died, is a failed apply, and then nothing of it is
#   left (the create cleans up after itself, since tofu runs no destroy provisioner for a resource
#   whose create failed).
#   VM_ACCEL=auto tries KVM (with a pid file: when /dev/kvm can be opened) and keeps it only if the
#   guest boots under it within VM_KVM_PROOF_SECONDS (a /dev/kvm whose guests hang exists); else
#   it boots with TCG.
#   The guest's CPU: VM_KVM_CPU (default host) under KVM, VM_TCG_CPU (default qemu64, which TCG
#   runs faster than max) under TCG.
#   The network (VM_NETWORK): QEMU's user network card carries SSH and the forwards only
#   (restrict=on: nothing else of this host, its loopback included); jobs reach the internet
#   through a second card: passt (the default; --no-map-gw: its gateway is not this host's
#   loopback, though what this host reaches otherwise is reached; it forwards no port) or a bridge; isolated: no second card; user: the one card unrestricted,
#   whose 10.0.2.2 is this host's loopback (every service listening there): an opt-in, warned of.
#
# destroy: stops the VM (its units, or the pid in qemu.pid if it is this VM's QEMU), then ends any
#   process left whose command line names this VM's directory, and removes the directory. Exits
#   non-zero unless no such process is left: tofu then keeps the VM in its state and the next
#   destroy tries again.
set -eu
action=${1:?usage: vm.sh create|destroy}
: "${VM_DIR:?VM_DIR is not set (main.tf sets it)}"
: "${VM_NAME:?VM_NAME is not set (main.tf sets it)}"
case $VM_DIR in
/*/*) ;;
*) echo "vm.sh: VM_DIR '$VM_DIR' is not an absolute path below a directory" >&2; exit 1 ;;
esac
say() { echo "vm.sh: $VM_NAME: $*" >&2; }
unit=ci-vm-$VM_NAME
# passt, the VM's network to the internet (VM_NETWORK=passt): a unit of its own beside QEMU's.
net_unit=$unit-net

# How the VM's QEMU is supervised: systemd-user, systemd-system or pidfile (written by create).
supervisor_of() {
    want=${VM_SUPERVISOR:-auto}
    if [ "$want" = auto ]; then
        if [ "$(id -u)" != 0 ] && systemctl --user show-environment > /dev/null 2>&1; then
            want=systemd-user
        elif [ "$(id -u)" = 0 ] && [ -d /run/systemd/system ]; then
            want=systemd-system
        else
            want=pidfile
        fi
    fi
    echo "$want"
}
sctl() {
    case $supervisor in
    systemd-user) systemctl --user "$@" ;;
    *) systemctl "$@" ;;
    esac
}

# The processes whose command line names the path $1 (whoever started them): one grep over
# every /proc/PID/cmdline, its pattern written so that it never matches grep's own.
naming() {
    local esc
    esc=$(printf '%s' "$1" | sed 's/[].[\*^$]/\\&/g')
    grep -la -e "[${esc:0:1}]${esc:1}" /proc/[0-9]*/cmdline 2> /dev/null |
        sed -n 's|^/proc/\([0-9]*\)/cmdline$|\1|p' | grep -vx -e "$$" || true
}
# Every process of this VM (its QEMU, its passt): their command lines name $VM_DIR.
ours() { naming "$VM_DIR/"; }
# This VM's QEMU alone: its command line names the overlay.
qemu_pids() { naming "$VM_DIR/overlay.qcow2"; }

# Stops whatever runs of this VM; 0 once no process of it is left.
stop_vm() {
    supervisor=$(cat "$VM_DIR/supervisor" 2> /dev/null || supervisor_of)
    case $supervisor in
    systemd-user | systemd-system)
        # Stops it if it runs (SIGTERM, SIGKILL after the unit's TimeoutStopSec=), forgets it.
        for u in "$unit" "$net_unit"; do
            sctl stop "$u.service" > /dev/null 2>&1 || true
            sctl reset-failed "$u.service" > /dev/null 2>&1 || true
        done
        ;;
    esac
    pids=$(ours)
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2> /dev/null || true
        n=0
        while [ -n "$(ours)" ] && [ "$n" -lt 50 ]; do
            sleep 0.2
            n=$((n + 1))
        done
        pids=$(ours)
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -KILL $pids 2> /dev/null || true
        n=0
        while [ -n "$(ours)" ] && [ "$n" -lt 25 ]; do
            sleep 0.2
            n=$((n + 1))
        done
    fi
    left=$(ours)
    if [ -n "$left" ]; then
        say "processes ${left//$'\n'/ } of this VM still run after SIGKILL"
        return 1
    fi
    return 0
}

# passt's socket directory: $VM_DIR/net, or the one in /run that file names (passt as root).
remove_passt_dir() {
    local d
    if [ -f "$VM_DIR/net" ]; then
        d=$(cat "$VM_DIR/net")
        case $d in /run/ci-vm-net.*) rm -rf -- "$d" ;; esac
    fi
    rm -rf -- "$VM_DIR/net"
}

remove_vm() {
    stop_vm || return 1
    remove_passt_dir
    rm -rf -- "$VM_DIR"
}

if [ "$action" = destroy ]; then
    if [ ! -e "$VM_DIR" ] && [ -z "$(ours)" ]; then
        exit 0
    fi
    if ! remove_vm; then
        say "not destroyed: a process of it is left (see above); the next destroy tries again"
        exit 1
    fi
    say "destroyed: QEMU stopped, $VM_DIR removed"
    exit 0
fi
[ "$action" = create ] || { echo "vm.sh: unknown action '$action' (create or destroy)" >&2; exit 2; }

: "${VM_IMAGE_DIR:?VM_IMAGE_DIR is not set}"
qemu=${VM_QEMU:-qemu-system-x86_64}
passt=${VM_PASST:-passt}
network=${VM_NETWORK:-passt}
# The image: build-image publishes each build in a directory of its own and then points the
# symlink current at it (one rename), so one readlink names the disk, kernel and initrd of one
# build; a directory of the three files (as build-image wrote them before) is taken as it is.
image=$VM_IMAGE_DIR
# Held (shared) until the VM has booted: a build-image publishing meanwhile waits (it holds .lock
# while it removes builds no running process holds open), so the build resolved here stays.
if [ -r "$VM_IMAGE_DIR/.lock" ]; then
    exec 8< "$VM_IMAGE_DIR/.lock"
    flock -s 8
fi
if [ -L "$VM_IMAGE_DIR/current" ]; then
    image=$(readlink -f -- "$VM_IMAGE_DIR/current") || {
        say "$VM_IMAGE_DIR/current does not resolve: build the image again with examples/qemu/build-image --out $VM_IMAGE_DIR"
        exit 1
    }
fi
case $image in
*,* | *"
"*) say "the image directory $image has a comma or a line break (QEMU's options)"; exit 1 ;;
esac
for f in disk.qcow2 vmlinuz initrd.img; do
    [ -r "$image/$f" ] || {
        say "the base image has no readable $image/$f: build it with examples/qemu/build-image --out $VM_IMAGE_DIR (image_dir)"
        exit 1
    }
done
case $network in
passt | isolated | user) ;;
bridge) [ -n "${VM_BRIDGE:-}" ] || { say "network bridge needs the bridge's name (bridge)"; exit 1; } ;;
*) say "VM_NETWORK '$network' is not passt, isolated, bridge or user"; exit 1 ;;
esac
tools="$qemu qemu-img ssh-keygen mformat mcopy"
[ "$network" != passt ] || tools="$tools $passt"
for tool in $tools; do
    command -v "$tool" > /dev/null || {
        say "$tool is not installed on this host (Debian: qemu-system-x86, qemu-utils, openssh-client, mtools; passt for network passt)"
        exit 1
    }
done
supervisor=$(supervisor_of)
# With a pid file QEMU would run inside the unit that runs this script: in its sandbox, where
# TCG cannot run (MemoryDenyWriteExecute=), and killed with the rest of the unit when it ends.
if [ "$supervisor" = pidfile ] && [ -n "${INVOCATION_ID:-}" ]; then
    say "QEMU would run with a pid file inside this systemd unit (INVOCATION_ID is set), whose sandbox stops TCG and whose end kills the VM: give this pool a systemd user manager (the Ansible role: systemd_user_manager: true; its manager must run: systemctl status user@$(id -u).service), or run tofu as root (supervisor systemd-system)"
    exit 1
fi
if [ "$network" = user ]; then
    say "WARNING: network user: jobs in this VM reach every service listening on this host's loopback (10.0.2.2), the other VMs' SSH included; use passt, isolated or a bridge for jobs you do not trust"
fi

# A create that runs again (tofu re-applies after a killed apply) starts from nothing.
if [ -e "$VM_DIR" ] || [ -n "$(ours)" ]; then
    say "removing what an earlier, unfinished create left"
    remove_vm || exit 1
fi
umask 077
mkdir -p "$VM_DIR"
echo "$supervisor" > "$VM_DIR/supervisor"
# From here on a failure removes everything this create made.
created=no
trap '[ "$created" = yes ] || remove_vm || true' EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

ssh-keygen -q -t ed25519 -N '' -C "login@$VM_NAME" -f "$VM_DIR/login"
ssh-keygen -q -t ed25519 -N '' -C "root@$VM_NAME" -f "$VM_DIR/host"

# The NoCloud seed. The user data puts the host key in place before sshd starts, creates the login
# user with the login key, lets only that user in, by key; and the forwards to the host.
indent() { sed 's/^/      /' "$1"; }
{
    cat << EOF
#cloud-config
# examples/qemu: VM $VM_NAME. ssh_keys: this VM's own host key (the launch checks it); the image
# has none.
ssh_deletekeys: true
ssh_keys:
  ed25519_private: |
$(sed 's/^/    /' "$VM_DIR/host")
  ed25519_public: $(cat "$VM_DIR/host.pub")
ssh_pwauth: false
disable_root: true
users:
  - name: $VM_SSH_USER
    gecos: Forgejo runner
    shell: /bin/bash
    lock_passwd: true
EOF
    if [ "${VM_RUNNER_SUDO:-false}" = true ]; then
        echo '    sudo: "ALL=(ALL) NOPASSWD:ALL"'
    fi
    cat << EOF
    ssh_authorized_keys:
      - $(cat "$VM_DIR/login.pub")
write_files:
  - path: /etc/ssh/sshd_config.d/10-forgejo-runner.conf
    permissions: "0644"
    content: |
      HostKey /etc/ssh/ssh_host_ed25519_key
      AllowUsers $VM_SSH_USER
      PermitRootLogin no
      PasswordAuthentication no
      KbdInteractiveAuthentication no
EOF
    # Each forward: guest address N -> 10.0.2.(100+N) in QEMU's user network. A loopback address
    # in the VM gets a socket-activated proxy to it; a name gets an /etc/hosts line.
    i=0
    printf '%s\n' "${VM_FORWARDS:-}" | while IFS=' ' read -r guest host; do
        [ -n "$guest" ] || continue
        gaddr=${guest%:*} gport=${guest##*:}
        ip=10.0.2.$((100 + i))
        case $gaddr in
        127.*)
            cat << EOF
  - path: /etc/systemd/system/ci-forward-$i.socket
    permissions: "0644"
    content: |
      [Unit]
      Description=$guest in this VM is $host on the provisioner host (examples/qemu)
      [Socket]
      ListenStream=$guest
      [Install]
      WantedBy=sockets.target
  - path: /etc/systemd/system/ci-forward-$i.service
    permissions: "0644"
    content: |
      [Unit]
      Description=$guest in this VM is $host on the provisioner host (examples/qemu)
      [Service]
      ExecStart=/lib/systemd/systemd-socket-proxyd $ip:$gport
      DynamicUser=yes
EOF
            ;;
        *)
            cat << EOF
  - path: /etc/hosts
    append: true
    content: |
      $ip $gaddr
EOF
            ;;
        esac
        i=$((i + 1))
    done
    cat << EOF
bootcmd:
  - [install, -d, -m, "0700", -o, "0", -g, "0", /run/ci-ephemeral]
runcmd:
  - [install, -d, -m, "0700", -o, "$VM_SSH_USER", -g, "$VM_SSH_USER", "$VM_RUNNER_DIR"]
EOF
    i=0
    printf '%s\n' "${VM_FORWARDS:-}" | while IFS=' ' read -r guest host; do
        [ -n "$guest" ] || continue
        case ${guest%:*} in
        127.*) echo "  - [systemctl, enable, --now, ci-forward-$i.socket]" ;;
        esac
        i=$((i + 1))
    done
} > "$VM_DIR/user-data"
printf 'instance-id: %s\nlocal-hostname: %s\n' "$VM_NAME" "${VM_HOSTNAME:-runner}" > "$VM_DIR/meta-data"
mformat -i "$VM_DIR/seed.img" -C -T 2880 -v CIDATA :: > /dev/null
mcopy -i "$VM_DIR/seed.img" "$VM_DIR/user-data" "$VM_DIR/meta-data" ::
# The seed holds the host's private key; the VM's copy is all it needs.
rm -f "$VM_DIR/user-data" "$VM_DIR/host"

# Net: QEMU's user network carries SSH, forwarded from 127.0.0.1:PORT, and the forwards; it is
# restricted (restrict=on: slirp takes the guest's connections nowhere else, not to 10.0.2.2,
# which would be this host's loopback) and without IPv6, in every mode but user. The jobs'
# network is a second card: passt's or a bridge's.
guestfwds=
i=0
while IFS=' ' read -r guest host; do
    [ -n "$guest" ] || continue
    guestfwds="$guestfwds,guestfwd=tcp:10.0.2.$((100 + i)):${guest##*:}-cmd:${VM_SOCAT:-socat} - TCP:$host"
    i=$((i + 1))
done << EOF
${VM_FORWARDS:-}
EOF
if [ "$network" = user ]; then
    usernet=restrict=off
else
    usernet=restrict=on,ipv6=off
fi

# passt's DNS servers for the VM: VM_DNS, else this host's (resolv.conf, or systemd-resolved's
# upstream servers behind its 127.0.0.53), never one on this host's loopback (--no-map-gw: the
# VM cannot reach it, and should not).
dns_servers() {
    local f found
    if [ -n "${VM_DNS:-}" ]; then
        printf '%s\n' "$VM_DNS" | tr ' ' '\n'
        return
    fi
    for f in /etc/resolv.conf /run/systemd/resolve/resolv.conf; do
        found=$(sed -n 's/^[[:space:]]*nameserver[[:space:]][[:space:]]*\([0-9A-Fa-f.:]*\)[[:space:]]*$/\1/p' "$f" 2> /dev/null |
            grep -v -x -e '127\..*' -e '::1' -e '0\.0\.0\.0' -e '::' || true)
        if [ -n "$found" ]; then
            printf '%s\n' "$found"
            return
        fi
    done
}
if [ "$network" = passt ]; then
    dns=$(dns_servers)
    [ -n "$dns" ] || say "WARNING: no DNS server for the VM: this host's resolv.conf names only its own loopback; set dns"
fi

# Free port: a random one of the range that nothing answers on; QEMU binding it is the proof
# (another process may take it meanwhile: then QEMU fails and the next port is tried).
pick_port() {
    lo=${VM_PORT_MIN:-20000} hi=${VM_PORT_MAX:-29999}
    n=0
    while [ "$n" -lt 50 ]; do
        p=$((lo + $(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % (hi - lo + 1)))
        if ! (: < /dev/tcp/127.0.0.1/"$p") 2> /dev/null; then
            echo "$p"
            return 0
        fi
        n=$((n + 1))
    done
    return 1
}

# Whether this VM's QEMU holds the listening socket on 127.0.0.1:$1 (another VM's QEMU may have
# bound that port between pick_port and ours: then the port answers, and ours exits a moment
# later). The socket's inode from /proc/self/net/tcp, among the descriptors of our QEMU.
listening_is_ours() {
    local want inodes pid fd link
    want=$(printf '0100007F:%04X' "$1")
    inodes=$(awk -v a="$want" '$2 == a && $4 == "0A" { print $10 }' /proc/self/net/tcp 2> /dev/null)
    [ -n "$inodes" ] || return 1
    for pid in $(qemu_pids); do
        for fd in /proc/"$pid"/fd/*; do
            link=$(readlink "$fd" 2> /dev/null) || continue
            for inode in $inodes; do
                [ "$link" != "socket:[$inode]" ] || return 0
            done
        done
    done
    return 1
}

cmdline="root=LABEL=root rw console=ttyS0 panic=-1 ${VM_KERNEL_ARGS:-}"
# Beside passt or a bridge, the user network card (MAC 52:54:00:c1:00:01) gives no route and no
# DNS: the image's 40-user-bridged.network matches it under ci.bridge.
case $network in passt | bridge) cmdline="$cmdline ci.bridge" ;; esac
# QEMU's argv for accel $1 and port $2 (one word per line; no word holds a newline).
qemu_args() {
    cat << EOF
-name
$VM_NAME
-machine
q35,accel=$1
-cpu
$([ "$1" = kvm ] && echo "${VM_KVM_CPU:-host}" || echo "${VM_TCG_CPU:-qemu64}")
-smp
$VM_CPUS
-m
$VM_MEMORY
-nodefaults
-no-user-config
-display
none
-no-reboot
-kernel
$image/vmlinuz
-initrd
$image/initrd.img
-append
$cmdline
-drive
if=virtio,file=$VM_DIR/overlay.qcow2,format=qcow2,discard=unmap
-drive
if=virtio,file=$VM_DIR/seed.img,format=raw,readonly=on
-netdev
user,id=n0,$usernet,hostfwd=tcp:127.0.0.1:$2-:22$guestfwds
-device
virtio-net-pci,netdev=n0,mac=52:54:00:c1:00:01
-serial
file:$VM_DIR/console.log
-device
virtio-rng-pci
EOF
    # A MAC of its own for the jobs' card, random (QEMU's prefix).
    mac=52:54:00:$(od -An -N3 -tx1 /dev/urandom | sed 's/^ *//; s/ /:/g')
    case $network in
    passt)
        printf '%s\n' -netdev "stream,id=n1,server=off,addr.type=unix,addr.path=$passt_dir/passt.sock" \
            -device "virtio-net-pci,netdev=n1,mac=$mac"
        ;;
    bridge)
        printf '%s\n' -netdev "bridge,id=n1,br=$VM_BRIDGE" -device "virtio-net-pci,netdev=n1,mac=$mac"
        ;;
    esac
    if [ "$supervisor" = pidfile ]; then
        printf '%s\n' -daemonize -pidfile "$VM_DIR/qemu.pid"
    fi
}

# Starts passt, the VM's network to the internet: it serves QEMU's card on
# $passt_dir/passt.sock, forwards no port, and does not map its gateway to this host
# (--no-map-gw). It runs until the VM is stopped (passt's --one-off, which would end it with
# QEMU, ends it at once in Debian bookworm's passt, before QEMU connects). $passt_dir is
# $VM_DIR/net; started as root, passt becomes nobody before it binds its socket, where nobody
# may not reach $VM_DIR: then it is a directory of nobody's in /run, named in $VM_DIR/net.
# 0 once it listens.
start_passt() {
    remove_passt_dir
    rm -f "$VM_DIR/passt.log"
    if [ "$(id -u)" = 0 ]; then
        passt_dir=$(mktemp -d /run/ci-vm-net.XXXXXXXX) || return 1
        printf '%s\n' "$passt_dir" > "$VM_DIR/net"
        chown nobody:"$(id -gn nobody)" "$passt_dir"
        set -- --runas "$(id -u nobody):$(id -g nobody)"
    else
        passt_dir=$VM_DIR/net
        mkdir -m 0700 "$passt_dir"
    fi
    set -- "$@" --no-map-gw -t none -u none -s "$passt_dir/passt.sock" -l "$VM_DIR/passt.log"
    for d in $dns; do set -- "$@" -D "$d"; done
    case $supervisor in
    systemd-user | systemd-system)
        sctl reset-failed "$net_unit.service" > /dev/null 2>&1 || true
        # passt sandboxes itself (namespaces, seccomp); it needs netlink for this host's routes.
        set -- --quiet --collect --unit="$net_unit" --description="examples/qemu runner VM $VM_NAME: passt" \
            -p "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK" -p TasksMax=16 \
            -p StandardOutput=file:"$VM_DIR/passt.out" -p StandardError=file:"$VM_DIR/passt.out" \
            -- "$passt" -f "$@"
        [ "$supervisor" != systemd-user ] || set -- --user "$@"
        if ! systemd-run "$@" > "$VM_DIR/systemd-run.log" 2>&1; then
            say "systemd-run (passt) failed: $(tail -n 3 "$VM_DIR/systemd-run.log")"
            return 1
        fi
        ;;
    pidfile)
        # It daemonizes itself (a session of its own), as QEMU does with -daemonize.
        if ! "$passt" "$@" < /dev/null > "$VM_DIR/passt.out" 2>&1 8<&-; then
            say "passt did not start: $(tail -n 5 "$VM_DIR/passt.out" | tr '\n' ' ')"
            return 1
        fi
        ;;
    esac
    # It logs this line once it bound its socket (also when binding failed: the socket tells).
    n=0
    while [ "$n" -lt 100 ]; do
        if grep -q 'UNIX domain socket bound at' "$VM_DIR/passt.log" 2> /dev/null; then
            [ -S "$passt_dir/passt.sock" ] && return 0
            break
        fi
        sleep 0.1
        n=$((n + 1))
    done
    say "passt did not start: $(cat "$VM_DIR/passt.log" "$VM_DIR/passt.out" 2> /dev/null | tail -n 5 | tr '\n' ' ')"
    return 1
}

# Starts QEMU (accel $1, port $2); 0 once it runs with its forwards set up.
start_qemu() {
    sq_port=$2
    rm -f "$VM_DIR/overlay.qcow2" "$VM_DIR/console.log" "$VM_DIR/qemu.log"
    qemu-img create -q -f qcow2 -F qcow2 -b "$image/disk.qcow2" "$VM_DIR/overlay.qcow2"
    : > "$VM_DIR/console.log"
    if [ "$network" = passt ]; then
        start_passt || return 1
    fi
    args=$(qemu_args "$1" "$2")
    old_ifs=$IFS
    IFS='
'
    # shellcheck disable=SC2086
    set -- $args
    IFS=$old_ifs
    case $supervisor in
    systemd-user | systemd-system)
        mem_max=$((VM_MEMORY + 512))
        sctl reset-failed "$unit.service" > /dev/null 2>&1 || true
        set -- --quiet --collect --unit="$unit" --description="examples/qemu runner VM $VM_NAME" \
            -p MemoryMax="${mem_max}M" -p CPUQuota="$((VM_CPUS * 100))%" -p TasksMax=256 \
            -p StandardOutput=file:"$VM_DIR/qemu.log" -p StandardError=file:"$VM_DIR/qemu.log" \
            -- "$qemu" "$@"
        if [ "$network" = passt ]; then
            # passt's end ends the VM's network: then its QEMU too.
            set -- -p BindsTo="$net_unit.service" -p After="$net_unit.service" "$@"
        fi
        [ "$supervisor" != systemd-user ] || set -- --user "$@"
        if ! systemd-run "$@" > "$VM_DIR/systemd-run.log" 2>&1; then
            say "systemd-run failed: $(tail -n 3 "$VM_DIR/systemd-run.log")"
            return 1
        fi
        ;;
    pidfile)
        if ! "$qemu" "$@" > "$VM_DIR/qemu.log" 2>&1 8<&-; then
            return 1
        fi
        ;;
    esac
    # Up once our QEMU listens on the forward; gone if it is. (Another VM's QEMU may answer on
    # the port: then ours fails to bind it and exits.)
    n=0
    while [ "$n" -lt 100 ]; do
        if [ -z "$(qemu_pids)" ]; then
            [ "$n" -lt 5 ] || return 1
        elif listening_is_ours "$sq_port"; then
            return 0
        fi
        sleep 0.1
        n=$((n + 1))
    done
    return 1
}

# Waits (at most $1 seconds) for the VM's own systemd to start: its banner on the console.
booted() {
    n=0
    while [ "$n" -lt $(($1 * 5)) ]; do
        if grep -q -e '^Welcome to ' -e 'systemd\[1\]: ' "$VM_DIR/console.log" 2> /dev/null; then
            return 0
        fi
        [ -n "$(qemu_pids)" ] || return 2
        sleep 0.2
        n=$((n + 1))
    done
    return 1
}

# Which accelerators to try, in order.
case ${VM_ACCEL:-auto} in
kvm) accels=kvm ;;
tcg) accels=tcg ;;
auto)
    # Under a systemd supervisor QEMU runs outside this process's sandbox (the role's units have
    # PrivateDevices=: no /dev/kvm here at all), so QEMU itself tries KVM, and fails at once
    # without it. With a pid file, QEMU opens the device this process sees.
    if [ "$supervisor" != pidfile ] || { [ -r /dev/kvm ] && [ -w /dev/kvm ]; }; then
        accels="kvm tcg"
    else
        accels=tcg
    fi
    ;;
*) say "VM_ACCEL '${VM_ACCEL:-}' is not auto, kvm or tcg"; exit 1 ;;
esac

port=
accel=
for a in $accels; do
    tries=0
    started=no
    taken=no
    while [ "$tries" -lt 5 ]; do
        tries=$((tries + 1))
        p=$(pick_port) || { say "no free port in ${VM_PORT_MIN:-20000}-${VM_PORT_MAX:-29999} for SSH"; exit 1; }
        if start_qemu "$a" "$p"; then
            started=yes
            break
        fi
        if grep -q -i 'forwarding rule' "$VM_DIR/qemu.log" 2> /dev/null; then
            taken=yes
            stop_vm || exit 1
            continue # the port was taken meanwhile
        fi
        taken=no
        say "QEMU ($a) did not start: $(tail -n 5 "$VM_DIR/qemu.log" 2> /dev/null | tr '\n' ' ')"
        stop_vm || exit 1
        break
    done
    if [ "$started" = no ] && [ "$taken" = yes ]; then
        say "QEMU ($a) could bind no SSH port of ${VM_PORT_MIN:-20000}-${VM_PORT_MAX:-29999} in $tries tries: each was taken before it bound it (widen ssh_port_range)"
    fi
    [ "$started" = yes ] || { [ "$a" = kvm ] && [ "${VM_ACCEL:-auto}" = auto ] && continue; exit 1; }
    if [ "$a" = kvm ] && [ "${VM_ACCEL:-auto}" = auto ]; then
        rc=0
        booted "${VM_KVM_PROOF_SECONDS:-20}" || rc=$?
        if [ "$rc" -ne 0 ]; then
            say "KVM: the guest did not boot within ${VM_KVM_PROOF_SECONDS:-20}s under KVM (a /dev/kvm whose guests hang?); booting it with TCG"
            stop_vm || exit 1
            continue
        fi
    fi
    port=$p
    accel=$a
    break
done
[ -n "$port" ] || { say "no accelerator booted the VM"; exit 1; }
rc=0
booted "${VM_BOOT_SECONDS:-120}" || rc=$?
if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 2 ]; then
        say "QEMU exited while the VM booted: $(tail -n 5 "$VM_DIR/qemu.log" 2> /dev/null | tr '\n' ' ')"
    else
        say "the VM's systemd did not start within ${VM_BOOT_SECONDS:-120}s ($accel)"
    fi
    say "the end of its console:"
    tail -n 15 "$VM_DIR/console.log" | sed 's/^/    /' >&2
    exit 1
fi
known_hosts="[127.0.0.1]:$port $(cut -d ' ' -f 1,2 "$VM_DIR/host.pub")"
printf '{"ssh_port": %s, "accel": "%s", "supervisor": "%s", "network": "%s", "known_hosts": "%s"}\n' \
    "$port" "$accel" "$supervisor" "$network" "$known_hosts" > "$VM_DIR/vm.json.part"
mv -f "$VM_DIR/vm.json.part" "$VM_DIR/vm.json"
[ -n "$(qemu_pids)" ] || { say "QEMU exited right after the boot"; exit 1; }
created=yes
say "up: $accel, $supervisor, network $network, ssh on 127.0.0.1:$port"
