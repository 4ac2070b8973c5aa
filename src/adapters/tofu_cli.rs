//! OpenTofu (or the CLI-compatible terraform) behind a small trait.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};
use serde_json::Value;

use crate::adapters::process::{ChildSpec, run_child};
use crate::adapters::signals::StopFlag;
use crate::core::ports::{Output, Outputs, StepError, Tofu};

pub fn parse_outputs(stdout: &[u8]) -> anyhow::Result<Outputs> {
    // Never quote the text: sensitive outputs are printed in plain text by tofu.
    let v: Value = serde_json::from_slice(stdout)
        .map_err(|e| anyhow!("`output -json` did not print JSON ({e})"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| anyhow!("`output -json` did not print a JSON object"))?;
    let mut outputs = Outputs::new();
    for (name, entry) in obj {
        let sensitive = entry
            .get("sensitive")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let value = entry.get("value").cloned().unwrap_or(Value::Null);
        outputs.insert(name.clone(), Output { sensitive, value });
    }
    Ok(outputs)
}

/// A tofu left running by a run that was killed outside systemd still holds the state lock;
/// waiting for it converges where failing at once would tear the VM down.
const LOCK_TIMEOUT: &str = "-lock-timeout=2m";

/// A slot's own tofu data directory (`TF_DATA_DIR`) inside its state directory: the slots of a
/// pool share the module directory, and each must init and select its workspace alone.
pub const TOFU_DATA_DIR: &str = "tofu-data";

/// How tofu runs `args` on the module in `module`: `-chdir` into it, unattended (no prompts, no
/// input), with `TF_VAR_cycle_id`. No stdin, no time limit; callers add to the environment
/// (a slot's workspace and data directory, `check`'s own data directory) and may set one.
pub fn invocation(bin: &Path, module: &Path, cycle_id: &str, args: &[&str]) -> ChildSpec {
    let mut all = vec![format!("-chdir={}", module.display())];
    all.extend(args.iter().map(|a| a.to_string()));
    ChildSpec {
        program: bin.to_path_buf(),
        args: all.into_iter().map(Into::into).collect(),
        env: vec![
            ("TF_IN_AUTOMATION".into(), "1".into()),
            ("TF_INPUT".into(), "0".into()),
            ("TF_VAR_cycle_id".into(), cycle_id.into()),
        ],
        stdin: None,
        timeout: None,
        database: true,
    }
}

/// One state `tofu show -json` printed, with its workspace when it is a cycle's (`--store pg`).
pub type ShownState = (Option<String>, Vec<u8>);

pub struct CliTofu {
    pub bin: PathBuf,
    pub dir: Option<PathBuf>,
    /// The pool's slot this tofu serves: `TF_VAR_slot`; slot K ≥ 2 runs in the workspace
    /// `slot-K`, slot 1 in the default one.
    pub slot: u32,
    /// The pool has more than one slot: slot 1 names its workspace too (`TF_WORKSPACE=default`),
    /// so that a workspace selected by hand (`tofu workspace select slot-2`) can never make it
    /// act on another slot's VM.
    pub pinned: bool,
    /// `TF_DATA_DIR` for slot K ≥ 2; slot 1 keeps the module directory's own `.terraform`.
    pub data_dir: Option<PathBuf>,
    /// `--store pg`: the pool, whose cycles each have a workspace of their own,
    /// `POOL-CYCLE_ID` (`core::pool::workspace`), that any host of the pool can address.
    pub pool: Option<String>,
    /// How long each tofu command may run before it is killed: none for a cycle's (an apply
    /// takes what the module takes; a stop request ends it), a bound for a read that must not
    /// hang its caller on a backend that does not answer (`status --remote`).
    pub timeout: Option<std::time::Duration>,
    pub stop: StopFlag,
}

/// How often an apply or destroy is tried while another host creates a workspace (the pg
/// backend's creation lock) or the backend's schema.
const CREATION_TRIES: u32 = 6;

/// What tofu's pg backend prints when another host creates a workspace (its lock on key -1) or
/// its schema at the same moment: tried again after a pause.
fn creation_race(message: &str) -> bool {
    message.contains("locked for workspace creation")
        || message.contains("duplicate key value violates unique constraint")
}

impl CliTofu {
    /// `init` before every apply and destroy: idempotent and quick when nothing changed, and the
    /// only way to recover from an interrupted init or a module that changed since the last one.
    /// With a workspace per cycle it runs in `default` (which the pg backend always lists): an
    /// init naming a workspace that does not exist yet fails once the schema holds any other.
    fn init(&self, cycle_id: &str) -> Result<(), StepError> {
        self.run_in(
            cycle_id,
            self.pool.as_ref().map(|_| "default"),
            &["init", "-input=false", "-no-color"],
        )
        .map(|_| ())
    }

    /// `init`, then `apply` or `destroy`, unattended. With a workspace per cycle, the apply or
    /// destroy creates the cycle's workspace when it has none (taking the backend's creation
    /// lock: tried again while another host holds it), and a destroy that worked deletes it.
    fn change(&self, cycle_id: &str, verb: &str) -> Result<(), StepError> {
        let args = [
            verb,
            "-input=false",
            "-auto-approve",
            "-no-color",
            LOCK_TIMEOUT,
        ];
        let mut tries = 0;
        loop {
            tries += 1;
            let r = self.init(cycle_id).and_then(|()| self.run(cycle_id, &args));
            match r {
                Err(e) if !e.interrupted && tries < CREATION_TRIES && creation_race(&e.message) => {
                    log::warn!(
                        "{}; another host is creating a workspace or the backend's schema: trying again",
                        e.message
                    );
                    std::thread::sleep(std::time::Duration::from_millis(500 * u64::from(tries)));
                }
                Err(e) => return Err(e),
                Ok(_) => break,
            }
        }
        if verb == "destroy"
            && let Some(pool) = &self.pool
        {
            let ws = crate::core::pool::workspace(pool, cycle_id);
            self.run_in(cycle_id, Some("default"), &["workspace", "delete", "-no-color", &ws])
                .map_err(|e| StepError {
                    message: format!(
                        "the VM is destroyed, but deleting its empty workspace {ws} failed: {}; the next run tries again",
                        e.message
                    ),
                    interrupted: e.interrupted,
                })?;
        }
        Ok(())
    }

    /// `tofu show -json` of the states this tofu serves, each with its workspace: it reads and
    /// changes nothing (no init, no lock, no refresh). For `status --remote`. A slot's own
    /// state (none while slot K >= 2 has no workspace yet: there `show` would create it,
    /// `terraform.tfstate.d/slot-K`, as whoever runs `status`), or with `--store pg` the
    /// workspace of each cycle of the pool, whichever host made it. `workspace list`, which
    /// only reads, is asked first.
    pub fn show_states(&self) -> Result<Vec<ShownState>, StepError> {
        let listed = |tofu: &CliTofu, workspace: Option<&str>| {
            tofu.run_in("status", workspace, &["workspace", "list"])
                .map(|out| {
                    String::from_utf8_lossy(&out)
                        .lines()
                        .map(|l| l.trim_start_matches(['*', ' ']).trim_end().to_string())
                        .filter(|l| !l.is_empty())
                        .collect::<Vec<String>>()
                })
        };
        let show = ["show", "-json", "-no-color"];
        if let Some(pool) = &self.pool {
            let mut out = Vec::new();
            for ws in listed(self, Some("default"))? {
                if crate::core::pool::cycle_of_workspace(pool, &ws).is_some() {
                    let json = self.run_in("status", Some(&ws), &show)?;
                    out.push((Some(ws), json));
                }
            }
            return Ok(out);
        }
        if let Some(workspace) = crate::core::slots::slot_dir_name(self.slot)
            && !listed(self, None)?.contains(&workspace)
        {
            return Ok(Vec::new());
        }
        Ok(vec![(None, self.run("status", &show)?)])
    }

    fn dir(&self) -> Result<&Path, StepError> {
        self.dir.as_deref().ok_or_else(|| {
            StepError::failed("--tofu-dir is not set; it names the directory of the VM module")
        })
    }

    /// What this slot adds to tofu's environment: `TF_VAR_slot`, its workspace (`workspace`, or
    /// the cycle's, or the slot's), and (slot K ≥ 2) its own data directory.
    fn slot_env(&self, cycle_id: &str, workspace: Option<&str>) -> Vec<(String, String)> {
        let mut env = vec![("TF_VAR_slot".into(), self.slot.to_string())];
        match (
            workspace,
            &self.pool,
            crate::core::slots::slot_dir_name(self.slot),
        ) {
            (Some(w), _, _) => env.push(("TF_WORKSPACE".into(), w.to_string())),
            (None, Some(pool), _) => env.push((
                "TF_WORKSPACE".into(),
                crate::core::pool::workspace(pool, cycle_id),
            )),
            (None, None, Some(workspace)) => env.push(("TF_WORKSPACE".into(), workspace)),
            (None, None, None) if self.pinned => {
                env.push(("TF_WORKSPACE".into(), "default".into()))
            }
            (None, None, None) => {}
        }
        if let Some(d) = &self.data_dir {
            env.push(("TF_DATA_DIR".into(), d.display().to_string()));
            // A plugin cache is not safe for concurrent inits (terraform says so), and slot 1 may
            // init next to this one: this slot keeps its providers in its own data directory.
            // (Empty means no cache from the environment.)
            env.push(("TF_PLUGIN_CACHE_DIR".into(), String::new()));
        }
        env
    }

    fn run(&self, cycle_id: &str, args: &[&str]) -> Result<Vec<u8>, StepError> {
        self.run_in(cycle_id, None, args)
    }

    /// `run` in the workspace `workspace` (else the cycle's or the slot's).
    fn run_in(
        &self,
        cycle_id: &str,
        workspace: Option<&str>,
        args: &[&str],
    ) -> Result<Vec<u8>, StepError> {
        let dir = self.dir()?;
        let mut spec = invocation(&self.bin, dir, cycle_id, args);
        spec.env.extend(self.slot_env(cycle_id, workspace));
        spec.timeout = self.timeout;
        let shown = format!(
            "{} {}",
            self.bin.display(),
            spec.args
                .iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        );
        log::info!("running {shown}");
        let r = run_child(&spec, &self.stop).map_err(|e| {
            StepError::failed(format!(
                "cannot run {}: {e} (is --tofu-bin right and installed?)",
                self.bin.display()
            ))
        })?;
        // A child that finished its work counts as done, even if a stop came meanwhile.
        if r.success() {
            return Ok(r.stdout);
        }
        if r.interrupted {
            return Err(StepError {
                message: format!(
                    "`{shown}` was interrupted by a stop request ({})",
                    r.describe()
                ),
                interrupted: true,
            });
        }
        Err(StepError::failed(format!("`{shown}` {}", r.describe())))
    }
}

/// Whether `dir` holds a configuration file of tofu's (`*.tf`, `*.tofu`, or their `.json`
/// forms). An unreadable directory counts as holding one: tofu then says what is wrong with it.
fn has_configuration(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return true;
    };
    entries.filter_map(Result::ok).any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        [".tf", ".tofu", ".tf.json", ".tofu.json"]
            .iter()
            .any(|ext| name.ends_with(ext))
    })
}

