//! `check`: each thing a cycle needs is tried and a broken one fails with what to do, while
//! nothing is changed (no POST, no DELETE, no cycle.json, no VM, the module untouched). Real
//! HTTP to the fake Forgejo, the real terraform/tofu CLI on the test module.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use crate::support::harness::{Env, walk};

/// The line of one check in the text output.
fn line<'a>(stdout: &'a str, check: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l[6.min(l.len())..].starts_with(&format!("{check}:")))
        .unwrap_or_else(|| panic!("no line for {check:?} in:\n{stdout}"))
}

fn check(env: &Env, extra: &[&str]) -> crate::support::harness::Outcome {
    let mut c = env.cmd("check");
    c.args(extra);
    env.exec(c)
}

#[test]
fn a_good_configuration_passes_and_nothing_changes() {
    let env = Env::new();
    let runner = env.fake.add_runner(
        "ephemeral-old-1",
        true,
        crate::support::fake_forgejo::Conn::NeverConnected,
    );
    env.fake.add_job(&["debian"]);
    let module_before = walk(&env.module);
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for name in [
        "configuration",
        "labels",
        "token file",
        "forgejo",
        "token scope",
        "tofu",
        "launch command",
        "state directory",
    ] {
        assert!(line(&out.stdout, name).starts_with("ok    "), "{out:?}");
    }
    assert!(line(&out.stdout, "forgejo").contains("15.0.3"), "{out:?}");
    assert!(
        line(&out.stdout, "token scope").contains("1 waiting or running job"),
        "{out:?}"
    );
    // Its GETs prove reading only (Forgejo checks a token's scope by method): it says so.
    assert!(
        line(&out.stdout, "token scope")
            .contains("registering needs write:admin, which check does not try"),
        "{out:?}"
    );
    assert!(
        line(&out.stdout, "labels").contains("debian (host)"),
        "{out:?}"
    );
    // The fake Forgejo is on loopback, which a VM cannot reach: the one warning.
    assert!(
        out.stdout.contains("all 8 checks passed, 1 warning\n"),
        "{out:?}"
    );
    let warnings: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("warn "))
        .collect();
    assert_eq!(warnings.len(), 1, "{out:?}");
    assert!(
        warnings[0].starts_with("warn  configuration: http://127.0.0.1:")
            && warnings[0].contains(
                "is a loopback address: the launch command hands it to the runner on the VM"
            ),
        "{out:?}"
    );
    // Only reads reached Forgejo, and the token never reached the output.
    let methods: Vec<String> = env
        .fake
        .requests()
        .iter()
        .map(|r| r.method.clone())
        .collect();
    assert!(methods.iter().all(|m| m == "GET"), "{methods:?}");
    assert!(
        env.fake.runner(runner).is_some(),
        "the offline registration is left alone"
    );
    assert!(!out.stdout.contains(crate::support::harness::API_TOKEN));
    assert!(!out.stderr.contains(crate::support::harness::API_TOKEN));
    // No VM, no state, and the module directory exactly as it was (init ran in a copy).
    assert!(env.vm_log().is_empty(), "{}", env.vm_log());
    assert!(!env.state.exists(), "check created the state directory");
    assert_eq!(walk(&env.module), module_before);
}

#[test]
fn json_output_lists_every_check() {
    let env = Env::new();
    let out = check(
        &env,
        &["--output", "json", "--tofu-bin", "/nonexistent/tofu"],
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    let doc = out.json();
    assert_eq!(doc["ok"], false);
    assert_eq!(doc["failed"], 1);
    let tofu = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "tofu")
        .unwrap();
    assert_eq!(tofu["ok"], false);
    assert!(tofu["detail"].as_str().unwrap().contains("--tofu-bin"));
}

