# Set by ci-ephemeral-provisioner for every cycle (TF_VAR_cycle_id): lower-case letters, digits
# and "-". It names the VM, its directory and its systemd unit (ci-vm-<name_prefix><cycle_id>).
variable "cycle_id" {
  type        = string
  description = "The provisioner's cycle id (TF_VAR_cycle_id)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.cycle_id))
    error_message = "cycle_id must be lower-case letters, digits and -: it names the VM's directory and unit."
  }
}

# Set by ci-ephemeral-provisioner (TF_VAR_slot). Unused: the cycle id already makes every name unique.
variable "slot" {
  type        = number
  default     = 1
  description = "The pool's slot of this cycle (TF_VAR_slot)."
}

variable "name_prefix" {
  type        = string
  default     = "ci-"
  description = "Prefix of the VM's name (<prefix><cycle_id>)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.name_prefix))
    error_message = "name_prefix must be lower-case letters, digits and -."
  }
}

# --- The VM ---------------------------------------------------------------------------------

variable "image_dir" {
  type        = string
  default     = "/var/lib/ci-ephemeral-qemu/image"
  description = "Where build-image put the base image (disk.qcow2, vmlinuz, initrd.img); readable by the pool's user."

  validation {
    condition     = can(regex("^[^,\n]+$", var.image_dir))
    error_message = "image_dir must be a path without a comma or a line break (QEMU's options)."
  }
}

variable "vm_dir" {
  type        = string
  default     = "~/qemu-vms"
  description = "Directory of the VMs' overlays, seeds and keys (one directory per VM); ~ is tofu's $HOME (the role: the pool's state directory)."

  validation {
    condition     = can(regex("^[^,\n]+$", var.vm_dir))
    error_message = "vm_dir must be a path without a comma or a line break (QEMU's -drive options)."
  }
}

variable "memory" {
  type        = number
  default     = 2048
  description = "The VM's memory in MiB (its unit's MemoryMax= is 512 MiB more, for QEMU)."

  validation {
    condition     = var.memory >= 512 && floor(var.memory) == var.memory
    error_message = "memory must be a whole number of MiB, at least 512."
  }
}

variable "cpus" {
  type        = number
  default     = 2
  description = "The VM's virtual CPUs (its unit's CPUQuota= is as many CPUs)."

  validation {
    condition     = var.cpus >= 1 && var.cpus <= 64 && floor(var.cpus) == var.cpus
    error_message = "cpus must be a whole number from 1 to 64."
  }
}

variable "accel" {
  type        = string
  default     = "auto"
  description = "kvm, tcg (emulation: slow, works everywhere) or auto: KVM if the guest boots under it within kvm_proof_seconds, else TCG."

  validation {
    condition     = contains(["auto", "kvm", "tcg"], var.accel)
    error_message = "accel must be auto, kvm or tcg."
  }
}

variable "kvm_proof_seconds" {
  type        = number
  default     = 20
  description = "With accel auto: how long the guest may take to start its systemd under KVM before it is booted with TCG instead."

  validation {
    condition     = var.kvm_proof_seconds >= 1 && floor(var.kvm_proof_seconds) == var.kvm_proof_seconds
    error_message = "kvm_proof_seconds must be a whole number of seconds, at least 1."
  }
}

variable "boot_seconds" {
  type        = number
  default     = 180
  description = "How long the apply waits for the VM's systemd to start (then the apply fails and nothing of the VM is left)."

  validation {
    condition     = var.boot_seconds >= 1 && floor(var.boot_seconds) == var.boot_seconds
    error_message = "boot_seconds must be a whole number of seconds, at least 1."
  }
}

variable "supervisor" {
  type        = string
  default     = "auto"
  description = "How QEMU runs: systemd-user (a transient unit of the user's own systemd manager), systemd-system (root), pidfile (daemonized, without systemd), or auto (in that order, whichever works)."

  validation {
    condition     = contains(["auto", "systemd-user", "systemd-system", "pidfile"], var.supervisor)
    error_message = "supervisor must be auto, systemd-user, systemd-system or pidfile."
  }
}

