//! The documentation against itself and against the binary: the Markdown stays small (all of it
//! at most 100,000 bytes, the README at most 15,000), every relative link and `#anchor` resolves,
//! and the README's configuration table lists exactly the flags that `--help` shows, for the
//! commands that show them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::support::tree::{read, root, rust_files};

const BIN: &str = env!("CARGO_BIN_EXE_ci-ephemeral-provisioner");
const README_MAX_BYTES: usize = 15_000;
/// All git-tracked Markdown together: 100,000 until one pool across hosts, the QEMU module and
/// webhooks each brought an operator's setup, timeline and messages.
const MARKDOWN_MAX_BYTES: usize = 125_000;
/// Subcommands whose flags the table must cover from the start; others (`check`) once their
/// `--help` works.
const REQUIRED_SUBCOMMANDS: [&str; 3] = ["run", "sweep", "status"];
/// clap's own flags, in every `--help`; the table does not list them.
const BUILTIN_FLAGS: [&str; 2] = ["--help", "--version"];

/// What is over the budgets: all Markdown files (path, bytes) together over
/// `MARKDOWN_MAX_BYTES`, `README.md` over `README_MAX_BYTES` (empty when within both).
fn over_budget(files: &[(PathBuf, usize)]) -> Vec<String> {
    let mut problems = Vec::new();
    let total: usize = files.iter().map(|(_, n)| n).sum();
    if total > MARKDOWN_MAX_BYTES {
        let mut largest: Vec<&(PathBuf, usize)> = files.iter().collect();
        largest.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let shown: Vec<String> = largest
            .iter()
            .take(5)
            .map(|(p, n)| format!("{} {n}", p.strip_prefix(root()).unwrap_or(p).display()))
            .collect();
        problems.push(format!(
            "the Markdown is {total} bytes together, more than {MARKDOWN_MAX_BYTES} (largest: {}): \
             say each thing once, shortly",
            shown.join(", ")
        ));
    }
    if let Some((_, n)) = files.iter().find(|(p, _)| p == &root().join("README.md"))
        && *n > README_MAX_BYTES
    {
        problems.push(format!(
            "README.md is {n} bytes, more than {README_MAX_BYTES}: move the details into docs/ and link them"
        ));
    }
    problems
}

/// Every Markdown file git does not ignore, with its size.
fn markdown_sizes() -> Vec<(PathBuf, usize)> {
    repository_files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md") && p.is_file())
        .map(|p| {
            let n = fs::metadata(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .len();
            (p, usize::try_from(n).unwrap_or(usize::MAX))
        })
        .collect()
}

#[test]
fn the_markdown_and_the_readme_are_within_their_budgets() {
    let files = markdown_sizes();
    assert!(
        files.iter().any(|(p, _)| p == &root().join("README.md"))
            && files
                .iter()
                .any(|(p, _)| p == &root().join("docs/testing.md")),
        "the Markdown files were not found: {files:?}"
    );
    let problems = over_budget(&files);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// Mutation caught: the total's check or the README's check loosened (each).
#[test]
fn the_size_check_sees_too_much_markdown_and_a_large_readme() {
    let doc = |rel: &str, n: usize| (root().join(rel), n);
    assert!(
        over_budget(&[
            doc("README.md", 15_000),
            doc("docs/a.md", MARKDOWN_MAX_BYTES - 15_000)
        ])
        .is_empty()
    );
    let total = over_budget(&[
        doc("README.md", 10),
        doc("docs/a.md", MARKDOWN_MAX_BYTES - 9),
    ]);
    assert_eq!(total.len(), 1, "{total:?}");
    let shown = format!("{} bytes together", MARKDOWN_MAX_BYTES + 1);
    let largest = format!("docs/a.md {}", MARKDOWN_MAX_BYTES - 9);
    assert!(
        total[0].contains(&shown) && total[0].contains(&largest),
        "{total:?}"
    );
    let readme = over_budget(&[doc("README.md", 15_001), doc("role/README.md", 20_000)]);
    assert_eq!(readme.len(), 1, "{readme:?}");
    assert!(
        readme[0].starts_with("README.md is 15001 bytes"),
        "{readme:?}"
    );
}

// --- Markdown, as far as links and headings go ------------------------------------------------

/// The lines outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<(char, usize)> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let run = |c: char| t.chars().take_while(|&x| x == c).count();
        match fence {
            Some((c, n)) => {
                if run(c) >= n && t.trim_start_matches(c).trim().is_empty() {
                    fence = None;
                }
            }
            None => {
                if let Some(c) = ['`', '~'].into_iter().find(|&c| run(c) >= 3) {
                    fence = Some((c, run(c)));
                } else {
                    out.push((i + 1, line));
                }
            }
        }
    }
    out
}

