# The pg backend test's module (.ci/pg runs tests/pg/pg_test.py): the state in PostgreSQL, the
# connection from PG_CONN_STR (and PG_SCHEMA_NAME, PGPASSWORD...) in the environment, as a pool's
# service environment would pass them. No provider is downloaded: terraform_data and local-exec
# only. vm.sh logs every create and destroy in $PG_TEST_VM_LOG (the test's view of the cloud).
terraform {
  backend "pg" {}
}

# Set by the binary for every tofu it runs.
variable "cycle_id" {
  type = string
}

variable "slot" {
  type = number
}

# The test's own: which "host" applies, a directory in which the create waits (it writes
# `inside` there, then waits for `release`), and one more resource for the lock test's change.
variable "host" {
  type    = string
  default = "a"
}

variable "gate" {
  type    = string
  default = ""
}

variable "extra" {
  type    = bool
  default = false
}

resource "terraform_data" "vm" {
  input = "host-${var.host}-slot-${var.slot}-${var.cycle_id}"

  provisioner "local-exec" {
    command = "sh ${path.module}/vm.sh create ${self.input} ${var.gate}"
  }

  provisioner "local-exec" {
    when    = destroy
    command = "sh ${path.module}/vm.sh destroy ${self.input}"
  }
}

resource "terraform_data" "extra" {
  count = var.extra ? 1 : 0
  input = "extra-${var.host}-slot-${var.slot}"
}
