//! `status --remote`: what the pool owns outside this host, read-only. Its registrations in the
//! fake Forgejo (GET requests only), each with the cycle that holds it and what a sweep would do
//! with it, and the resources in the stand-in module's state, read by the real terraform/tofu CLI
//! without changing the module directory, its state or any "VM".

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use ci_ephemeral_provisioner::core::state::{CycleState, Registration};
use ci_ephemeral_provisioner::core::time::Timestamp;

use crate::support::fake_forgejo::Conn;
use crate::support::harness::{Env, Outcome, walk};

/// `status --remote` with the Forgejo flags of the harness (and `extra`).
fn remote(env: &Env, extra: &[&str]) -> Outcome {
    let mut c = env.cmd("status");
    c.args([
        "--remote",
        "--forgejo-url",
        &env.fake.url(),
        "--token-file",
        env.token_file.to_str().unwrap(),
        "--http-timeout",
        "2s",
    ]);
    c.args(extra);
    env.exec(c)
}

/// A name the product would give a registration made `ago` seconds before now.
fn name_made(cycle: &str, seq: u32, ago_secs: i64) -> String {
    let now = Timestamp(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64,
    );
    let at = Timestamp(now.0 - ago_secs * 1000);
    ci_ephemeral_provisioner::core::sweep::spare::registration_name("ephemeral-", cycle, seq, at)
}

/// Applies the stand-in module by hand: a "VM" in its state that no cycle knows (a leak).
fn leak_a_vm(env: &Env) {
    for args in [
        vec!["init", "-input=false", "-no-color"],
        vec![
            "apply",
            "-input=false",
            "-auto-approve",
            "-no-color",
            "-var",
            "cycle_id=leaked-1",
        ],
    ] {
        let out = Command::new(&env.tofu)
            .arg(format!("-chdir={}", env.module.display()))
            .args(&args)
            .env("VM_DIR", &env.vm)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
    }
    assert_eq!(env.live_vms(), ["vm-leaked-1"]);
}

/// tofu behind a wrapper that appends each command line to a log: (the wrapper, the log).
fn logged_tofu(env: &Env) -> (PathBuf, PathBuf) {
    let log = env.tmp.path().join("tofu-commands.log");
    let wrapper = env.tmp.path().join("logged-tofu");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\nexec '{}' \"$@\"\n",
            log.display(),
            env.tofu
        ),
    )
    .unwrap();
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).unwrap();
    (wrapper, log)
}

