# The role end-to-end test's "cloud": terraform_data + local-exec only (no provider download).
# The "VM" is the test container itself, reached over SSH on 127.0.0.1:2222; vm.sh keeps a log
# and a marker per VM in $VM_DIR and fails a destroy while $VM_DIR/fail-destroy exists. probe.sh
# (run here on create, and by ../probe-bin/ssh under the launch command) plays a hostile child.
variable "cycle_id" {
  type = string
}

variable "ssh_key_path" {
  type = string
}

resource "terraform_data" "vm" {
  input = var.cycle_id

  provisioner "local-exec" {
    command = "sh ${path.module}/vm.sh create ${self.input}"
  }

  # A hostile step of the module, as the pool's user under the unit's sandbox: it tries every
  # path to the Forgejo token (probe.sh) and reports what it read; the test looks for the token.
  provisioner "local-exec" {
    command = "sh ${path.module}/probe.sh tofu \"$VM_DIR/probe/tofu.${self.input}\" \"$HOME\" /etc/ci-ephemeral-provisioner/forgejo-token || true"
  }

  provisioner "local-exec" {
    when    = destroy
    command = "sh ${path.module}/vm.sh destroy ${self.input}"
  }
}

output "address" {
  # A name, not an address: resolving it (glibc, nss files) must work under the sandbox.
  value = "localhost"
}

output "ssh_private_key" {
  value     = file(var.ssh_key_path)
  sensitive = true
}

# A known_hosts line for the pool's launch.known_hosts_output (as the example's module makes one
# per VM); "" for the pools that give launch.known_hosts instead.
variable "known_hosts" {
  type    = string
  default = ""
}

output "known_hosts" {
  value = var.known_hosts
}