impl Tofu for CliTofu {
    fn check_config(&self) -> anyhow::Result<()> {
        if crate::adapters::process::find_executable(&self.bin).is_none() {
            bail!(
                "--tofu-bin {} is not an executable (nor found on PATH); install OpenTofu or point --tofu-bin at it (terraform works too)",
                self.bin.display()
            );
        }
        match &self.dir {
            None => Err(anyhow!(
                "--tofu-dir is not set; it names the directory of the VM module"
            )),
            Some(d) if !d.is_dir() => Err(anyhow!(
                "--tofu-dir {} is not a directory; point it at the VM module",
                d.display()
            )),
            Some(d) if !has_configuration(d) => Err(anyhow!(
                "--tofu-dir {} holds no .tf file: tofu would apply an empty module, which makes no VM; point it at the VM module (e.g. examples/hetzner)",
                d.display()
            )),
            Some(_) => Ok(()),
        }
    }

    fn apply(&mut self, cycle_id: &str) -> Result<(), StepError> {
        self.change(cycle_id, "apply")
    }

    fn outputs(&mut self, cycle_id: &str) -> Result<Outputs, StepError> {
        let stdout = self.run(cycle_id, &["output", "-json", "-no-color"])?;
        parse_outputs(&stdout).map_err(|e| StepError::failed(format!("{e:#}")))
    }