/// The line without its code spans (`` `…` ``, also with longer backtick runs).
fn without_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|&&c| c == '`').count();
        let mut j = i + n;
        let mut closed = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let m = chars[j..].iter().take_while(|&&c| c == '`').count();
                if m == n {
                    closed = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match closed {
            Some(end) => {
                out.push(' ');
                i = end;
            }
            None => {
                // An unmatched run is literal text.
                out.extend(&chars[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// The targets of the inline links and images of one line (`[text](target "title")`), and of a
/// reference definition (`[id]: target`).
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut out = Vec::new();
    let t = line.trim_start();
    if t.starts_with('[')
        && let Some(close) = t.find("]:")
        && !t[..close].contains('(')
    {
        if let Some(target) = t[close + 2..].split_whitespace().next() {
            out.push(target.trim_matches(|c| c == '<' || c == '>').to_string());
        }
        return out;
    }
    let bytes = line.as_bytes();
    let mut i = 0;
    while let Some(pos) = line[i..].find("](") {
        let start = i + pos + 2;
        let mut depth = 1;
        let mut end = start;
        while end < bytes.len() {
            match bytes[end] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            end += 1;
        }
        let inside = line[start..end.min(bytes.len())].trim();
        let target = if let Some(rest) = inside.strip_prefix('<') {
            rest.split('>').next().unwrap_or("")
        } else {
            inside.split_whitespace().next().unwrap_or("")
        };
        out.push(target.to_string());
        i = end.min(bytes.len());
    }
    out
}

/// The text of a heading as GitHub renders it: no code-span backticks, no emphasis stars, links
/// reduced to their text.
fn heading_text(raw: &str) -> String {
    let mut s = String::new();
    let chars: Vec<char> = raw.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '`' | '*' => i += 1,
            '!' if chars.get(i + 1) == Some(&'[') => i += 1,
            '[' => {
                // [text](url) → text
                let rest: String = chars[i + 1..].iter().collect();
                if let Some(close) = rest.find("](")
                    && let Some(paren) = rest[close + 2..].find(')')
                {
                    s.push_str(&rest[..close]);
                    let consumed = rest[..close + 2 + paren + 1].chars().count();
                    i += 1 + consumed;
                } else {
                    s.push('[');
                    i += 1;
                }
            }
            c => {
                s.push(c);
                i += 1;
            }
        }
    }
    s
}

/// GitHub's anchor of a heading: lower case; letters, digits, `-`, `_` and spaces kept, every
/// other character dropped; each space becomes `-`.
fn slug(heading: &str) -> String {
    heading_text(heading)
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a Markdown file: its ATX headings' slugs, repeated ones numbered `-1`, `-2` …
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let t = line.trim_start();
        let level = t.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&level) || !(t[level..].starts_with(' ') || t.len() == level) {
            continue;
        }
        let title = t[level..].trim().trim_end_matches('#').trim_end();
        let base = slug(title);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && bytes[i + 1].is_ascii_hexdigit()
            && bytes[i + 2].is_ascii_hexdigit()
        {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("00");
            out.push(u8::from_str_radix(hex, 16).unwrap_or(0));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a/b/../c` → `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The files git does not ignore (tracked, or new and not ignored) that exist, and the directories
/// that hold them: what the documentation may link to and what it is made of. A role installed
/// into an ignored directory, a build's output, are neither.
fn repository_files() -> BTreeSet<PathBuf> {
    let r = root();
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(&r)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .output()
        .expect("run git ls-files (the link check reads the repository's files from git)");
    assert!(
        out.status.success(),
        "git ls-files in {}: {out:?}",
        r.display()
    );
    let mut set = BTreeSet::new();
    for rel in out.stdout.split(|b| *b == 0).filter(|p| !p.is_empty()) {
        let path = r.join(String::from_utf8_lossy(rel).as_ref());
        if fs::symlink_metadata(&path).is_err() {
            continue; // deleted, not yet committed
        }
        let mut p = path.as_path();
        while let Some(parent) = p.parent() {
            if !set.insert(parent.to_path_buf()) || parent == r {
                break;
            }
            p = parent;
        }
        set.insert(path);
    }
    set
}

/// README.md, docs/*.md, role/README.md and examples/**/*.md, as git sees them.
fn documentation_files() -> Vec<PathBuf> {
    let r = root();
    repository_files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md") && p.is_file())
        .filter(|p| {
            let rel = p.strip_prefix(&r).unwrap_or(p);
            rel == Path::new("README.md")
                || rel == Path::new("role/README.md")
                || rel.parent() == Some(Path::new("docs"))
                || rel.starts_with("examples")
        })
        .collect()
}

/// What is wrong with every relative link of `file` (empty when they all resolve).
fn broken_links(file: &Path) -> Vec<String> {
    broken_links_among(file, &repository_files())
}

/// The same, where a link may point only into `files` (a file or directory git does not ignore).
fn broken_links_among(file: &Path, files: &BTreeSet<PathBuf>) -> Vec<String> {
    let text = read(file);
    let own_anchors = anchors(&text);
    let shown = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let mut problems = Vec::new();
    for (n, line) in prose_lines(&text) {
        for target in link_targets(line) {
            let is_external = target.split_once(':').is_some_and(|(scheme, _)| {
                !scheme.is_empty()
                    && scheme
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
            });
            if target.is_empty() || is_external {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let path = percent_decode(path);
            let here = format!("{shown}:{n}: ({target})");
            let dest = if path.is_empty() {
                file.to_path_buf()
            } else if let Some(abs) = path.strip_prefix('/') {
                normalize(&root().join(abs))
            } else {
                normalize(&file.parent().unwrap_or(Path::new("")).join(&path))
            };
            if !dest.exists() {
                problems.push(format!("{here}: {} does not exist", dest.display()));
                continue;
            }
            if dest != file && !files.contains(&dest) {
                problems.push(format!(
                    "{here}: {} is ignored by git (not part of the repository)",
                    dest.display()
                ));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let anchor = percent_decode(anchor).to_lowercase();
            let target_anchors = if path.is_empty() {
                own_anchors.clone()
            } else if dest.extension().is_some_and(|e| e == "md") {
                anchors(&read(&dest))
            } else {
                problems.push(format!(
                    "{here}: an anchor into {}, which is not Markdown",
                    dest.display()
                ));
                continue;
            };
            if !target_anchors.contains(&anchor) {
                problems.push(format!(
                    "{here}: no heading with the anchor #{anchor} in {}",
                    dest.display()
                ));
            }
        }
    }
    problems
}

#[test]
fn every_relative_link_and_anchor_of_the_documentation_resolves() {
    let files = documentation_files();
    assert!(
        files.len() >= 3,
        "the documentation files were not found: {files:?}"
    );
    let problems: Vec<String> = files.iter().flat_map(|f| broken_links(f)).collect();
    assert!(
        problems.is_empty(),
        "broken links:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_link_check_sees_a_broken_link_and_a_broken_anchor() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("doc.md");
    fs::write(
        dir.path().join("other.md"),
        "# Other page\n\n## The `check` command\n",
    )
    .unwrap();
    fs::write(
        &doc,
        "# Title: one\n\n```\n[in a code block](missing-in-fence.md)\n```\n\n\
         Fine: [a](other.md#the-check-command), [b](#title-one), [c](https://example.org/x),\n\
         `[code](missing-in-code.md)`.\n\
         Broken: [d](missing.md), [e](other.md#no-such-heading), [f](#nowhere),\n         [g](ignored.md).\n",
    )
    .unwrap();
    fs::write(dir.path().join("ignored.md"), "# Ignored\n").unwrap();
    // What git sees: the directory, the page and other.md; ignored.md exists but is ignored.
    let files: BTreeSet<PathBuf> = [
        dir.path().to_path_buf(),
        doc.clone(),
        dir.path().join("other.md"),
    ]
    .into_iter()
    .collect();
    let problems = broken_links_among(&doc, &files);
    assert_eq!(problems.len(), 4, "{problems:#?}");
    assert!(problems[0].contains("missing.md") && problems[0].contains("does not exist"));
    assert!(problems[1].contains("#no-such-heading"));
    assert!(problems[2].contains("#nowhere"));
    assert!(problems[3].contains("ignored.md") && problems[3].contains("ignored by git"));
}

/// A page in a directory git ignores (a role installed into one, tofu's .terraform/) is not
/// documentation: its links are not checked, and nothing may link to it.
#[test]
fn the_link_check_skips_what_git_ignores() {
    let dir = root().join(format!(
        "examples/hetzner/.terraform/docs-test-{}",
        std::process::id()
    ));
    fs::create_dir_all(&dir).unwrap();
    let page = dir.join("README.md");
    fs::write(
        &page,
        "# Installed elsewhere\n\n[broken](../../nowhere.md)\n",
    )
    .unwrap();
    let files = documentation_files();
    let tracked = repository_files();
    fs::remove_dir_all(&dir).unwrap();
    assert!(
        !files.contains(&page),
        "an ignored page is checked: {}",
        page.display()
    );
    assert!(!tracked.contains(&page) && !tracked.contains(&dir));
    assert!(
        files.contains(&root().join("examples/ansible/README.md")),
        "{files:#?}"
    );
    assert!(
        tracked.contains(&root().join("role")),
        "directories of tracked files are in it"
    );
}

#[test]
fn anchors_follow_githubs_slugs() {
    let text = "# Audit trail: `events.jsonl`\n## The Ansible role's tests\n\
                ## What `bash .ci/run` runs\n## Forgejo ≥ 15 — and *more*\n## Metrics\n## Metrics\n\
                ## [Linked](x.md) heading\n";
    let a = anchors(text);
    for want in [
        "audit-trail-eventsjsonl",
        "the-ansible-roles-tests",
        "what-bash-cirun-runs",
        "forgejo--15--and-more",
        "metrics",
        "metrics-1",
        "linked-heading",
    ] {
        assert!(a.contains(want), "{want} not in {a:?}");
    }
}

// --- The configuration table against --help ---------------------------------------------------

/// `--help` of the binary (stdout), or `None` when it exits non-zero (a subcommand that does not
/// exist yet).
fn help(args: &[&str]) -> Option<String> {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"));
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The long flags a `--help` defines: the first `--flag` of each option line (indented, starting
/// with `-`), without clap's own.
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter(|l| {
            let indent = l.len() - l.trim_start().len();
            (1..8).contains(&indent) && l.trim_start().starts_with('-')
        })
        .filter_map(|l| long_flags(l).into_iter().next())
        .filter(|f| !BUILTIN_FLAGS.contains(&f.as_str()))
        .collect()
}

/// Every `--flag` token of a text, in order.
fn long_flags(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(pos) = text[i..].find("--") {
        let start = i + pos;
        let preceded = start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'-');
        let mut end = start + 2;
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'-')
        {
            end += 1;
        }
        if !preceded && end > start + 2 && b[start + 2].is_ascii_lowercase() {
            out.push(text[start..end].trim_end_matches('-').to_string());
        }
        i = end.max(start + 2);
    }
    out
}

/// The subcommands the top-level `--help` lists (without `help`).
fn listed_subcommands(top: &str) -> BTreeSet<String> {
    top.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// The lines of a `## ` section of the README, up to the next `## ` heading.
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let lines = prose_lines(text);
    let Some(start) = lines.iter().position(|(_, l)| l.trim() == heading) else {
        panic!("README.md has no `{heading}` section");
    };
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in text.lines().skip(lines[start].0) {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        }
        if !in_fence && line.starts_with("## ") {
            break;
        }
        out.push(line);
    }
    out
}

/// One row of the configuration table: the flags of its first column and its `commands`.
struct Row {
    line: String,
    flags: Vec<String>,
    commands: BTreeSet<String>,
}

fn cells(line: &str) -> Vec<String> {
    let protected = line.replace("\\|", "\u{0}");
    protected
        .trim()
        .trim_matches('|')
        .split('|')
        .map(|c| c.replace('\u{0}', "|").trim().to_string())
        .collect()
}

/// The flag table of README.md's `## Configuration`: `| flag | default | commands | meaning |`.
fn configuration_table(readme: &str) -> Vec<Row> {
    let lines = section(readme, "## Configuration");
    let header_at = lines
        .iter()
        .position(|l| l.trim_start().starts_with('|'))
        .expect("the configuration section has no table");
    let header = cells(lines[header_at]);
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("the configuration table has no `{name}` column: {header:?}"))
    };
    let (flag_col, commands_col) = (column("flag"), column("commands"));
    lines[header_at + 2..]
        .iter()
        .take_while(|l| l.trim_start().starts_with('|'))
        .map(|l| {
            let c = cells(l);
            Row {
                line: l.to_string(),
                flags: long_flags(c.get(flag_col).map_or("", String::as_str)),
                commands: c
                    .get(commands_col)
                    .map_or("", String::as_str)
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            }
        })
        .collect()
}

/// Every subcommand whose flags the table must cover, with the flags its `--help` shows.
fn subcommand_flags() -> BTreeMap<String, BTreeSet<String>> {
    let top = help(&["--help"]).expect("`--help` fails");
    let listed = listed_subcommands(&top);
    let mut subs: BTreeSet<String> = REQUIRED_SUBCOMMANDS.iter().map(|s| s.to_string()).collect();
    subs.extend(listed.iter().cloned());
    let mut out = BTreeMap::new();
    for sub in &subs {
        let text = help(&[sub, "--help"])
            .unwrap_or_else(|| panic!("`{sub} --help` fails although `--help` lists it"));
        out.insert(sub.clone(), help_flags(&text));
    }
    // `check` is being added: required as soon as its --help works, listed or not.
    if !out.contains_key("check")
        && let Some(text) = help(&["check", "--help"])
    {
        out.insert("check".to_string(), help_flags(&text));
    }
    for (sub, flags) in &out {
        assert!(!flags.is_empty(), "no flags read from `{sub} --help`");
    }
    out
}

/// What is wrong between the table and the flags of the subcommands (empty when they agree).
/// The `commands` column is checked for `run`, `sweep`, `status` and every subcommand the column
/// names anywhere; a subcommand it never names (`check`, which takes the flags of `run`) only
/// needs its flags in the table.
fn table_problems(rows: &[Row], subs: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut problems = Vec::new();
    let in_table: BTreeSet<&String> = rows.iter().flat_map(|r| &r.flags).collect();
    for (sub, flags) in subs {
        for f in flags {
            if !in_table.contains(f) {
                problems.push(format!(
                    "`{sub} --help` shows {f}, which the configuration table lacks"
                ));
            }
        }
    }
    let shown: BTreeSet<&String> = subs.values().flatten().collect();
    let mut columns: BTreeMap<&String, BTreeSet<&String>> = BTreeMap::new();
    let mut checked: BTreeSet<&str> = REQUIRED_SUBCOMMANDS.into_iter().collect();
    for r in rows {
        if r.flags.is_empty() {
            problems.push(format!("a table row without a --flag: {}", r.line));
        }
        for c in &r.commands {
            if !subs.contains_key(c) {
                problems.push(format!(
                    "`{c}` in the commands column is not a subcommand: {}",
                    r.line
                ));
            }
            checked.insert(c.as_str());
        }
        for f in &r.flags {
            if !shown.contains(f) {
                problems.push(format!(
                    "the configuration table has {f}, which no --help shows"
                ));
            }
            columns.entry(f).or_default().extend(&r.commands);
        }
    }
    for (f, named) in columns {
        for sub in checked.iter().filter(|s| subs.contains_key(**s as &str)) {
            let has = subs[*sub].contains(f);
            let says = named.iter().any(|c| c.as_str() == *sub);
            if has != says {
                problems.push(format!(
                    "{f}: `{sub} --help` {} it, but its commands column {} `{sub}`",
                    if has { "shows" } else { "does not show" },
                    if says { "names" } else { "does not name" }
                ));
            }
        }
    }
    problems
}

#[test]
fn the_configuration_table_lists_exactly_the_flags_of_every_help() {
    let readme = read(&root().join("README.md"));
    let rows = configuration_table(&readme);
    let subs = subcommand_flags();
    let problems = table_problems(&rows, &subs);
    assert!(
        problems.is_empty(),
        "README.md's configuration table and --help disagree:\n  {}",
        problems.join("\n  ")
    );
    // The commands section names every subcommand.
    let commands = section(&readme, "## Commands").join("\n");
    for sub in subs.keys() {
        assert!(
            commands.contains(&format!("ci-ephemeral-provisioner {sub} ")),
            "README.md's commands section does not show `{sub}`"
        );
    }
}

#[test]
fn the_table_check_sees_a_missing_flag_a_stray_flag_and_a_wrong_column() {
    let readme = read(&root().join("README.md"));
    let subs = subcommand_flags();
    let good = configuration_table(&readme);
    assert!(table_problems(&good, &subs).is_empty());

    // A row dropped from the table.
    let table: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("| `--idle-timeout"))
        .collect();
    assert_eq!(table.len(), 1);
    let without = readme.replace(&format!("{}\n", table[0]), "");
    let problems = table_problems(&configuration_table(&without), &subs);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("--idle-timeout") && p.contains("lacks")),
        "{problems:#?}"
    );

    // A flag no --help has.
    let stray = readme.replace(
        &format!("{}\n", table[0]),
        &format!("{}\n| `--no-such-flag` | — | run | … |\n", table[0]),
    );
    let problems = table_problems(&configuration_table(&stray), &subs);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("--no-such-flag") && p.contains("no --help")),
        "{problems:#?}"
    );

    // The commands column of a row says `sweep` for a flag only `run` has.
    let wrong = readme.replace(table[0], &table[0].replacen("| run |", "| run, sweep |", 1));
    assert_ne!(wrong, readme);
    let problems = table_problems(&configuration_table(&wrong), &subs);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("--idle-timeout") && p.contains("`sweep --help` does not show")),
        "{problems:#?}"
    );
}

