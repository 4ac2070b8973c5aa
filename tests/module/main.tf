# A stand-in "VM" for the integration tests: terraform_data + local-exec only, so no provider is
# downloaded. vm.sh keeps a log and a marker file per VM in $VM_DIR (the tests' view of the cloud).
variable "cycle_id" {
  type = string
}

resource "terraform_data" "vm" {
  input = var.cycle_id

  provisioner "local-exec" {
    command = "sh ${path.module}/vm.sh create ${self.input}"
  }

  provisioner "local-exec" {
    when    = destroy
    command = "sh ${path.module}/vm.sh destroy ${self.input}"
  }
}

output "address" {
  value = "127.0.0.1"
}

output "ssh_private_key" {
  value     = "MODULE-SENSITIVE-VALUE"
  sensitive = true
}
