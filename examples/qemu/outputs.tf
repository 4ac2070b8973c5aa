# The names the role's default launch command reads (pool settings launch.address_output,
# launch.ssh_port_output, launch.ssh_private_key_output, launch.known_hosts_output). The
# provisioner hands every output to the launch command as TOFU_OUTPUT_<NAME>; it keeps the
# non-sensitive ones in cycle.json (shown by `status`) and never the sensitive ones.

output "address" {
  description = "Where the launch command connects: SSH is forwarded from this host's loopback."
  value       = "127.0.0.1"
}

output "ssh_port" {
  description = "The port on 127.0.0.1 forwarded to this VM's sshd (launch.ssh_port_output: ssh_port)."
  value       = try(local.vm.ssh_port, null)
}

output "ssh_user" {
  description = "The user the launch command logs in as (equal to the pool's launch.ssh_user)."
  value       = var.ssh_user
}

output "ssh_private_key" {
  description = "OpenSSH private key the launch command logs in with as ssh_user."
  value       = local.login
  sensitive   = true
}

output "known_hosts" {
  description = "known_hosts line for this VM's own host key: [127.0.0.1]:<port> ssh-ed25519 AAAA..."
  value       = try(local.vm.known_hosts, null)
}

# Not read by the launch command: for `ci-ephemeral-provisioner status`.
output "vm" {
  description = "The VM's name, the accelerator it runs with (kvm or tcg), how QEMU is supervised and the VM's network."
  value       = try("${local.name} (${local.vm.accel}, ${local.vm.supervisor}, ${local.vm.network})", null)
}
