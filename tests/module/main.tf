# A stand-in "VM" for the integration tests: terraform_data + local-exec only, so no provider is
# downloaded. vm.sh keeps a log and a marker file per VM in $VM_DIR (the tests' view of the cloud).
variable "cycle_id" {
  type = string
}

# The pool's slot (TF_VAR_slot): which slot's VM this is, in the VM log.
variable "slot" {
  type    = number
  default = 1
}

resource "terraform_data" "vm" {
  input = var.cycle_id

  provisioner "local-exec" {
    command = "sh ${path.module}/vm.sh create ${self.input} ${var.slot}"
  }

  provisioner "local-exec" {
    when    = destroy
    command = "sh ${path.module}/vm.sh destroy ${self.input}"
  }
}

output "address" {
  value = "127.0.0.1"
}

# Which VM a runner is started on (TOFU_OUTPUT_VM): the destroy of one VM stops only its runners.
output "vm" {
  value = var.cycle_id
}

output "ssh_private_key" {
  value     = "MODULE-SENSITIVE-VALUE"
  sensitive = true
}
