# One ephemeral runner VM on Hetzner Cloud per provisioner cycle, for the Ansible role's default
# launch command: it logs in over SSH with the key of the output ssh_private_key, checks the VM's
# host key against the output known_hosts, and starts forgejo-runner, which cloud-init installed.
# README.md beside this file: the pool entry, the outputs, security notes.

locals {
  name = "${var.name_prefix}${var.cycle_id}"

  runner_arch = var.forgejo_runner_arch != "" ? var.forgejo_runner_arch : (startswith(var.server_type, "cax") ? "arm64" : "amd64")
  runner_url = var.forgejo_runner_url != "" ? var.forgejo_runner_url : format(
    "https://code.forgejo.org/forgejo/runner/releases/download/v%s/forgejo-runner-%s-linux-%s",
    var.forgejo_runner_version, var.forgejo_runner_version, local.runner_arch,
  )

  # What the runner and `host` label jobs need: git (checkout), nodejs (JavaScript actions such
  # as actions/checkout), curl and ca-certificates (the runner download, most jobs).
  packages = distinct(concat(
    ["ca-certificates", "curl", "git", "nodejs"],
    var.runner_sudo ? ["sudo"] : [],
    var.extra_packages,
  ))

  labels = merge(var.labels, {
    "managed-by" = "ci-ephemeral-provisioner"
    "cycle"      = var.cycle_id
    "slot"       = tostring(var.slot)
  })
}

# The launch command's login key, new for every VM. The private half reaches the launch command
# through the sensitive output ssh_private_key; it never leaves the provisioner host.
resource "tls_private_key" "login" {
  algorithm = "ED25519"
}

# The VM's SSH host key, new for every VM and put in place by cloud-init before sshd starts, so
# the launch can check it (output known_hosts) instead of trusting whatever key answers.
resource "tls_private_key" "host" {
  algorithm = "ED25519"
}

# Hetzner sets a root password (and mails it) for a server created without an SSH key; with one,
# it does not. cloud-init's disable_root then refuses root logins with it anyway.
resource "hcloud_ssh_key" "login" {
  name       = local.name
  public_key = trimspace(tls_private_key.login.public_key_openssh)
  labels     = local.labels
}

# Inbound: ssh only, from ssh_source_ips. Outbound stays open (packages, the runner download,
# Forgejo, what jobs fetch).
resource "hcloud_firewall" "vm" {
  name   = local.name
  labels = local.labels

  rule {
    description = "ssh from the provisioner host"
    direction   = "in"
    protocol    = "tcp"
    port        = "22"
    source_ips  = var.ssh_source_ips
  }
}

resource "hcloud_server" "vm" {
  name         = local.name
  server_type  = var.server_type
  image        = var.image
  location     = var.location
  labels       = local.labels
  ssh_keys     = [hcloud_ssh_key.login.id]
  firewall_ids = [hcloud_firewall.vm.id]

  public_net {
    ipv4_enabled = true
    ipv6_enabled = true
  }

  # Sensitive (it holds the host private key), so plans show it as (sensitive value).
  user_data = templatefile("${path.module}/cloud-init.yml.tftpl", {
    ssh_user         = var.ssh_user
    runner_dir       = var.runner_dir
    runner_sudo      = var.runner_sudo
    packages         = local.packages
    login_public_key = trimspace(tls_private_key.login.public_key_openssh)
    host_private_key = tls_private_key.host.private_key_openssh
    host_public_key  = trimspace(tls_private_key.host.public_key_openssh)
    runner_version   = var.forgejo_runner_version
    runner_url       = local.runner_url
    runner_sha256    = var.forgejo_runner_sha256
  })

  lifecycle {
    precondition {
      condition     = length(local.name) <= 63
      error_message = "The server name ${local.name} is longer than 63 characters: shorten name_prefix."
    }
  }
}
