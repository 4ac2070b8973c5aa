# One ephemeral runner VM per provisioner cycle, on the provisioner's own host, for the Ansible
# role's default launch command: QEMU boots a copy-on-write overlay of the base image that
# build-image made; cloud-init (a NoCloud seed) gives the VM a login key and a host key of its
# own; SSH reaches it on a port of 127.0.0.1 chosen for this VM. vm.sh does the work; README.md
# beside this file: when to pick it, the pool entry, the host's packages.

locals {
  name = "${var.name_prefix}${var.cycle_id}"
  # Everything of the VM (keys, seed, overlay, console log) lives here, removed by the destroy.
  dir = "${pathexpand(var.vm_dir)}/${local.name}"

  environment = {
    VM_NAME              = local.name
    VM_DIR               = local.dir
    VM_IMAGE_DIR         = pathexpand(var.image_dir)
    VM_MEMORY            = tostring(var.memory)
    VM_CPUS              = tostring(var.cpus)
    VM_ACCEL             = var.accel
    VM_KVM_PROOF_SECONDS = tostring(var.kvm_proof_seconds)
    VM_BOOT_SECONDS      = tostring(var.boot_seconds)
    VM_SUPERVISOR        = var.supervisor
    VM_SSH_USER          = var.ssh_user
    VM_RUNNER_DIR        = var.runner_dir
    VM_RUNNER_SUDO       = tostring(var.runner_sudo)
    VM_NETWORK           = var.network
    VM_DNS               = join(" ", var.dns)
    VM_FORWARDS          = join("\n", [for f in var.forwards : "${f.guest} ${f.host}"])
    VM_BRIDGE            = var.bridge
    VM_PORT_MIN          = tostring(var.ssh_port_range[0])
    VM_PORT_MAX          = tostring(var.ssh_port_range[1])
    VM_QEMU              = var.qemu_bin
  }

  # What vm.sh create wrote (vm.json: the port, the host key), read once the boot is done: the
  # reference to terraform_data.boot orders it after the create (and leaves it unknown in plans).
  vm    = try(jsondecode(file("${terraform_data.boot.output}/vm.json")), null)
  login = try(file("${terraform_data.boot.output}/login"), null)
}

# The VM's record. Created first (no provisioner: always recorded in the state), destroyed last:
# its destroy stops whatever runs of the VM and removes its directory, also when the create
# below failed or was killed half-way (tofu runs no destroy provisioner of a resource whose
# create failed, and records nothing of a create that was killed).
resource "terraform_data" "vm" {
  input = local.environment

  provisioner "local-exec" {
    when        = destroy
    command     = "bash ${path.module}/vm.sh destroy"
    environment = self.input
  }

  lifecycle {
    precondition {
      condition     = length(local.name) <= 64
      error_message = "The VM name ${local.name} is longer than 64 characters: shorten name_prefix."
    }
    precondition {
      condition     = (var.network == "bridge") == (var.bridge != "")
      error_message = "network = \"bridge\" and bridge (the bridge's name) go together."
    }
  }
}

# The boot: keys, seed, overlay, QEMU, until the VM's systemd runs.
resource "terraform_data" "boot" {
  input = local.dir

  provisioner "local-exec" {
    command     = "bash ${path.module}/vm.sh create"
    environment = terraform_data.vm.input
  }
}