variable "qemu_bin" {
  type        = string
  default     = "qemu-system-x86_64"
  description = "QEMU for x86-64 (Debian: qemu-system-x86)."
}

# --- The network ----------------------------------------------------------------------------

variable "ssh_port_range" {
  type        = list(number)
  default     = [20000, 29999]
  description = "The ports of 127.0.0.1 a VM's SSH forward is chosen from (a free one, at random)."

  validation {
    condition     = length(var.ssh_port_range) == 2 && var.ssh_port_range[0] >= 1024 && var.ssh_port_range[0] <= var.ssh_port_range[1] && var.ssh_port_range[1] <= 65535
    error_message = "ssh_port_range must be [first, last], 1024 <= first <= last <= 65535."
  }
}

variable "network" {
  type        = string
  default     = "passt"
  description = "The jobs' network: passt (what this host reaches, through passt, but its loopback: its other addresses and the LAN too), isolated (the forwards only), bridge (a host bridge, see bridge) or user (QEMU's unrestricted user network: this host's loopback too, 10.0.2.2; not for untrusted jobs)."

  validation {
    condition     = contains(["passt", "isolated", "bridge", "user"], var.network)
    error_message = "network must be passt, isolated, bridge or user."
  }
}

variable "dns" {
  type        = list(string)
  default     = []
  description = "DNS servers for network passt (IPv4 or IPv6 addresses); empty: this host's, unless they are on its loopback (systemd-resolved's upstream servers are taken instead of its 127.0.0.53)."

  validation {
    condition     = alltrue([for d in var.dns : can(regex("^[0-9A-Fa-f.:]+$", d))])
    error_message = "dns: each entry must be an IPv4 or IPv6 address."
  }
}

variable "forwards" {
  type = list(object({
    guest = string
    host  = string
  }))
  default     = []
  description = "Connections the VM makes to guest (ADDRESS:PORT: a 127.x address, or a name) that arrive at host (ADDRESS:PORT on this host, through socat): e.g. a Forgejo on this host."

  validation {
    condition     = alltrue([for f in var.forwards : can(regex("^[A-Za-z0-9.-]+:[0-9]+$", f.guest)) && can(regex("^[A-Za-z0-9.-]+:[0-9]+$", f.host))]) && length(var.forwards) <= 100
    error_message = "forwards: each guest and host must be ADDRESS:PORT (a name or IPv4 address), at most 100 of them."
  }
}

variable "bridge" {
  type        = string
  default     = ""
  description = "With network bridge: a host bridge (e.g. br0) for the jobs' network card, through qemu-bridge-helper (allowed in /etc/qemu/bridge.conf, with the privileges it needs)."

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]{0,15}$", var.bridge))
    error_message = "bridge must be an interface name (at most 15 letters, digits, _, . and -) or empty."
  }
}

# --- What the launch command expects on the VM ----------------------------------------------

# Must equal the pool's launch.ssh_user (role default: runner).
variable "ssh_user" {
  type        = string
  default     = "runner"
  description = "The user the launch command logs in as; jobs run as this user."

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,30}$", var.ssh_user)) && var.ssh_user != "root"
    error_message = "ssh_user must be a plain user name (lower-case letters, digits, _ and -), not root."
  }
}

# Must equal the pool's launch.runner_dir (role default: /var/lib/forgejo-runner).
variable "runner_dir" {
  type        = string
  default     = "/var/lib/forgejo-runner"
  description = "Directory (owned by ssh_user, 0700) for the runner token files and logs."

  validation {
    condition     = can(regex("^/[A-Za-z0-9._/-]+$", var.runner_dir))
    error_message = "runner_dir must be an absolute path of letters, digits, ., _, - and /."
  }
}

variable "runner_sudo" {
  type        = bool
  default     = false
  description = "Give ssh_user passwordless sudo (jobs can then become root in the VM)."
}