    fn destroy(&mut self, cycle_id: &str, reason: &str) -> Result<(), StepError> {
        log::info!("tearing down the VM of cycle {cycle_id}: {reason}");
        self.change(cycle_id, "destroy")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    // Mutation caught: the tofu command run without its bound (a backend that never answers
    // hangs the caller), or the failure not saying the bound.
    #[test]
    fn a_tofu_command_past_its_bound_is_killed_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("tofu");
        std::fs::write(&bin, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let tofu = CliTofu {
            bin,
            dir: Some(dir.path().to_path_buf()),
            slot: 1,
            pinned: false,
            data_dir: None,
            pool: None,
            timeout: Some(Duration::from_millis(300)),
            stop: StopFlag::new(),
        };
        let e = tofu.show_states().unwrap_err();
        assert!(!e.interrupted, "{e:?}");
        assert!(
            e.message
                .contains("show -json -no-color` timed out after 300ms and was killed"),
            "{e:?}"
        );
    }

    #[test]
    fn outputs_keep_sensitivity() {
        let o = parse_outputs(
            br#"{"address":{"sensitive":false,"type":"string","value":"10.0.0.1"},
                 "key":{"sensitive":true,"type":"string","value":"s3cr3t"}}"#,
        )
        .unwrap();
        assert_eq!(o["address"].value, Value::String("10.0.0.1".into()));
        assert!(o["key"].sensitive);
        assert!(parse_outputs(b"{}").unwrap().is_empty());
        let e = parse_outputs(b"{\"key\": s3cr3t").unwrap_err().to_string();
        assert!(!e.contains("s3cr3t"));
    }
}
