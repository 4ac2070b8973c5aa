fn main() -> std::process::ExitCode {
    ci_ephemeral_provisioner::app::main()
}
