terraform {
  # OpenTofu 1.6+ or terraform 1.5+ (terraform_data). No provider at all: nothing is downloaded,
  # and `tofu init` works without a network. No backend block: the state stays local, in the
  # pool's own state directory on the provisioner host (see README.md, "Security").
  required_version = ">= 1.5"
}