#[test]
fn a_missing_tofu_binary_fails() {
    let env = Env::new();
    let out = check(&env, &["--tofu-bin", "/nonexistent/tofu"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "tofu");
    assert!(l.starts_with("FAIL  "), "{out:?}");
    assert!(
        l.contains("install OpenTofu or point --tofu-bin at it"),
        "{l}"
    );
    assert!(out.stdout.contains("1 of 8 checks failed"), "{out:?}");
    // The other checks still ran.
    assert!(
        line(&out.stdout, "token scope").starts_with("ok"),
        "{out:?}"
    );
}

// Mutation caught: check shows tofu's last lines only (describe()).
#[test]
fn a_broken_module_fails_without_touching_it() {
    let env = Env::new();
    let main = env.module.join("main.tf");
    let text = fs::read_to_string(&main).unwrap();
    fs::write(
        &main,
        text.replace(
            "resource \"terraform_data\" \"vm\" {",
            "resource \"terraform_data\" \"vm\" {\n  no_such_argument = 1\n  other_bad = 2\n  third_bad = 3",
        ),
    )
    .unwrap();
    let before = walk(&env.module);
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "tofu");
    assert!(l.starts_with("FAIL  "), "{out:?}");
    assert!(
        l.contains("is not valid") || l.contains("does not initialize"),
        "{l}"
    );
    // What tofu says first (its `Error:` heading and what follows), not only its last lines.
    assert!(
        l.contains("Error: Unsupported argument |   on main.tf line")
            && l.contains("\"no_such_argument\""),
        "{l}"
    );
    assert_eq!(walk(&env.module), before);
}

#[test]
fn a_launch_command_that_is_not_executable_fails() {
    let env = Env::new();
    let launch = env.tmp.path().join("launch");
    fs::write(&launch, "#!/bin/sh\n").unwrap();
    fs::set_permissions(&launch, fs::Permissions::from_mode(0o644)).unwrap();
    let out = check(&env, &["--launch-command", launch.to_str().unwrap()]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "launch command");
    assert!(l.starts_with("FAIL  ") && l.contains("chmod +x"), "{l}");
}

#[test]
fn forgejo_older_than_15_fails() {
    let env = Env::new();
    env.fake.set_forgejo_version("14.0.2+gitea-1.22.0");
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "forgejo");
    assert!(
        l.starts_with("FAIL  ") && l.contains("needs Forgejo 15 or later"),
        "{l}"
    );
}

#[test]
fn a_token_forgejo_refuses_fails_with_a_hint() {
    let env = Env::new();
    fs::write(&env.token_file, "not-the-token\n").unwrap();
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "token scope");
    assert!(l.starts_with("FAIL  ") && l.contains("HTTP 401"), "{l}");
    assert!(l.contains("is the token in --token-file valid?"), "{l}");
}

#[test]
fn a_group_readable_token_file_fails() {
    let env = Env::new();
    fs::set_permissions(&env.token_file, fs::Permissions::from_mode(0o640)).unwrap();
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "token file");
    assert!(l.starts_with("FAIL  ") && l.contains("chmod 600"), "{l}");
    assert!(
        line(&out.stdout, "forgejo").contains("no usable token"),
        "{out:?}"
    );
}

#[test]
fn a_state_dir_that_is_a_file_fails() {
    let env = Env::new();
    fs::write(&env.state, "").unwrap();
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "state directory");
    assert!(
        l.starts_with("FAIL  ") && l.contains("is not a directory"),
        "{l}"
    );
}

#[test]
fn an_existing_state_dir_is_written_and_locked_but_keeps_no_trace() {
    let env = Env::new();
    fs::create_dir(&env.state).unwrap();
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(env.state.join("cycle.lock"), "").unwrap();
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        line(&out.stdout, "state directory").contains("writable and lockable"),
        "{out:?}"
    );
    let left: Vec<_> = fs::read_dir(&env.state)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("cycle.lock")]);
}

/// A configuration error (what `run` refuses before it does anything) is the only line, and
/// exit 2 as for `run`: nothing else is tried with a wrong flag.
fn stops_at_the_configuration(env: &Env, extra: &[&str], says: &str) {
    let out = check(env, extra);
    assert_eq!(out.code, Some(2), "{extra:?}: {out:?}");
    let l = line(&out.stdout, "configuration");
    assert!(
        l.starts_with("FAIL  ") && l.contains(says),
        "{extra:?}: {l}"
    );
    assert_eq!(
        out.stdout
            .lines()
            .filter(|l| l.starts_with("FAIL "))
            .count(),
        1,
        "{extra:?}: {out:?}"
    );
    assert!(
        !out.stdout.contains("forgejo:") && !out.stdout.contains("token file:"),
        "{extra:?}: {out:?}"
    );
    assert!(
        out.stdout.contains("stopped at the configuration"),
        "{out:?}"
    );
    assert!(
        env.fake.requests().is_empty(),
        "{extra:?}: Forgejo was asked"
    );
}