#[test]
fn help_flags_are_read_from_option_lines_only() {
    let text = "Does things. See --not-this.\n\nOptions:\n      --forgejo-url <URL>  Base URL; with --dry-run too\n  -v, --verbose            Debug logging\n  -h, --help               Print help\n";
    let flags = help_flags(text);
    assert_eq!(
        flags,
        ["--forgejo-url", "--verbose"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
}

/// The quick start shows what the first set-up command really prints.
#[test]
fn the_quick_start_shows_the_real_plan() {
    let out = std::process::Command::new(BIN)
        .args([
            "run",
            "--dry-run",
            "--fixture",
            "fixtures/fresh-cycle.json",
            "--labels",
            "debian:host",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let plan = String::from_utf8(out.stdout).unwrap();
    let readme = read(&root().join("README.md"));
    assert!(
        readme.contains(&format!("```\n{plan}```")),
        "README.md's quick start does not show the plan the command prints:\n{plan}"
    );
}

// --- Every error message of src/ has its entry in docs/troubleshooting.md ---------------------

/// The calls whose first string literal is a message someone reads: an error of a command, a
/// failure in the run report, or a part of one (the context an `anyhow!` adds). (Warnings,
/// `status` lines and the launch command's verdicts have their own tables, not checked here.)
const MESSAGE_CALLS: [&str; 10] = [
    "usage(", "bail!(", "anyhow!(", ".fail(", "Fatal(", "write!(",
    // The state directory's refusals (`StateDirError`) and a configuration error past the lock.
    "Unsafe(", "Locked(", "Failed(", "Config(",
];

/// Messages without an entry, each with why (matched by their key, see `message_key`).
const EXEMPT: [(&str, &str); 5] = [
    (
        "cannot encode the report",
        "serde_json cannot fail on the report",
    ),
    ("cannot encode:", "serde_json cannot fail on an event"),
    (
        "--tofu-bin or --tofu-dir changed while they were checked",
        "check racing itself",
    ),
    (
        "a fixture is read-only",
        "a dry-run never writes: only a bug shows it",
    ),
    (
        "is too large",
        "a number past u64 in --events-max-bytes: the message says it",
    ),
];

/// A Rust string literal starting at `s[0] == '"'`: its text (escapes resolved) and its length.
fn string_literal(s: &str) -> Option<(String, usize)> {
    let mut out = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, i + 1)),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                '\n' => {
                    // A line continuation: the next line's leading blanks are dropped.
                    while let Some((_, c)) = chars.clone().next().filter(|(_, c)| c.is_whitespace())
                    {
                        let _ = c;
                        chars.next();
                    }
                }
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// Every message of the code (tests left out) in `text`: the first string literal of each
/// `MESSAGE_CALLS` call (`write!` only into a `Display` impl's `f`), through a `format!(` and
/// an exit code.
fn messages_in(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut out = Vec::new();
    for call in MESSAGE_CALLS {
        for (at, _) in code.match_indices(call) {
            let mut rest = code[at + call.len()..].trim_start();
            if call == "write!(" {
                // Only a `Display` impl's `write!(f, …)`: what an error prints.
                let Some(r) = rest.strip_prefix("f,") else {
                    continue;
                };
                rest = r.trim_start();
            }
            for skip in ["format!(", "EXIT_USAGE,", "EXIT_FAILED,", "EXIT_LOCKED,"] {
                rest = rest.strip_prefix(skip).unwrap_or(rest).trim_start();
            }
            if rest.starts_with('"')
                && let Some((lit, _)) = string_literal(rest)
            {
                out.push(lit);
            }
        }
    }
    out
}

/// What an entry must quote of a message: the fixed parts (between its `{…}` placeholders, no
/// backticks) of its head, in order — the head is the message up to the first `: `, `; ` or ` (`
/// that follows 16 characters of fixed text (an entry may abbreviate the rest as `…`). `None`
/// for a message of fewer than 8 fixed characters (a wrapper of another message, `"{e:#}"`).
fn message_key(msg: &str) -> Option<Vec<String>> {
    let protected = msg.replace("{{", "\u{1}").replace("}}", "\u{2}");
    // The fixed parts, each with where it ends in `protected`.
    let mut parts: Vec<(String, usize)> = Vec::new();
    let mut at = 0;
    while at < protected.len() {
        let rest = &protected[at..];
        let (text, next) = match rest.find('{') {
            Some(open) => (
                &rest[..open],
                rest[open..]
                    .find('}')
                    .map_or(protected.len(), |c| at + open + c + 1),
            ),
            None => (rest, protected.len()),
        };
        parts.push((text.to_string(), at + text.len()));
        at = next;
    }
    let clean = |p: &str| {
        p.replace('\u{1}', "{")
            .replace('\u{2}', "}")
            .replace('`', "")
            .trim()
            .to_string()
    };
    let mut head = Vec::new();
    let mut fixed = 0;
    'parts: for (text, _) in &parts {
        for (i, _) in text.char_indices() {
            let here = &text[i..];
            if fixed + text[..i].trim().chars().count() >= 16
                && [": ", "; ", " ("].iter().any(|sep| here.starts_with(sep))
            {
                head.push(clean(&text[..i]));
                break 'parts;
            }
        }
        fixed += text.trim().chars().count();
        head.push(clean(text));
    }
    head.retain(|p| !p.is_empty());
    let fixed: usize = head.iter().map(|p| p.chars().count()).sum();
    (fixed >= 8).then_some(head)
}

/// Whether one line of `doc` holds the parts in order.
fn quoted(doc: &str, parts: &[String]) -> bool {
    doc.lines().any(|line| {
        let mut rest = line;
        parts.iter().all(|p| match rest.find(p.as_str()) {
            Some(i) => {
                rest = &rest[i + p.len()..];
                true
            }
            None => false,
        })
    })
}

/// The keys of the messages in `files` that `doc` (troubleshooting.md) does not quote.
fn undocumented(files: &[PathBuf], doc: &str) -> Vec<String> {
    let doc = doc.replace('`', "").replace("\\|", "|");
    let mut missing = Vec::new();
    for f in files {
        for msg in messages_in(&read(f)) {
            let Some(parts) = message_key(&msg) else {
                continue;
            };
            let key = parts.join(" … ");
            if quoted(&doc, &parts) || EXEMPT.iter().any(|(e, _)| key == *e) {
                continue;
            }
            let shown = f.strip_prefix(root()).unwrap_or(f).display().to_string();
            missing.push(format!("{shown}: {key:?} (of {msg:?})"));
        }
    }
    missing
}

// Mutation caught: an entry dropped from docs/troubleshooting.md.
#[test]
fn every_error_message_has_its_troubleshooting_entry() {
    // The model of Forgejo the unit tests use is not the product: its messages need no entry.
    let files: Vec<PathBuf> = rust_files(&root().join("src"))
        .into_iter()
        .filter(|f| !f.ends_with("test_forgejo.rs"))
        .collect();
    let found: usize = files.iter().map(|f| messages_in(&read(f)).len()).sum();
    assert!(
        found > 100,
        "only {found} messages found in src/: is the search broken?"
    );
    // The exempt list stays short and true: each entry still names a message of the code.
    let keys: BTreeSet<String> = files
        .iter()
        .flat_map(|f| messages_in(&read(f)))
        .filter_map(|m| message_key(&m).map(|p| p.join(" … ")))
        .collect();
    for (e, why) in EXEMPT {
        assert!(
            keys.contains(e),
            "EXEMPT names {e:?} ({why}), which no message has"
        );
    }
    let missing = undocumented(&files, &read(&root().join("docs/troubleshooting.md")));
    assert!(
        missing.is_empty(),
        "{} message(s) have no entry in docs/troubleshooting.md (quote each, keyed by the words \
         shown; or exempt it in tests/it/docs.rs with why):\n  {}",
        missing.len(),
        missing.join("\n  ")
    );
}

#[test]
fn the_message_check_finds_a_message_without_an_entry() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("x.rs");
    fs::write(
        &src,
        "fn f() { return Err(usage(format!(\"--widget {} is too wide: make it narrower\", w))); \
         bail!(\"cannot frobnicate {}: {e}\", p); report.fail(format!(\"{e:#}\")); }\n\
         #[cfg(test)]\nmod tests { fn t() { bail!(\"only a test says this\"); } }\n",
    )
    .unwrap();
    let msgs = messages_in(&read(&src));
    assert_eq!(msgs.len(), 3, "{msgs:?}");
    let key = |m: &str| message_key(m).map(|p| p.join(" … "));
    assert_eq!(key(&msgs[0]).as_deref(), Some("--widget … is too wide"));
    assert_eq!(key(&msgs[1]).as_deref(), Some("cannot frobnicate"));
    assert_eq!(key(&msgs[2]), None, "a wrapper of another message");
    assert_eq!(
        key("state directory {} is not a directory; point --state-dir at it").as_deref(),
        Some("state directory … is not a directory")
    );
    // Both parts, in order, on one line.
    let doc = "| `--widget … is too wide: make it narrower` | … |\n";
    let missing = undocumented(std::slice::from_ref(&src), doc);
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(missing[0].contains("cannot frobnicate"), "{missing:?}");
    let both = format!("{doc}`cannot frobnicate …: …`");
    assert!(undocumented(std::slice::from_ref(&src), &both).is_empty());
    let reversed = "| is too wide | `--widget` |\n`cannot frobnicate …`\n";
    assert_eq!(undocumented(&[src], reversed).len(), 1);
}

/// The quick start says what `bash .ci/run` installs (every package its scripts may install),
/// how long it takes, and gives a quick test command.
#[test]
fn the_quick_start_names_what_ci_installs_and_a_quick_test() {
    let readme = read(&root().join("README.md"));
    let quick = section(&readme, "## Quick start").join("\n");
    let mut packages = BTreeSet::new();
    let mut scripts: Vec<PathBuf> = fs::read_dir(root().join(".ci"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    scripts.sort();
    for script in &scripts {
        let text = read(script);
        // `pkgs+=(name)` / `missing+=(name)`, and a package named on an apt-get line itself.
        for (at, _) in text.match_indices("+=(") {
            let name = text[at + 3..].split(')').next().unwrap_or("");
            packages.insert(name.to_string());
        }
        for (at, _) in text.match_indices("--no-install-recommends ") {
            let word = text[at + 24..].split_whitespace().next().unwrap_or("");
            if !word.starts_with('"') {
                packages.insert(word.to_string());
            }
        }
        for pip in ["ansible-core", "ansible-lint"] {
            if text.contains(&format!("'{pip}~=")) {
                packages.insert(pip.to_string());
            }
        }
    }
    assert!(
        packages.len() >= 15,
        "too few packages found in .ci/: {packages:?}"
    );
    let missing: Vec<&String> = packages
        .iter()
        .filter(|p| !quick.contains(p.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's quick start does not name what .ci/ may install: {missing:?}"
    );
    // How long CI takes, in minutes (the figure itself follows the last clean-clone run).
    assert!(
        quick.split("about ").skip(1).any(|t| {
            let n = t.split(' ').next().unwrap_or("");
            !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && t[n.len()..].starts_with(" minutes")
        }),
        "{quick}"
    );
    assert!(
        quick.contains("\ncargo test --lib && cargo test --test it -- "),
        "{quick}"
    );
}

/// Every input of an example module (`variable "…"` in examples/*/variables.tf) has its row in
/// the Inputs table of its README.md, and the table lists nothing else.
#[test]
fn the_example_modules_inputs_table_lists_every_variable() {
    for module in ["hetzner", "qemu"] {
        inputs_table_lists_every_variable(module);
    }
}

fn inputs_table_lists_every_variable(module: &str) {
    let tf = read(&root().join(format!("examples/{module}/variables.tf")));
    let declared: BTreeSet<String> = tf
        .lines()
        .filter_map(|l| l.strip_prefix("variable \"")?.split('"').next())
        .map(str::to_string)
        .collect();
    let readme = read(&root().join(format!("examples/{module}/README.md")));
    let table: BTreeSet<String> = section(&readme, "## Inputs")
        .into_iter()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| cells(l).first().cloned())
        .map(|c| c.trim_matches('`').to_string())
        .collect();
    assert!(declared.len() > 10, "{declared:?}");
    assert_eq!(
        table, declared,
        "examples/{module}/README.md's Inputs table and variables.tf disagree"
    );
}

// --- The slot limit -----------------------------------------------------------------------------

/// Where the slot limit is written outside the code, as `{max}` in each file's text (compared
/// with runs of whitespace made one space): the role's preflight and instance list, its argument
/// specification, the READMEs, and `run --help`.
const SLOT_LIMIT_TEXTS: &[(&str, &str)] = &[
    ("role/tasks/preflight.yml", "item.slots | int <= {max}"),
    (
        "role/tasks/preflight.yml",
        "slots is a whole number from 1 to {max};",
    ),
    ("role/vars/main.yml", "[p.slots | int, {max}] | min"),
    (
        "role/meta/argument_specs.yml",
        "Cycles of the pool that may run at once, 1 to {max},",
    ),
    ("role/README.md", "1 to {max}"),
    ("README.md", "1 to {max}"),
    ("run --help", "How many slots the pool has, 1 to {max}"),
];

fn one_spaced(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The places of [`SLOT_LIMIT_TEXTS`] that do not say `max`.
fn slot_limit_mismatches(max: u32) -> Vec<String> {
    let run_help = one_spaced(&help(&["run", "--help"]).expect("`run --help` fails"));
    SLOT_LIMIT_TEXTS
        .iter()
        .filter(|(place, text)| {
            let text = text.replace("{max}", &max.to_string());
            let have = match *place {
                "run --help" => run_help.clone(),
                file => one_spaced(&read(&root().join(file))),
            };
            !have.contains(&one_spaced(&text))
        })
        .map(|(place, text)| format!("{place}: {text}"))
        .collect()
}

// Mutation caught: the role's preflight allowing `slots` up to 65 while MAX_SLOTS is 64.
#[test]
fn the_slot_limit_is_max_slots_wherever_it_is_written() {
    let max = ci_ephemeral_provisioner::core::slots::MAX_SLOTS;
    let bad = slot_limit_mismatches(max);
    assert!(
        bad.is_empty(),
        "core::slots::MAX_SLOTS is {max}; say so (or change it) in:\n{}",
        bad.join("\n")
    );
    // The check bites: against another limit, every place differs.
    assert_eq!(slot_limit_mismatches(max + 1).len(), SLOT_LIMIT_TEXTS.len());
}

// Mutation caught: the role counting 9 watch windows in TimeoutStartSec= while a woken run
// watches up to MAX_WATCH_WINDOWS (10): systemd would kill a run its watch made long.
#[test]
fn the_roles_start_timeout_counts_every_watch_window_of_a_woken_run() {
    let max = ci_ephemeral_provisioner::core::wake::MAX_WATCH_WINDOWS;
    let vars = read(&root().join("role/vars/main.yml"));
    let line = format!("\n_ci_ephemeral_provisioner_watch_windows: {max}\n");
    assert!(
        vars.contains(&line),
        "core::wake::MAX_WATCH_WINDOWS is {max}: role/vars/main.yml must say{line}"
    );
}

// --- From a fresh clone: what the README and --help tell a new operator (#32) -----------------

/// The lines of the first fenced block after `after` in `text`, without their indentation.
fn block_after<'a>(text: &'a str, after: &str) -> Vec<&'a str> {
    let at = text
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} not found"));
    text[at..]
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("```"))
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with("```"))
        .map(str::trim_start)
        .collect()
}

