//! Records the commit the binary is built from, for `--version`: `git rev-parse --short=12 HEAD`
//! of this checkout, with `-dirty` when tracked files differ from it; `unknown` without git or
//! outside a checkout (a source tarball).

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .arg("--no-optional-locks")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let commit = commit(&dir).unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=CI_EPHEMERAL_PROVISIONER_COMMIT={commit}");
}

/// The commit, or None when `dir` is not the top of a git checkout.
fn commit(dir: &Path) -> Option<String> {
    let top = git(dir, &["rev-parse", "--show-toplevel"])?;
    if Path::new(&top).canonicalize().ok()? != dir.canonicalize().ok()? {
        return None; // a tarball unpacked inside some other repository
    }
    // Rerun when HEAD moves (HEAD itself, the branch it names, packed refs, the index: commits,
    // staged changes) and when what the binary is built from changes (an unstaged edit makes it
    // -dirty). Only files that exist: cargo reruns every time for a missing one.
    let git_dir = dir.join(git(dir, &["rev-parse", "--git-dir"])?);
    let common = dir.join(git(dir, &["rev-parse", "--git-common-dir"])?);
    let mut watch = vec![
        dir.join("src"),
        dir.join("Cargo.toml"),
        dir.join("Cargo.lock"),
        dir.join("build.rs"),
        git_dir.join("HEAD"),
        git_dir.join("index"),
        common.join("packed-refs"),
    ];
    if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"]) {
        watch.push(common.join(branch));
    }
    for path in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let sha = git(dir, &["rev-parse", "--short=12", "HEAD"])?;
    let dirty = git(dir, &["status", "--porcelain", "--untracked-files=no"])?;
    Some(if dirty.is_empty() {
        sha
    } else {
        format!("{sha}-dirty")
    })
}
