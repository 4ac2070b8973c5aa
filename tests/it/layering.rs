//! The architecture, held to by tests: `src/core/` does no I/O and knows nothing of the shell,
//! the shell's layers point inward (adapters and the driver know nothing of the commands), and
//! no code sends a DELETE but `delete_runner`, which takes a `Deletable` (the gate's proof).
//! Each rule is also run against a planted violation, so the check is seen to bite.

use std::fs;
use std::path::{Path, PathBuf};

use crate::support::tree::{root, rust_files};

/// What `src/core/` must not use, and why. Matched against the code with comments and the
/// `#[cfg(test)]` module removed.
const FORBIDDEN_IN_CORE: &[(&str, &str)] = &[
    ("std::fs", "files"),
    ("std::io", "reads and writes"),
    ("std::os", "the operating system"),
    ("std::process", "processes"),
    ("std::net", "the network"),
    ("std::env", "the environment"),
    ("std::thread", "threads"),
    ("std::sync", "threads"),
    ("ureq", "HTTP"),
    ("libc", "system calls"),
    ("signal_hook", "signals"),
    ("tempfile", "files"),
    ("Instant", "the monotonic clock"),
    ("SystemTime::now", "the wall clock"),
    ("Timestamp::now", "the wall clock"),
    ("println!", "standard output"),
    ("print!", "standard output"),
    ("eprintln!", "standard error"),
    ("eprint!", "standard error"),
    ("crate::adapters", "the shell (adapters)"),
    ("crate::driver", "the shell (driver)"),
    ("crate::commands", "the shell (commands)"),
    ("crate::cli", "the command line"),
];