/// Whether `line` holds the parts of `shown` between its `…`, in order, starting with the first.
fn matches_abbreviated(shown: &str, line: &str) -> bool {
    let mut rest = line;
    for (i, part) in shown.split('…').enumerate() {
        let part = part.trim();
        match rest.find(part) {
            Some(at) if i > 0 || at == 0 => rest = &rest[at + part.len()..],
            _ => return false,
        }
    }
    true
}

// Mutation caught (#32, point 1): the README calling `ci-ephemeral-provisioner` with nothing
// that puts it on PATH, or step 3 showing no output (or not the output the command prints).
#[test]
fn the_first_deployment_installs_the_binary_and_shows_what_check_prints() {
    let readme = read(&root().join("README.md"));
    let deploy = section(&readme, "## First deployment").join("\n");
    let install = deploy
        .find("install -m 0755 dist/ci-ephemeral-provisioner /usr/local/bin/")
        .expect("the README never puts the binary on PATH");
    assert!(
        install < deploy.find("ci-ephemeral-provisioner check").unwrap(),
        "the binary is called before it is installed"
    );
    // The command of step 3, run as written (the token file and state directory made here),
    // with no tofu on PATH: what the shown output says of a fresh machine.
    let command: String = block_after(&deploy, "**Check the configuration**")
        .iter()
        .map(|l| l.trim_end_matches('\\'))
        .collect::<Vec<_>>()
        .join(" ");
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("forgejo-token");
    fs::write(&token, "not-a-real-token\n").unwrap();
    fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let state = tmp.path().join("state");
    fs::create_dir(&state).unwrap();
    let args: Vec<String> = command
        .split_whitespace()
        .skip(1)
        .map(|a| match a {
            "./forgejo-token" => token.display().to_string(),
            "\"$(mktemp" | "-d)\"" => String::new(),
            a => a.to_string(),
        })
        .filter(|a| !a.is_empty())
        .collect();
    let mut args = args;
    args.push(state.display().to_string());
    assert_eq!(args[0], "check", "{command}");
    let out = Command::new(BIN)
        .args(&args)
        .current_dir(root())
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    let shown = block_after(&deploy, "two lines fail");
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        shown.len(),
        lines.len(),
        "README:\n{shown:#?}\nprinted:\n{printed}"
    );
    for (s, l) in shown.iter().zip(&lines) {
        assert!(
            matches_abbreviated(s, l),
            "README.md shows\n  {s}\nwhere check prints\n  {l}"
        );
    }
}