// Mutation caught: check goes on (exit 1) past a configuration error.
#[test]
fn a_configuration_error_stops_check_with_exit_2() {
    let env = Env::new();
    stops_at_the_configuration(&env, &["--labels", ""], "--labels is required");
    stops_at_the_configuration(
        &env,
        &["--http-timeout", "0s"],
        "--http-timeout must be longer than 0",
    );
    stops_at_the_configuration(
        &env,
        &["--runner-prefix", ""],
        "--runner-prefix must not be empty",
    );
    stops_at_the_configuration(&env, &["--scope", "team/x"], "--scope: ");
    let out = check(&env, &["--http-timeout", "0s", "--output", "json"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    let doc = out.json();
    assert_eq!(doc["stopped_at"], "configuration", "{doc}");
    assert_eq!(doc["checks"].as_array().unwrap().len(), 1, "{doc}");
}

#[test]
fn labels_forgejo_runner_would_refuse_or_misread_stop_check_and_run() {
    let env = Env::new();
    for (labels, says) in [
        (
            " debian:host , docker ,,",
            "--labels entry 1 (\" debian:host \"): its name starts or ends with a blank",
        ),
        (
            "debian:host,,gpu:host",
            "--labels entry 2 (\"\"): it is empty",
        ),
        ("debian:host,", "--labels entry 2 (\"\"): it is empty"),
        (
            "debian: host",
            "its scheme \" host\" starts or ends with a blank",
        ),
        ("x:host:foo", "the host scheme takes no argument"),
        (
            "x:k8spod",
            "the k8spod scheme runs jobs in a Kubernetes pod",
        ),
        ("x:hots", "\"hots\" is not a scheme this tool serves"),
        ("x:myplugin://cfg", "run by a plugin of its config file"),
    ] {
        stops_at_the_configuration(&env, &["--labels", labels], says);
        let mut c = env.cmd("run");
        c.args(["--labels", labels]);
        let out = env.exec(c);
        assert_eq!(out.code, Some(2), "run --labels {labels:?}: {out:?}");
        assert!(
            out.stderr.contains(says),
            "run --labels {labels:?}: {out:?}"
        );
    }
    assert!(env.fake.requests().is_empty());
    assert!(!env.state.exists(), "a refused run got past the lock");
}

// Mutation caught: no warning for a docker label with a scheme written.
#[test]
fn each_label_is_shown_with_its_scheme_and_docker_ones_are_warned_about() {
    let env = Env::new();
    env.fake.add_job(&["a b"]);
    let out = check(&env, &["--labels", "debian:host,a b,arm:docker://node:22"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let l = line(&out.stdout, "labels");
    assert!(
        l.starts_with("ok    labels: debian (host), a b (docker, no scheme given, image node:22-bookworm), arm (docker, image node:22)"),
        "{out:?}"
    );
    let warnings: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("warn  labels:"))
        .collect();
    assert_eq!(warnings.len(), 2, "{out:?}");
    assert!(
        warnings[0].starts_with("warn  labels: a b is a docker label (no scheme means docker): it needs a Docker engine on the VM"),
        "{out:?}"
    );
    assert!(
        warnings[1]
            .starts_with("warn  labels: arm is a docker label: it needs a Docker engine on the VM"),
        "{out:?}"
    );
    assert!(
        out.stdout.contains("all 8 checks passed, 3 warnings"),
        "{out:?}"
    );
    // The jobs list is asked for the names, the blank inside one included.
    assert!(
        line(&out.stdout, "token scope").contains("1 waiting or running job"),
        "{out:?}"
    );
    let doc = check(&env, &["--labels", "a b", "--output", "json"]).json();
    assert_eq!(doc["warnings"], 2, "{doc}");
}

// Mutation caught: no warning for a loopback --forgejo-url (it passes `check`, and can never
// work from a VM); or one without a launch command, which hands it to no VM.
#[test]
fn a_loopback_forgejo_url_is_warned_about_only_with_a_launch_command() {
    let env = Env::new();
    let doc = check(&env, &["--output", "json"]).json();
    let warned = |doc: &serde_json::Value| -> Vec<String> {
        doc["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "configuration")
            .unwrap()["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_str().unwrap().to_string())
            .collect()
    };
    let w = warned(&doc);
    assert_eq!(w.len(), 1, "{doc}");
    assert!(w[0].contains("where it names the VM itself"), "{doc}");
    // Without a launch command nothing hands the URL to a VM (that line fails instead).
    let full = env.cmd("check");
    let args: Vec<std::ffi::OsString> = full.get_args().map(|a| a.to_os_string()).collect();
    let at = args.iter().position(|a| a == "--launch-command").unwrap();
    let mut c = std::process::Command::new(full.get_program());
    c.args(args[..at].iter().chain(&args[at + 2..]));
    c.args(["--output", "json"]);
    c.env_clear();
    for (k, v) in full.get_envs() {
        if let Some(v) = v {
            c.env(k, v);
        }
    }
    let doc = env.exec(c).json();
    assert!(warned(&doc).is_empty(), "{doc}");
}

// Mutation caught (#32, point 4): a --tofu-dir without a .tf file passes (tofu validates an
// empty module, and a run would apply it and make no VM).
#[test]
fn a_module_directory_without_a_tf_file_fails_and_a_run_refuses_it() {
    let env = Env::new();
    let empty = env.tmp.path().join("empty-module");
    fs::create_dir(&empty).unwrap();
    fs::write(empty.join("README"), "no module here\n").unwrap();
    let out = check(&env, &["--tofu-dir", empty.to_str().unwrap()]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        line(&out.stdout, "tofu").starts_with(&format!(
            "FAIL  tofu: --tofu-dir {} holds no .tf file",
            empty.display()
        )),
        "{out:?}"
    );
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--tofu-dir", empty.to_str().unwrap()]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("holds no .tf file"), "{out:?}");
    assert!(env.vm_log().is_empty(), "{}", env.vm_log());
}

#[test]
fn check_has_no_dry_run_flags() {
    let env = Env::new();
    for flag in [&["--dry-run"][..], &["--fixture", "fixtures/idle.json"]] {
        let out = check(&env, flag);
        assert_eq!(out.code, Some(2), "{out:?}");
        assert!(out.stderr.contains("unexpected argument"), "{out:?}");
    }
    let help = std::process::Command::new(crate::support::harness::BIN)
        .args(["check", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in ["--dry-run", "--fixture"] {
        assert!(
            !help.lines().any(|l| l.trim_start().starts_with(flag)),
            "check --help lists {flag}:\n{help}"
        );
    }
    // The role's environment files set run's variables: check takes them (and ignores a dry-run
    // one, which only run and sweep read).
    let mut c = env.cmd("check");
    c.env("CI_EPHEMERAL_PROVISIONER_DRY_RUN", "true");
    c.env("CI_EPHEMERAL_PROVISIONER_MAX_JOBS_PER_VM", "0");
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stdout.contains("--max-jobs-per-vm must be at least 1"),
        "{out:?}"
    );
}

/// A scope Forgejo does not know fails the token scope check with what is missing: an
/// organization, a repository's owner, a repository (or its Actions unit). The control: the
/// same scopes once they exist pass.
#[test]
fn a_scope_that_does_not_exist_fails_with_its_name() {
    let env = Env::new();
    let scope_line = |scope: &str| {
        // (No tofu: only the token scope line matters here.)
        let out = check(&env, &["--scope", scope, "--tofu-bin", "/nonexistent/tofu"]);
        line(&out.stdout, "token scope").to_string()
    };
    for (scope, says) in [
        (
            "org/acme",
            "Forgejo says organization acme does not exist (404 GetOrgByName): --scope org/acme",
        ),
        (
            "repo/acme/app",
            "Forgejo says user or organization acme does not exist (404 GetUserByName)",
        ),
    ] {
        let l = scope_line(scope);
        assert!(l.starts_with("FAIL  ") && l.contains(says), "{scope}: {l}");
    }
    env.fake.add_org("acme");
    assert!(scope_line("org/acme").starts_with("ok    "));
    let l = scope_line("repo/acme/app");
    assert!(
        l.starts_with("FAIL  ")
            && l.contains("repository acme/app does not exist, is not visible to the token's user or has Actions disabled"),
        "{l}"
    );
    env.fake.add_repo("acme/app");
    assert!(scope_line("repo/acme/app").starts_with("ok    "));
    env.fake.set_repo_actions("acme/app", false);
    assert!(scope_line("repo/acme/app").contains("has Actions disabled"));
    // Renamed, its old name redirects (307, not followed): the error says so.
    env.fake.rename_owner("acme", "acme-corp", true);
    let l = scope_line("org/acme");
    assert!(
        l.starts_with("FAIL  ")
            && l.contains("HTTP 307 redirect to /api/v1/orgs/acme-corp/actions/runners")
            && l.contains("set --scope to its new name"),
        "{l}"
    );
}

/// `--version`: the crate's version and the commit of this checkout the binary was built from
/// (`-dirty` when tracked files differ from it), so an installed binary names its source.
#[test]
fn version_names_the_version_and_the_commit_of_this_checkout() {
    let out = std::process::Command::new(crate::support::harness::BIN)
        .arg("--version")
        .output()
        .expect("run the binary");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let git = |args: &[&str]| {
        // --no-optional-locks: a plain `git status` rewrites the index, which build.rs watches,
        // and every later cargo build (the release binary too) would compile the crate again.
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .arg("--no-optional-locks")
            .args(args)
            .output()
            .expect("run git");
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    let want = format!(
        "ci-ephemeral-provisioner {} (commit {head}{})\n",
        env!("CARGO_PKG_VERSION"),
        if dirty { "-dirty" } else { "" }
    );
    assert_eq!(text, want);
}

/// `--store pg`: `check` tries the pool store (here a database that is not there: it fails,
/// naming it but never the password) and refuses a module whose tofu state is not in
/// PostgreSQL; with the backend block, that line passes. The pool store's passing line:
/// `tests/it/secrets.rs` (it needs `.ci/pg`'s PostgreSQL).
// Mutation caught: check_tofu_backend that passes any module.
#[test]
fn check_tries_the_pool_store_and_wants_the_modules_state_in_postgresql() {
    let env = Env::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = |env: &Env| {
        let mut c = env.cmd("check");
        c.args(["--store", "pg", "--pool", "p", "--host-id", "a"]);
        c.env(
            "PG_CONN_STR",
            format!("postgres://ci:s3cret-pw-0123@127.0.0.1:{port}/ci?sslmode=disable"),
        );
        env.exec(c)
    };
    let out = run(&env);
    assert_eq!(out.code, Some(1), "{out:?}");
    let store = line(&out.stdout, "pool store");
    assert!(
        store.starts_with("FAIL") && store.contains("cannot connect to PostgreSQL ci@127.0.0.1"),
        "{store}"
    );
    assert!(!out.stdout.contains("s3cret") && !out.stderr.contains("s3cret"));
    let backend = line(&out.stdout, "tofu backend");
    assert!(
        backend.starts_with("FAIL") && backend.contains("must be in PostgreSQL too"),
        "{backend}"
    );
    fs::write(
        env.module.join("backend.tf"),
        "terraform {\n  backend \"pg\" {}\n}\n",
    )
    .unwrap();
    let out = run(&env);
    assert!(
        line(&out.stdout, "tofu backend").starts_with("ok"),
        "{}",
        out.stdout
    );
    // Without PG_CONN_STR: a usage error naming the variable.
    let mut c = env.cmd("check");
    c.args(["--store", "pg", "--pool", "p"]);
    let out = env.exec(c);
    assert!(
        out.stdout.contains("PG_CONN_STR") || out.stderr.contains("PG_CONN_STR"),
        "{out:?}"
    );
}