// Mutation caught: a verdict that is not the sweep's (the young or the held registration shown
// as deleted, the idle one as deletable), a request that is not a GET, or `tofu show` replaced by
// (or run after) a command that may change the state or the module directory (`init`).
#[test]
fn status_remote_shows_each_registration_and_vm_and_changes_nothing() {
    let env = Env::new();
    let old = name_made("20261014t100000z-aa01", 1, 7200);
    let young = name_made("20261014t100000z-aa02", 1, 10);
    let idle = name_made("20261014t100000z-aa03", 1, 7200);
    let held = name_made("20261014t100000z-aa04", 1, 7200);
    let old_id = env.fake.add_runner(&old, true, Conn::NeverConnected);
    let young_id = env.fake.add_runner(&young, true, Conn::NeverConnected);
    let idle_id = env.fake.add_runner(&idle, true, Conn::Idle);
    let held_id = env.fake.add_runner(&held, true, Conn::NeverConnected);
    env.fake
        .add_runner("someone-elses-1", true, Conn::NeverConnected);
    // Slot 2 of the pool holds one of them in its cycle.
    let slot2 = env.state.join("slot-2");
    fs::create_dir_all(&slot2).unwrap();
    let mut cycle = CycleState::new("20261014t100000z-aa04-s2".into(), Timestamp(0));
    let mut reg = Registration::intent(held.clone(), 9, "h".into(), Timestamp(0));
    reg.id = Some(held_id);
    cycle.registrations.push(reg);
    fs::write(
        slot2.join("cycle.json"),
        serde_json::to_vec(&cycle).unwrap(),
    )
    .unwrap();
    leak_a_vm(&env);
    let module_before: Vec<(std::path::PathBuf, Vec<u8>)> = walk(&env.module)
        .into_iter()
        .map(|p| (p.clone(), fs::read(&p).unwrap()))
        .collect();
    let vm_log_before = env.vm_log();
    // tofu behind a wrapper that logs each command line: `show` alone may run (an `init` or a
    // `refresh` would write the state or the module directory, as whoever runs `status`).
    let (logged_tofu, tofu_log) = logged_tofu(&env);

    let tofu_flags = [
        "--tofu-bin",
        logged_tofu.to_str().unwrap(),
        "--tofu-dir",
        env.module.to_str().unwrap(),
        "--slots",
        "2",
    ];
    let mut json_flags = tofu_flags.to_vec();
    json_flags.extend(["--output", "json"]);
    let out = remote(&env, &json_flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    let doc = out.json();
    let f = &doc["remote"]["forgejo"];
    assert_eq!(f["listed"], 5, "{doc}");
    let regs = f["registrations"].as_array().unwrap();
    let verdict = |id: i64| {
        regs.iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("{id} not shown: {doc}"))["sweep"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(regs.len(), 4, "only the pool's registrations: {doc}");
    assert_eq!(verdict(old_id), "delete");
    assert_eq!(verdict(young_id), "spared_young");
    assert_eq!(verdict(idle_id), "not_offline");
    assert_eq!(verdict(held_id), "spared_held");
    let held_row = regs.iter().find(|r| r["id"] == held_id).unwrap();
    assert_eq!(held_row["cycle"]["slot"], 2, "{doc}");
    assert_eq!(held_row["cycle"]["cycle_id"], "20261014t100000z-aa04-s2");
    let old_row = regs.iter().find(|r| r["id"] == old_id).unwrap();
    assert!(old_row["cycle"].is_null(), "{doc}");
    assert!(
        (7200..7300).contains(&old_row["age_seconds"].as_u64().unwrap()),
        "{doc}"
    );
    assert!(f["sweep_refused"].is_null(), "slot 1 has no cycle: {doc}");
    let res = doc["remote"]["tofu"]["resources"].as_array().unwrap();
    assert_eq!(res.len(), 1, "{doc}");
    assert_eq!(res[0]["address"], "terraform_data.vm");
    assert!(
        res[0]["id"].as_str().is_some_and(|id| !id.is_empty()),
        "{doc}"
    );

    // The text form says the same, one line each.
    let out = remote(&env, &tofu_flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    for want in [
        format!(
            "forgejo: 4 registration(s) with prefix ephemeral- of 5 listed in scope admin at {}",
            env.fake.url()
        ),
        format!("  {old_id} {old} offline, 2h old; no cycle holds it; a sweep deletes it"),
        format!(
            "  {idle_id} {idle} idle, 2h old; no cycle holds it; a sweep keeps it: not offline"
        ),
        format!(
            "  {held_id} {held} offline, 2h old; held by cycle 20261014t100000z-aa04-s2 (slot 2); a sweep spares it: another slot holds it"
        ),
        format!("tofu state of {}: 1 resource(s)", env.module.display()),
    ] {
        assert!(out.stdout.contains(&want), "{want}\n{out:?}");
    }
    assert!(out.stdout.contains("  terraform_data.vm id="), "{out:?}");

    // Read-only: GET requests only, nothing deleted, the module and its state as they were,
    // no "VM" made or destroyed.
    let methods: Vec<String> = env
        .fake
        .requests()
        .iter()
        .map(|r| r.method.clone())
        .collect();
    assert!(
        methods.len() >= 2 && methods.iter().all(|m| m == "GET"),
        "{methods:?}"
    );
    assert_eq!(env.fake.runners().len(), 5);
    let module_after: Vec<(std::path::PathBuf, Vec<u8>)> = walk(&env.module)
        .into_iter()
        .map(|p| (p.clone(), fs::read(&p).unwrap()))
        .collect();
    assert!(
        module_before == module_after,
        "the module directory changed"
    );
    assert_eq!(env.vm_log(), vm_log_before);
    let commands = fs::read_to_string(&tofu_log).unwrap();
    assert!(
        commands.lines().count() == 2
            && commands
                .lines()
                .all(|l| l == format!("-chdir={} show -json -no-color", env.module.display())),
        "tofu ran more than `show`:\n{commands}"
    );
    assert_eq!(env.live_vms(), ["vm-leaked-1"]);
    assert!(!env.state.join("cycle.json").exists());
}

// Mutation caught: `status --remote` of a slot whose workspace does not exist yet running `tofu
// show`, which creates it (terraform.tfstate.d/slot-K in the module directory, owned by whoever
// runs `status`: a root-owned one fails every later apply of that slot).
#[test]
fn status_remote_of_a_slot_without_a_workspace_creates_none() {
    let env = Env::new();
    fs::create_dir_all(env.state.join("slot-2")).unwrap();
    let tofu = |args: &[&str], workspace: &str| {
        let out = Command::new(&env.tofu)
            .arg(format!("-chdir={}", env.module.display()))
            .args(args)
            .env("TF_WORKSPACE", workspace)
            .env("TF_DATA_DIR", env.state.join("slot-2/tofu-data"))
            .env("VM_DIR", &env.vm)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    tofu(&["init", "-input=false", "-no-color"], "default");
    let flags = [
        "--tofu-bin",
        env.tofu.as_str(),
        "--tofu-dir",
        env.module.to_str().unwrap(),
        "--slots",
        "2",
        "--slot",
        "2",
        "--output",
        "json",
    ];
    let out = remote(&env, &flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    let doc = out.json();
    assert_eq!(
        doc["remote"]["tofu"]["resources"],
        serde_json::json!([]),
        "{doc}"
    );
    assert!(
        !env.module.join("terraform.tfstate.d").exists(),
        "status --remote created a workspace in the module directory"
    );
    // Once the slot has one, its resources are shown.
    tofu(
        &[
            "apply",
            "-input=false",
            "-auto-approve",
            "-no-color",
            "-var",
            "cycle_id=leaked-2",
        ],
        "slot-2",
    );
    let out = remote(&env, &flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    let res = out.json()["remote"]["tofu"]["resources"].clone();
    assert_eq!(res.as_array().map(Vec::len), Some(1), "{res}");
}

// Mutation caught: `status --remote` reporting a sweep as possible while this slot's cycle is in
// progress (the sweep's licence is not consulted).
#[test]
fn status_remote_says_a_sweep_is_refused_while_this_slots_cycle_is_in_progress() {
    let env = Env::new();
    fs::create_dir_all(&env.state).unwrap();
    let cycle = CycleState::new("20261014t100000z-bb01".into(), Timestamp(0));
    fs::write(
        env.state.join("cycle.json"),
        serde_json::to_vec(&cycle).unwrap(),
    )
    .unwrap();
    let out = remote(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout
            .contains("  a sweep now is refused: cycle 20261014t100000z-bb01 is in progress"),
        "{out:?}"
    );
    assert!(
        out.stdout.contains("tofu state: not read: no --tofu-dir"),
        "{out:?}"
    );
}

// Mutation caught: a missing tofu, or a Forgejo that cannot be read, shown as an empty pool
// (exit 0) instead of a failure that says what to fix.
#[test]
fn status_remote_fails_and_says_why_when_tofu_or_forgejo_cannot_be_read() {
    let env = Env::new();
    fs::create_dir_all(&env.state).unwrap();
    let out = remote(
        &env,
        &[
            "--tofu-bin",
            "no-such-tofu",
            "--tofu-dir",
            env.module.to_str().unwrap(),
        ],
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout
            .contains("tofu state: FAILED: --tofu-bin no-such-tofu is not an executable (nor found on PATH); install OpenTofu"),
        "{out:?}"
    );
    let mut c = env.cmd("status");
    c.args(["--remote", "--forgejo-url", "http://127.0.0.1:9"]);
    c.args(["--token-file", env.token_file.to_str().unwrap()]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout
            .contains("forgejo: FAILED: listing runners failed on page 1:"),
        "{out:?}"
    );
    // Without --forgejo-url: a usage error, before anything is asked.
    let mut c = env.cmd("status");
    c.arg("--remote");
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("status --remote needs --forgejo-url"),
        "{out:?}"
    );
}

// Mutation caught: `status --remote` running tofu (as root) on a module directory another user
// owns, where it would leave root-owned files and run the module's providers as root.
#[test]
fn status_remote_refuses_a_module_directory_another_user_owns() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let env = Env::new();
    fs::create_dir_all(&env.state).unwrap();
    let module = env.tmp.path().join("their-module");
    fs::create_dir(&module).unwrap();
    fs::copy(env.module.join("main.tf"), module.join("main.tf")).unwrap();
    std::os::unix::fs::chown(&module, Some(65534), Some(65534)).unwrap();
    let (logged_tofu, tofu_log) = logged_tofu(&env);
    let flags = [
        "--tofu-bin",
        logged_tofu.to_str().unwrap(),
        "--tofu-dir",
        module.to_str().unwrap(),
    ];
    let out = remote(&env, &flags);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains(&format!(
            "--tofu-dir {} is owned by uid 65534, not by this user (uid 0)",
            module.display()
        )) && out.stderr.contains("as_pool"),
        "{out:?}"
    );
    assert!(!tofu_log.exists(), "tofu ran");
    assert!(env.fake.requests().is_empty(), "Forgejo was asked");
    assert_eq!(
        fs::read_dir(&module).unwrap().count(),
        1,
        "the module changed"
    );
    // Its owner's own module is read as before.
    std::os::unix::fs::chown(&module, Some(0), Some(0)).unwrap();
    let out = remote(&env, &flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(tofu_log.exists(), "{out:?}");
}