#[test]
fn abbreviated_lines_match_only_in_order() {
    assert!(matches_abbreviated("ok    a: … b …", "ok    a: x b y"));
    assert!(!matches_abbreviated("ok    a: … b …", "FAIL  a: x b y"));
    assert!(!matches_abbreviated("a … c … b", "a b c"));
}

// Mutation caught (#32, point 10): the README's `./forgejo-token` shown by `git status`.
#[test]
fn the_token_file_the_readme_writes_into_the_checkout_is_ignored() {
    let readme = read(&root().join("README.md"));
    assert!(readme.contains("--token-file ./forgejo-token"));
    let ignored = Command::new("git")
        .args(["check-ignore", "-q", "forgejo-token"])
        .current_dir(root())
        .status()
        .unwrap();
    assert!(ignored.success(), "git does not ignore ./forgejo-token");
}

/// The file names `--help` gives (a word with a `/` that is not a path from the root, a URL or
/// a placeholder), with the line they are on.
fn relative_paths(help: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for line in help.lines() {
        for word in line.split(|c: char| c.is_whitespace() || "`'\",()[]".contains(c)) {
            let word = word.trim_end_matches(['.', ':', ';']);
            if word.contains('/')
                && !word.starts_with(['/', '$', '-', '<', '.'])
                && !word.contains("://")
                && !word.contains(['<', '{', '='])
                && word.rsplit('/').next().is_some_and(|f| f.contains('.'))
            {
                out.push((word.to_string(), line.to_string()));
            }
        }
    }
    out
}

