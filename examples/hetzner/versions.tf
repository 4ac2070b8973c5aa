terraform {
  # OpenTofu 1.6+ or terraform 1.5+. No backend block: the state stays local, in the pool's own
  # state directory on the provisioner host (see README.md, "Security").
  required_version = ">= 1.5"

  required_providers {
    hcloud = {
      source  = "hetznercloud/hcloud"
      version = ">= 1.45, < 2.0"
    }
    tls = {
      source  = "hashicorp/tls"
      version = ">= 4.0, < 5.0"
    }
  }
}

provider "hcloud" {
  # From the pool's secret_environment: TF_VAR_hcloud_token.
  token = var.hcloud_token
}
