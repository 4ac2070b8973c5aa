# Set by ci-ephemeral-provisioner for every cycle (TF_VAR_cycle_id): lower-case letters, digits
# and "-", e.g. 20261014t153000z-1a2b. It names and labels everything this module creates.
variable "cycle_id" {
  type        = string
  description = "The provisioner's cycle id (TF_VAR_cycle_id)."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.cycle_id))
    error_message = "cycle_id must be lower-case letters, digits and -: it becomes the server's host name."
  }
}

# Set by ci-ephemeral-provisioner (TF_VAR_slot): which slot of the pool the cycle runs in (1 to
# --slots). A label only; the cycle id already makes every name unique.
variable "slot" {
  type        = number
  default     = 1
  description = "The pool's slot of this cycle (TF_VAR_slot)."
}

# Required and secret: put it in the pool's secret_environment as TF_VAR_hcloud_token.
variable "hcloud_token" {
  type        = string
  sensitive   = true
  description = "Hetzner Cloud API token (read and write) of the project the runners live in."

  validation {
    condition     = length(var.hcloud_token) > 0
    error_message = "hcloud_token is empty: set TF_VAR_hcloud_token in the pool's secret_environment."
  }
}

# --- The VM ---------------------------------------------------------------------------------

variable "name_prefix" {
  type        = string
  default     = "ci-"
  description = "Prefix of the server, SSH key and firewall names (<prefix><cycle_id>); one per pool when pools share a project."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]*$", var.name_prefix))
    error_message = "name_prefix must be lower-case letters, digits and -."
  }
}

variable "server_type" {
  type        = string
  default     = "cx23"
  description = "Hetzner server type (cx23: 2 vCPU, 4 GB, x86; cax11: 2 vCPU, 4 GB, arm64)."
}

variable "image" {
  type        = string
  default     = "debian-12"
  description = "Image name or id; it must run cloud-init (Hetzner's own images do)."
}

variable "location" {
  type        = string
  default     = "fsn1"
  description = "Hetzner location (fsn1, nbg1, hel1, ash, hil, sin)."
}

variable "labels" {
  type        = map(string)
  default     = {}
  description = "Extra Hetzner labels for the server, SSH key and firewall."
}

variable "ssh_source_ips" {
  type        = list(string)
  default     = ["0.0.0.0/0", "::/0"]
  description = "Networks allowed to reach sshd, the only open port; narrow it to the provisioner host's address."

  validation {
    condition     = length(var.ssh_source_ips) > 0
    error_message = "ssh_source_ips must name at least one network (the provisioner host's)."
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
  description = "Give ssh_user passwordless sudo (jobs can then install packages, and also read the VM's host key)."
}

variable "extra_packages" {
  type        = list(string)
  default     = []
  description = "Debian packages to install besides ca-certificates, curl, git and nodejs."

  validation {
    condition     = alltrue([for p in var.extra_packages : can(regex("^[a-z0-9][a-z0-9+.-]+$", p))])
    error_message = "extra_packages must be Debian package names."
  }
}

# --- forgejo-runner -------------------------------------------------------------------------

variable "forgejo_runner_version" {
  type        = string
  default     = "12.8.2"
  description = "forgejo-runner release to install (12.8 or newer: one-job --handle)."

  validation {
    condition = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.forgejo_runner_version)) && try(
      tonumber(split(".", var.forgejo_runner_version)[0]) > 12 ||
      (tonumber(split(".", var.forgejo_runner_version)[0]) == 12 && tonumber(split(".", var.forgejo_runner_version)[1]) >= 8),
    false)
    error_message = "forgejo_runner_version must be a release number such as 12.8.2, 12.8 or newer."
  }
}

variable "forgejo_runner_arch" {
  type        = string
  default     = ""
  description = "amd64 or arm64; empty: arm64 for cax* server types, else amd64."

  validation {
    condition     = contains(["", "amd64", "arm64"], var.forgejo_runner_arch)
    error_message = "forgejo_runner_arch must be amd64, arm64 or empty (from the server type)."
  }
}

variable "forgejo_runner_url" {
  type        = string
  default     = ""
  description = "Where the VM downloads the binary; empty: the Forgejo release download for the version and architecture."

  validation {
    condition     = var.forgejo_runner_url == "" || can(regex("^https://[^[:space:]'\"\\\\]+$", var.forgejo_runner_url))
    error_message = "forgejo_runner_url must be an https:// URL without quotes, backslashes or blanks (or empty)."
  }
}

# Required, no default: the SHA-256 of exactly the file the VM downloads (README.md says how to
# get it: verify the release's signature, then sha256sum).
variable "forgejo_runner_sha256" {
  type        = string
  description = "SHA-256 (64 lower-case hex digits) of the forgejo-runner binary for this version and architecture."

  validation {
    condition     = can(regex("^[0-9a-f]{64}$", var.forgejo_runner_sha256))
    error_message = "forgejo_runner_sha256 must be 64 lower-case hex digits (sha256sum of the release binary)."
  }
}
