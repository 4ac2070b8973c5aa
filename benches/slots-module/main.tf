# The VM of the parallel-slots and idle-pool benchmarks (benches/run, parts 6 and 7):
# terraform_data + local-exec only, so no provider is downloaded. vm.sh makes "starting a VM" take
# BENCH_VM_START seconds and keeps a marker file per VM and a log in BENCH_VM_DIR (the
# benchmark's view of the cloud).
variable "cycle_id" {
  type = string
}

# The pool's slot (TF_VAR_slot, set by the provisioner).
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