/// The code of a file as the build sees it outside tests: no comments, no `#[cfg(test)]` module
/// (always the file's last item here), no `tests.rs` file at all.
fn code(path: &Path) -> String {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return String::new();
    }
    let text = fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    text.lines()
        .map(|l| match l.find("//") {
            // A `//` inside a string (a URL) is rare in the core; the whole line is kept then.
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the shell's inner layers must not use: they are picked and driven by the commands, and
/// know only the core (adapters) or the core's ports (the driver).
const FORBIDDEN_IN_ADAPTERS: &[(&str, &str)] = &[
    ("crate::commands", "the commands (exit codes, wiring)"),
    ("crate::driver", "the driver"),
    ("crate::cli", "the command line"),
];
const FORBIDDEN_IN_DRIVER: &[(&str, &str)] = &[
    ("crate::commands", "the commands (exit codes, wiring)"),
    ("crate::adapters", "an implementation of a port"),
    ("crate::cli", "the command line"),
];

/// Each use of something forbidden in `code`: (line, what, why).
fn violations(code: &str) -> Vec<(usize, &'static str, &'static str)> {
    violations_of(code, FORBIDDEN_IN_CORE)
}

fn violations_of(
    code: &str,
    forbidden: &[(&'static str, &'static str)],
) -> Vec<(usize, &'static str, &'static str)> {
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        for (what, why) in forbidden {
            let mut rest = line;
            while let Some(i) = rest.find(what) {
                let before = rest[..i].chars().next_back();
                let after = rest[i + what.len()..].chars().next();
                let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
                // `print!` must not match inside `eprint!`/`println!`; `Instant` not inside a name.
                if !word(before) && (what.ends_with('!') || !word(after)) {
                    found.push((n + 1, *what, *why));
                    break;
                }
                rest = &rest[i + what.len()..];
            }
        }
    }
    found
}

// Mutation caught: an I/O call (std::fs::read_to_string) in src/core/.
#[test]
fn the_core_does_no_io_and_knows_nothing_of_the_shell() {
    let files = rust_files(&root().join("src/core"));
    assert!(files.len() > 10, "src/core has only {} files", files.len());
    let mut bad = Vec::new();
    for f in &files {
        for (line, what, why) in violations(&code(f)) {
            bad.push(format!(
                "{}:{line}: uses {what} ({why})",
                f.strip_prefix(root()).unwrap().display()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "src/core/ decides and does no I/O; move these to src/adapters/ behind a port in \
         src/core/ports.rs, or pass the value in:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_core_check_catches_a_planted_violation() {
    let planted = "use crate::core::time::Timestamp;\n\
                   pub fn load() -> String {\n    std::fs::read_to_string(\"cycle.json\").unwrap()\n}\n\
                   pub fn at() -> Timestamp { Timestamp::now() }\n\
                   fn log() { eprintln!(\"x\"); let _ = crate::adapters::clock::wall_now(); }\n";
    let found: Vec<&str> = violations(planted).iter().map(|v| v.1).collect();
    assert_eq!(
        found,
        ["std::fs", "Timestamp::now", "eprintln!", "crate::adapters"]
    );
    // Names that only contain a forbidden word are not uses of it.
    assert!(violations("let printed = 1; let instants = 2; struct MyInstantView;").is_empty());
    // Comments and the test module do not count.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("x.rs");
    fs::write(
        &f,
        "/// Reads std::fs for you.\npub fn f() {}\n\n#[cfg(test)]\nmod tests {\n    use std::fs;\n}\n",
    )
    .unwrap();
    assert!(violations(&code(&f)).is_empty(), "{}", code(&f));
}

// Mutation caught: use crate::commands::EXIT_FAILED in src/adapters/clock.rs (an adapter that knows exit codes).
#[test]
fn adapters_and_the_driver_know_nothing_of_the_commands() {
    let mut bad = Vec::new();
    for (dir, forbidden) in [
        ("src/adapters", FORBIDDEN_IN_ADAPTERS),
        ("src/driver", FORBIDDEN_IN_DRIVER),
    ] {
        let files = rust_files(&root().join(dir));
        assert!(files.len() > 1, "{dir} has only {} files", files.len());
        for f in &files {
            for (line, what, why) in violations_of(&code(f), forbidden) {
                bad.push(format!(
                    "{}:{line}: uses {what} ({why})",
                    f.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the commands pick and drive the adapters and the driver, not the other way round; \
         return a typed error and let `commands` turn it into an exit status:\n{}",
        bad.join("\n")
    );
    // The check bites: the import this rule was written against.
    let planted =
        "use crate::commands::{EXIT_FAILED, Fatal};\nuse crate::adapters::dry::MemoryStore;\n";
    let found: Vec<&str> = violations_of(planted, FORBIDDEN_IN_DRIVER)
        .iter()
        .map(|v| v.1)
        .collect();
    assert_eq!(found, ["crate::commands", "crate::adapters"]);
}

/// Where a DELETE request is made: the text `"DELETE"` in the code outside tests, with the
/// function it is in.
fn delete_requests(files: &[PathBuf]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for f in files {
        let code = code(f);
        let mut current_fn = String::new();
        for line in code.lines() {
            if let Some(i) = line.find("fn ") {
                let name: String = line[i + 3..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    current_fn = line.trim().to_string();
                }
            }
            if line.contains("\"DELETE\"") {
                found.push((
                    f.strip_prefix(root()).unwrap_or(f).display().to_string(),
                    current_fn.clone(),
                ));
            }
        }
    }
    found
}

// Mutation caught: a "DELETE" sent outside delete_runner(target: &Deletable) / may_delete called outside the core.
#[test]
fn only_delete_runner_sends_a_delete_and_it_takes_the_gates_proof() {
    let files = rust_files(&root().join("src"));
    let found = delete_requests(&files);
    // The HTTP client's `send` maps the method to ureq, and one caller sends "DELETE": the
    // port's `delete_runner`, whose target is a `Deletable`.
    let callers: Vec<&(String, String)> = found
        .iter()
        .filter(|(_, f)| !f.starts_with("fn send("))
        .collect();
    assert_eq!(
        callers,
        [&(
            "src/adapters/forgejo_http.rs".to_string(),
            "fn delete_runner(&mut self, target: &Deletable, reason: &str) -> Result<Deleted, ApiError> {"
                .to_string()
        )],
        "a DELETE outside `delete_runner(target: &Deletable)` bypasses the gate: {found:?}"
    );
    // `Deletable`'s field is private and `may_delete` its only constructor (the compile_fail
    // doctest on `Deletable` shows the rest), and only the core calls it, on rows Forgejo
    // listed: the shell cannot gate a row it made up.
    let gated_in_shell: Vec<String> = files
        .iter()
        .filter(|f| !f.starts_with(root().join("src/core")))
        .filter(|f| code(f).contains("may_delete("))
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        gated_in_shell.is_empty(),
        "may_delete outside src/core: {gated_in_shell:?}"
    );
    let gate = code(&root().join("src/core/sweep/gate.rs"));
    assert!(
        gate.contains("pub struct Deletable {\n    id: i64,\n}"),
        "{gate}"
    );
    assert_eq!(gate.matches("Deletable { id").count(), 1, "{gate}");
}

/// The files under `src` outside its `core/` whose code (tests aside) names `name` (as a word:
/// a `use … as` or a function pointer counts too).
fn users_outside_core(src: &Path, name: &'static str) -> Vec<String> {
    let files = rust_files(src);
    files
        .iter()
        .filter(|f| !f.starts_with(src.join("core")))
        .filter(|f| !violations_of(&code(f), &[(name, "")]).is_empty())
        .map(|f| f.strip_prefix(src).unwrap().display().to_string())
        .collect()
}

// Mutation caught: without_cycle(None, …) called in driver/cycle.rs (a licence without reading cycle.json).
#[test]
fn only_the_sweep_command_licenses_a_sweep_from_cycle_json() {
    // A `SweepLicence` cannot be built by hand (private fields: the compile_fail doctest on
    // `core::sweep::licence`), and the planner's `after_destroy` is private to the core. The other
    // way to one, `without_cycle`, states that cycle.json holds no cycle: only the `sweep`
    // command's wiring may say so, from the file it read under the lock.
    assert_eq!(
        users_outside_core(&root().join("src"), "without_cycle"),
        ["commands/wiring.rs"],
        "a licence made elsewhere sweeps without having read cycle.json"
    );
    let licence = code(&root().join("src/core/sweep/licence.rs"));
    assert!(
        licence.contains("pub struct SweepLicence {\n    evidence: String,\n    destroyed_cycle_id: Option<String>,\n}"),
        "{licence}"
    );
    assert!(
        licence.contains("pub(in crate::core) fn after_destroy("),
        "{licence}"
    );
}

// Mutation caught: without_cycle(None, …) called in driver/cycle.rs (a licence without reading cycle.json).
#[test]
fn the_licence_check_catches_a_planted_caller() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    fs::create_dir_all(src.join("core/sweep")).unwrap();
    fs::create_dir_all(src.join("driver")).unwrap();
    fs::write(
        src.join("core/sweep/licence.rs"),
        "pub(crate) fn without_cycle() {}\n",
    )
    .unwrap();
    fs::write(
        src.join("driver/cycle.rs"),
        "use crate::core::sweep::licence::without_cycle as assume_no_cycle;\n\
         fn f() { let _l = assume_no_cycle(); }\n\
         // without_cycle in a comment is no use of it\n",
    )
    .unwrap();
    fs::write(
        src.join("driver/sweep.rs"),
        "fn g() {}\n\n#[cfg(test)]\nmod tests {\n    fn t() { without_cycle(); }\n}\n",
    )
    .unwrap();
    assert_eq!(
        users_outside_core(src, "without_cycle"),
        ["driver/cycle.rs"]
    );
}

#[test]
fn the_delete_check_catches_a_planted_bypass() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bypass.rs");
    fs::write(
        &f,
        "impl X {\n    fn cleanup(&mut self, id: i64) {\n        self.send(\"DELETE\", &url(id), None);\n    }\n}\n",
    )
    .unwrap();
    let found = delete_requests(&[f]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].1.starts_with("fn cleanup("), "{found:?}");
}

/// The lines of a `mod.rs` (comments aside) that are neither a module declaration
/// (`mod x;`, `pub mod x;`, `pub(crate) mod x;`) nor an attribute: (line, text).
fn not_module_declarations(code: &str) -> Vec<(usize, String)> {
    let declares_a_module = |l: &str| {
        let l = ["pub(crate) ", "pub "]
            .iter()
            .find_map(|p| l.strip_prefix(p))
            .unwrap_or(l);
        l.strip_prefix("mod ")
            .and_then(|r| r.strip_suffix(';'))
            .is_some_and(|name| name.chars().all(|c| c.is_alphanumeric() || c == '_'))
    };
    code.lines()
        .enumerate()
        .map(|(n, l)| (n + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with("#[") && !declares_a_module(l))
        .map(|(n, l)| (n, l.to_string()))
        .collect()
}

// Mutation caught: `pub use exit::Fatal;` or `pub const EXIT_OK: u8 = 0;` in src/commands/mod.rs (an item imported back from the list of rooms).
#[test]
fn the_commands_mod_only_lists_its_rooms() {
    // Every item lives in the room named for it (`config`, `record`, `exit`, …) and is imported
    // from there: with nothing but modules in mod.rs, no `crate::commands::{…}` import climbs
    // back up (the compiler refuses one).
    let path = root().join("src/commands/mod.rs");
    let found = not_module_declarations(&code(&path));
    assert!(
        found.is_empty(),
        "src/commands/mod.rs only lists the rooms (`pub mod …;`); move these into the room they \
         belong to and import them from there:\n{found:?}"
    );
    assert!(
        code(&path).matches("pub mod ").count() > 4,
        "{}",
        code(&path)
    );
    // The check bites: a constant, a re-export and a helper planted among the rooms.
    let planted = "pub mod config;\n#[doc(hidden)]\npub mod exit;\n\
                   pub const EXIT_OK: u8 = 0;\npub use exit::Fatal;\n\
                   pub(crate) fn usage() {}\nmod wiring;\n";
    let found: Vec<usize> = not_module_declarations(planted)
        .iter()
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(found, [4, 5, 6]);
}

/// Most lines a function outside tests may span, from its `fn` line to its closing brace: a
/// longer one is split into named steps.
const MAX_FN_LINES: usize = 80;

/// Functions over [`MAX_FN_LINES`] that are yet to be split, each with why it may stay.
const LONG_FN_ALLOWED: &[(&str, &str)] = &[];

/// The functions of `code` (as [`code`] gives it) longer than `max` lines: (name, lines). A
/// function ends at the first line after its signature that is its `fn` line's indentation and
/// a `}` (rustfmt's layout); one under `#[cfg(test)]` is test code and not counted.
fn long_functions(code: &str, max: usize) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let Some(i) = trimmed.find("fn ") else {
            continue;
        };
        let head = &trimmed[..i];
        let qualifiers = head
            .split_whitespace()
            .all(|w| w.starts_with("pub") || ["const", "async", "unsafe", "extern"].contains(&w));
        let name: String = trimmed[i + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !qualifiers || name.is_empty() || line.trim_end().ends_with('}') {
            continue;
        }
        let under_test = lines[..n]
            .iter()
            .rev()
            .take_while(|l| l.trim_start().starts_with("#["))
            .any(|l| l.trim() == "#[cfg(test)]");
        let Some(sig_end) = (n..lines.len()).find(|k| {
            let l = lines[*k].trim_end();
            l.ends_with('{') || l.ends_with(';')
        }) else {
            continue;
        };
        if under_test || lines[sig_end].trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        let end = (sig_end + 1..lines.len())
            .find(|k| lines[*k].trim_end() == close)
            .unwrap_or(lines.len() - 1);
        if end - n + 1 > max {
            found.push((name, end - n + 1));
        }
    }
    found
}

// Mutation caught: a 243-line `decide_running` (any fn outside tests over 80 lines in src/).
#[test]
fn no_function_outside_tests_is_over_80_lines() {
    let files = rust_files(&root().join("src"));
    let mut long = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        // The fake Forgejo of the unit tests (`#[cfg(test)] mod test_forgejo` in lib.rs).
        if rel == "src/test_forgejo.rs" {
            continue;
        }
        for (name, n) in long_functions(&code(f), MAX_FN_LINES) {
            long.push((format!("{rel}: {name}"), n));
        }
    }
    let unexpected: Vec<String> = long
        .iter()
        .filter(|(at, _)| !LONG_FN_ALLOWED.iter().any(|(a, _)| a == at))
        .map(|(at, n)| format!("{at} ({n} lines)"))
        .collect();
    assert!(
        unexpected.is_empty(),
        "functions over {MAX_FN_LINES} lines: split each into named steps (pure functions where \
         it decides):\n{}",
        unexpected.join("\n")
    );
    // An allowance for a function that is no longer long is removed with it.
    let stale: Vec<&str> = LONG_FN_ALLOWED
        .iter()
        .map(|(a, _)| *a)
        .filter(|a| !long.iter().any(|(at, _)| at == a))
        .collect();
    assert!(stale.is_empty(), "remove from LONG_FN_ALLOWED: {stale:?}");
}

#[test]
fn the_length_check_catches_a_planted_long_function() {
    let body = "    let x = 1;\n".repeat(80);
    let planted = format!(
        "pub(crate) fn long(\n    a: u8,\n) -> u8 {{\n{body}    a\n}}\n\n\
         fn short() -> u8 {{\n    1\n}}\n\n\
         impl X {{\n    pub fn nested(&self) {{\n{body}    }}\n\n    fn one(&self) {{}}\n}}\n\n\
         trait T {{\n    fn declared(\n        &self,\n    );\n}}\n\n\
         #[cfg(test)]\nfn helper() {{\n{body}}}\n"
    );
    assert_eq!(
        long_functions(&planted, MAX_FN_LINES),
        [("long".to_string(), 85), ("nested".to_string(), 82)]
    );
    assert!(
        long_functions(&planted, 85)
            .iter()
            .all(|(n, _)| n != "long")
    );
}
