//! How the tests are built: one model of Forgejo, the dev-only crate `forgejo-model/`, that
//! every user takes as a dependency (no `#[path]` from `src/` or `benches/` includes a file of
//! it or of `tests/`), that knows nothing of the product, and three test crates in all: this one,
//! the simulation and the role's end-to-end test; and the suites of this one, sharing a process,
//! leave its environment and working directory alone.

use std::fs;
use std::path::{Path, PathBuf};

use crate::support::tree::{root, rust_files};

/// The lines (1-based) of `#[path = …]` attributes in `code`: a file compiled into two crates.
fn path_attributes(code: &str) -> Vec<usize> {
    code.lines()
        .enumerate()
        .filter(|(_, l)| {
            let l = l.trim_start();
            l.starts_with("#[path") || l.starts_with("#![path")
        })
        .map(|(n, _)| n + 1)
        .collect()
}

#[test]
fn src_and_benches_include_no_file_by_path() {
    let files: Vec<PathBuf> = ["src", "benches", "forgejo-model"]
        .iter()
        .flat_map(|dir| rust_files(&root().join(dir)))
        .collect();
    assert!(files.len() > 20, "too few Rust files found: {files:?}");
    let found: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = fs::read_to_string(f).unwrap();
            path_attributes(&text)
                .into_iter()
                .map(move |n| format!("{}:{n}", f.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "#[path] includes a file into a second crate (use the forgejo-model crate as a \
         dependency instead):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_path_check_sees_a_planted_include() {
    let code = "//! x\n#[path = \"../tests/support/forgejo_rules.rs\"]\nmod forgejo_rules;\n";
    assert_eq!(path_attributes(code), vec![2]);
    assert_eq!(
        path_attributes("    #[path=\"a.rs\"]\n    mod a;\n"),
        vec![1]
    );
    assert!(path_attributes("// #[path] in a comment\nmod a;\n").is_empty());
}

/// The dependency names of a Cargo manifest's `[dependencies]` and `[dev-dependencies]`
/// (`name = …` lines and `[dependencies.name]` tables).
fn dependencies(manifest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if let Some(table) = line.strip_prefix('[') {
            let table = table.trim_end_matches(']');
            in_deps = matches!(
                table,
                "dependencies" | "dev-dependencies" | "build-dependencies"
            );
            for prefix in ["dependencies.", "dev-dependencies.", "build-dependencies."] {
                if let Some(name) = table.strip_prefix(prefix) {
                    out.push(name.to_string());
                }
            }
        } else if in_deps && let Some((name, _)) = line.split_once('=') {
            out.push(name.trim().to_string());
        }
    }
    out
}

#[test]
fn the_model_knows_nothing_of_the_product() {
    let manifest = fs::read_to_string(root().join("forgejo-model/Cargo.toml")).unwrap();
    let deps = dependencies(&manifest);
    assert!(
        !deps.iter().any(|d| d == "ci-ephemeral-provisioner"),
        "forgejo-model/Cargo.toml depends on the product ({deps:?}): the product's unit tests \
         use the model, and two copies of the product's types would not unify; return the \
         model's own rows and convert in the shells"
    );
    let files = rust_files(&root().join("forgejo-model/src"));
    assert!(!files.is_empty());
    for f in files {
        let text = fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains("ci_ephemeral_provisioner") && !text.contains("super::"),
            "{}: the model reaches out of its crate; convert to the product's types in the \
             shells (src/test_forgejo.rs, tests/it/support/fake_forgejo.rs, tests/sim/world.rs)",
            f.display()
        );
    }
    let main = fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(
        dependencies(&main).iter().any(|d| d == "forgejo-model"),
        "Cargo.toml: forgejo-model is no dependency of the product's tests"
    );
}

#[test]
fn the_dependency_reader_sees_a_planted_dependency() {
    let manifest = "[package]\nname = \"forgejo-model\"\n\n[dependencies]\n\
                    ci-ephemeral-provisioner = { path = \"..\" }\n\n[dependencies.serde]\n\
                    version = \"1\"\n";
    assert_eq!(
        dependencies(manifest),
        vec!["ci-ephemeral-provisioner".to_string(), "serde".to_string()]
    );
    assert!(dependencies("[package]\nname = \"x\"\n").is_empty());
}

/// The test crates cargo finds in `tests/`: each `tests/NAME.rs` and `tests/NAME/main.rs`.
fn test_crates(tests: &Path) -> Vec<String> {
    let mut out: Vec<String> = fs::read_dir(tests)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_stem()?.to_string_lossy().into_owned();
            let is_crate = if p.is_dir() {
                p.join("main.rs").is_file()
            } else {
                p.extension().is_some_and(|x| x == "rs")
            };
            is_crate.then_some(name)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn the_integration_tests_are_one_crate_beside_the_simulation_and_the_role() {
    assert_eq!(
        test_crates(&root().join("tests")),
        ["it", "role_e2e", "sim"],
        "a new file in tests/ is a test binary of its own, compiled and linked on its own: add \
         it as a module of tests/it/main.rs instead"
    );
}

#[test]
fn the_crate_count_sees_a_planted_test_file() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir_all(dir.path().join("it")).unwrap();
    fs::write(dir.path().join("it/main.rs"), "").unwrap();
    fs::create_dir_all(dir.path().join("sim")).unwrap();
    fs::write(dir.path().join("sim/world.rs"), "").unwrap();
    fs::write(dir.path().join("sim.rs"), "").unwrap();
    fs::write(dir.path().join("cycle.rs"), "").unwrap();
    fs::write(dir.path().join("notes.md"), "").unwrap();
    assert_eq!(test_crates(dir.path()), ["cycle", "it", "sim"]);
}

/// The calls in `code` that change what every thread of the process sees.
fn process_wide_changes(code: &str) -> Vec<&'static str> {
    ["set_var(", "remove_var(", "set_current_dir("]
        .into_iter()
        .filter(|call| code.contains(call))
        .collect()
}

/// The suites of this crate share one process and run on its threads: none changes the
/// environment or the working directory (a command it runs gets its own, by `Command::env`).
#[test]
fn no_suite_changes_process_wide_state() {
    let files = rust_files(&root().join("tests/it"));
    let this = root().join("tests/it/crates.rs");
    let found: Vec<String> = files
        .iter()
        .filter(|f| **f != this)
        .flat_map(|f| {
            let text = fs::read_to_string(f).unwrap();
            process_wide_changes(&text)
                .into_iter()
                .map(move |call| format!("{}: {call}", f.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "a suite changes the process's environment or working directory, which every other \
         suite's thread sees; pass it to the command instead (Command::env, current_dir):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_process_check_sees_a_planted_set_var() {
    let code = "fn t() { unsafe { std::env::set_var(\"RUST_LOG\", \"trace\") }; }";
    assert_eq!(process_wide_changes(code), ["set_var("]);
    assert!(process_wide_changes("c.env(\"RUST_LOG\", \"trace\");").is_empty());
}
