//! `check`: each thing a cycle needs is tried and a broken one fails with what to do, while
//! nothing is changed (no POST, no DELETE, no cycle.json, no VM, the module untouched). Real
//! HTTP to the fake Forgejo, the real terraform/tofu CLI on the test module.

mod support;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use support::harness::{Env, walk};

/// The line of one check in the text output.
fn line<'a>(stdout: &'a str, check: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l[6.min(l.len())..].starts_with(&format!("{check}:")))
        .unwrap_or_else(|| panic!("no line for {check:?} in:\n{stdout}"))
}

fn check(env: &Env, extra: &[&str]) -> support::harness::Outcome {
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
        support::fake_forgejo::Conn::NeverConnected,
    );
    env.fake.add_job(&["debian"]);
    let module_before = walk(&env.module);
    let out = check(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for name in [
        "configuration",
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
    assert!(out.stdout.contains("all 7 checks passed"), "{out:?}");
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
    assert!(!out.stdout.contains(support::harness::API_TOKEN));
    assert!(!out.stderr.contains(support::harness::API_TOKEN));
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
    assert!(out.stdout.contains("1 of 7 checks failed"), "{out:?}");
    // The other checks still ran.
    assert!(
        line(&out.stdout, "token scope").starts_with("ok"),
        "{out:?}"
    );
}

#[test]
fn a_broken_module_fails_without_touching_it() {
    let env = Env::new();
    let main = env.module.join("main.tf");
    let text = fs::read_to_string(&main).unwrap();
    fs::write(
        &main,
        text.replace(
            "resource \"terraform_data\" \"vm\" {",
            "resource \"terraform_data\" \"vm\" {\n  no_such_argument = 1",
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

#[test]
fn missing_labels_fail_the_configuration_line() {
    let env = Env::new();
    let out = check(&env, &["--labels", ""]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = line(&out.stdout, "configuration");
    assert!(
        l.starts_with("FAIL  ") && l.contains("--labels is required"),
        "{l}"
    );
}

#[test]
fn dry_run_is_a_usage_error() {
    let env = Env::new();
    let out = check(&env, &["--dry-run"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("check never changes anything"),
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