// Mutation caught (#32, point 5): `--help` suggesting `--fixture fixtures/fresh-cycle.json`, which
// a release does not ship, as if it were there.
#[test]
fn help_names_a_file_of_the_source_only_for_a_checkout() {
    let mut problems = Vec::new();
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["sweep", "--help"],
        &["status", "--help"],
        &["check", "--help"],
    ] {
        let text = help(args).unwrap_or_default();
        let in_checkout = text
            .find("In a checkout of the source")
            .unwrap_or(text.len());
        for (path, line) in relative_paths(&text) {
            let at = text.find(&line).unwrap_or(0);
            if at < in_checkout {
                problems.push(format!("{args:?}: {path} ({line})"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "--help names files a release does not ship:\n{}",
        problems.join("\n")
    );
    // The check sees one.
    let old = "Try `ci-ephemeral-provisioner run --dry-run --fixture fixtures/fresh-cycle.json --labels debian:host`.";
    assert_eq!(relative_paths(old)[0].0, "fixtures/fresh-cycle.json");
}

// Mutation caught (#32, point 12): "with Rust" where Cargo.toml needs a version, or `run --help`
// without examples (or with one whose flags `run` does not have).
#[test]
fn the_readme_names_the_rust_version_and_run_help_ends_with_working_examples() {
    let cargo = read(&root().join("Cargo.toml"));
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cargo.toml has a rust-version");
    let readme = read(&root().join("README.md"));
    let quick = section(&readme, "## Quick start").join("\n");
    assert!(
        quick.contains(&format!("Rust {version} or later")),
        "the quick start does not say Rust {version} or later"
    );
    let text = help(&["run", "--help"]).unwrap();
    let examples = text
        .split("\nExamples:\n")
        .nth(1)
        .expect("`run --help` has no Examples: section");
    let flags = help_flags(&text);
    let check_flags = help_flags(&help(&["check", "--help"]).unwrap());
    let commands: Vec<String> = examples
        .split("\n  ci-ephemeral-provisioner ")
        .skip(1)
        .map(|c| {
            c.lines()
                .take_while(|l| !l.trim_start().starts_with('#'))
                .map(|l| l.trim().trim_end_matches('\\'))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    assert!(commands.len() >= 3, "{examples}");
    for c in &commands {
        let known = if c.starts_with("check ") {
            &check_flags
        } else {
            &flags
        };
        for f in long_flags(c) {
            assert!(
                known.contains(&f),
                "an example has {f}, which it lacks: {c}"
            );
        }
    }
    // The fixture example runs, in a checkout.
    let fixture = commands
        .iter()
        .find(|c| c.contains("--fixture"))
        .expect("an example on a fixture");
    let out = Command::new(BIN)
        .args(fixture.split_whitespace())
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{fixture}: {out:?}");
}

// Mutation caught: first-job.md's QEMU section leaving the reader to guess what of step 5 changes
// (no word of the Hetzner pool it replaces, its FILL IN inputs and secret_environment), or naming
// a pool or file the examples do not have.
#[test]
fn first_jobs_qemu_section_swaps_the_examples_own_pools() {
    let doc = read(&root().join("docs/first-job.md"));
    let qemu = section(&doc, "## The QEMU module").join(" ");
    let main = read(&root().join("examples/ansible/group_vars/ci_provisioners/main.yml"));
    let example = read(&root().join("examples/qemu/README.md"));
    for (said, holds, file) in [
        ("`hetzner`", "  - name: hetzner\n", &main),
        ("`secret_environment`", "    secret_environment:\n", &main),
        ("`FILL IN`", "FILL IN", &main),
        ("`qemu` pool", "- name: qemu\n", &example),
    ] {
        assert!(
            qemu.contains(said),
            "first-job.md's QEMU section does not say {said}:\n{qemu}"
        );
        assert!(file.contains(holds), "the example has no {holds:?}");
    }
    assert!(
        qemu.contains("`group_vars/ci_provisioners/main.yml`"),
        "{qemu}"
    );
}
