# The names the role's default launch command reads (pool settings launch.address_output,
# launch.ssh_private_key_output, launch.known_hosts_output). The provisioner hands every output to
# the launch command as TOFU_OUTPUT_<NAME>; it keeps the non-sensitive ones in cycle.json (shown
# by `status`) and never the sensitive ones.

# launch.address_output (role default: address).
output "address" {
  description = "The VM's public IPv4 address, where the launch command connects to sshd."
  value       = hcloud_server.vm.ipv4_address
}

# launch.ssh_private_key_output (role default: ssh_private_key).
output "ssh_private_key" {
  description = "OpenSSH private key the launch command logs in with as ssh_user."
  value       = tls_private_key.login.private_key_openssh
  sensitive   = true
}

# launch.known_hosts_output (role default: "", so name it in the pool: known_hosts_output: known_hosts).
output "known_hosts" {
  description = "known_hosts line for this VM's own host key: <address> ssh-ed25519 AAAA..."
  value       = "${hcloud_server.vm.ipv4_address} ${trimspace(tls_private_key.host.public_key_openssh)}"
}

# Not read by the launch command: for `ci-ephemeral-provisioner status` and the Hetzner console.
output "server_name" {
  description = "The server's name in Hetzner Cloud (<name_prefix><cycle_id>)."
  value       = hcloud_server.vm.name
}
