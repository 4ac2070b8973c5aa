//! The launch command: starts one runner on the VM, with the runner token on its stdin.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::anyhow;
use serde_json::Value;

use crate::adapters::process::{ChildSpec, run_child};
use crate::adapters::signals::StopFlag;
use crate::core::ports::{
    CHECK_GONE, LaunchRequest, Launcher, Outputs, ProbeRequest, ProcessCheck, StepError,
};
use crate::core::secret::Secret;

/// `TOFU_OUTPUT_<NAME>` variables: strings as they are, everything else as compact JSON.
pub fn output_env(outputs: &Outputs) -> Vec<(String, String)> {
    outputs
        .iter()
        .map(|(name, o)| {
            let key = format!(
                "TOFU_OUTPUT_{}",
                name.chars()
                    .map(|c| if c.is_ascii_alphanumeric() {
                        c.to_ascii_uppercase()
                    } else {
                        '_'
                    })
                    .collect::<String>()
            );
            let value = match &o.value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (key, value)
        })
        .collect()
}

/// The environment of the launch command (never the token).
pub fn launch_env(req: &LaunchRequest<'_>) -> Vec<(String, String)> {
    let mut env = vec![
        ("RUNNER_ID".to_string(), req.runner_id.to_string()),
        ("RUNNER_UUID".to_string(), req.runner_uuid.to_string()),
        ("RUNNER_NAME".to_string(), req.runner_name.to_string()),
        ("RUNNER_LABELS".to_string(), req.labels.to_string()),
        ("FORGEJO_URL".to_string(), req.forgejo_url.to_string()),
        ("JOB_ID".to_string(), req.job_id.to_string()),
        ("JOB_HANDLE".to_string(), req.job_handle.to_string()),
    ];
    env.extend(output_env(req.outputs));
    env
}

pub struct CommandLauncher {
    pub command: Option<PathBuf>,
    pub timeout: Duration,
    pub stop: StopFlag,
}

impl Launcher for CommandLauncher {
    fn check_config(&self) -> anyhow::Result<()> {
        match &self.command {
            None => Err(anyhow!(
                "--launch-command is not set; it names the program that starts a runner on the VM"
            )),
            Some(p) if crate::adapters::process::find_executable(p).is_none() => Err(anyhow!(
                "--launch-command {} is not an executable file (missing, or `chmod +x` it)",
                p.display()
            )),
            Some(_) => Ok(()),
        }
    }

    fn launch(&mut self, req: &LaunchRequest<'_>, token: &Secret) -> Result<(), StepError> {
        // The planner never registers for such a job (`Job::has_handle`); should one get here,
        // no runner starts that would take any job of its labels (`one-job --handle ""`).
        if req.job_handle.is_empty() {
            return Err(StepError::failed(format!(
                "internal error: refusing to start runner {} ({}) with an empty JOB_HANDLE: forgejo-runner one-job --handle \"\" would take any job of its labels, not job {}",
                req.runner_id, req.runner_name, req.job_id
            )));
        }
        let (program, spec) = self.spec(req, "start", Some(token))?;
        log::info!(
            "launching runner {} ({}) for job {} with {}",
            req.runner_id,
            req.runner_name,
            req.job_id,
            program.display()
        );
        let r = run_child(&spec, &self.stop).map_err(|e| {
            StepError::failed(format!(
                "cannot run launch command {}: {e}",
                program.display()
            ))
        })?;
        // A launch that finished counts as done, even if a stop came meanwhile.
        if r.success() {
            return Ok(());
        }
        if r.interrupted {
            return Err(StepError {
                message: format!(
                    "launch command {} was interrupted by a stop request ({})",
                    program.display(),
                    r.describe()
                ),
                interrupted: true,
            });
        }
        if !r.success() {
            return Err(StepError::failed(format!(
                "launch command {} {}",
                program.display(),
                r.describe()
            )));
        }
        Ok(())
    }

    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
        let unknown = |why: String, interrupted: bool| ProcessCheck::Unknown { why, interrupted };
        let (program, spec) = match self.spec(req, "check", None) {
            Ok(x) => x,
            Err(e) => return unknown(e.message, false),
        };
        log::info!(
            "checking whether the process of runner {} ({}) is gone",
            req.runner_id,
            req.runner_name
        );
        match run_child(&spec, &self.stop) {
            Err(e) => unknown(format!("cannot run {}: {e}", program.display()), false),
            Ok(r) if r.interrupted => unknown(
                format!("RUNNER_ACTION=check was interrupted ({})", r.describe()),
                true,
            ),
            Ok(r) if r.success() => ProcessCheck::Running,
            Ok(r) if r.timed_out.is_none() && r.status.code() == Some(CHECK_GONE) => {
                ProcessCheck::Gone
            }
            Ok(r) => unknown(
                format!(
                    "RUNNER_ACTION=check of {} {} (0 means it runs, 3 that it is gone)",
                    program.display(),
                    r.describe()
                ),
                false,
            ),
        }
    }

    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), StepError> {
        let (program, spec) = self.spec(req, "stop", None)?;
        log::info!(
            "stopping the process of runner {} ({})",
            req.runner_id,
            req.runner_name
        );
        let r = run_child(&spec, &self.stop)
            .map_err(|e| StepError::failed(format!("cannot run {}: {e}", program.display())))?;
        if r.success() {
            return Ok(());
        }
        Err(StepError {
            message: format!(
                "RUNNER_ACTION=stop of {} {}",
                program.display(),
                r.describe()
            ),
            interrupted: r.interrupted,
        })
    }

    fn probe(&mut self, req: &ProbeRequest<'_>) -> Result<String, StepError> {
        let (program, spec) = self.probe_spec(req)?;
        log::info!(
            "probing the VM with {} (RUNNER_ACTION=probe)",
            program.display()
        );
        let r = run_child(&spec, &self.stop)
            .map_err(|e| StepError::failed(format!("cannot run {}: {e}", program.display())))?;
        if !r.success() {
            return Err(StepError {
                message: format!(
                    "RUNNER_ACTION=probe of {} {}",
                    program.display(),
                    r.describe()
                ),
                interrupted: r.interrupted,
            });
        }
        // The last line it printed: forgejo-runner's `--version` line.
        let stdout = String::from_utf8_lossy(&r.stdout);
        match stdout.lines().map(str::trim).rfind(|l| !l.is_empty()) {
            Some(line) => Ok(line.to_string()),
            None => Err(StepError::failed(format!(
                "RUNNER_ACTION=probe of {} exited 0 but printed nothing on stdout; it must print forgejo-runner's --version line there",
                program.display()
            ))),
        }
    }
}

impl CommandLauncher {
    /// `RUNNER_ACTION=probe`'s environment: the VM's outputs, the labels and Forgejo's URL, and
    /// no runner (no `RUNNER_*` of one, no `JOB_*`, nothing on stdin).
    fn probe_spec(&self, req: &ProbeRequest<'_>) -> Result<(PathBuf, ChildSpec), StepError> {
        let program = self
            .command
            .clone()
            .ok_or_else(|| StepError::failed("--launch-command is not set"))?;
        let mut env = vec![
            ("RUNNER_ACTION".to_string(), "probe".to_string()),
            ("RUNNER_LABELS".to_string(), req.labels.to_string()),
            ("FORGEJO_URL".to_string(), req.forgejo_url.to_string()),
            (
                "LAUNCH_TIMEOUT_SECONDS".to_string(),
                self.timeout.as_secs().max(1).to_string(),
            ),
        ];
        env.extend(output_env(req.outputs));
        let spec = ChildSpec {
            program: program.clone(),
            args: vec![],
            env,
            stdin: None,
            timeout: Some(self.timeout),
            database: false,
        };
        Ok((program, spec))
    }

    /// The launch command for `action`, with the registration's environment; the token on
    /// stdin only for `start` (check and stop get nothing).
    fn spec(
        &self,
        req: &LaunchRequest<'_>,
        action: &str,
        token: Option<&Secret>,
    ) -> Result<(PathBuf, ChildSpec), StepError> {
        let program = self
            .command
            .clone()
            .ok_or_else(|| StepError::failed("--launch-command is not set"))?;
        let mut env = launch_env(req);
        env.push(("RUNNER_ACTION".to_string(), action.to_string()));
        // `--launch-timeout` in whole seconds (at least 1): what a launch that waits for the VM
        // to answer may spend before it is killed.
        env.push((
            "LAUNCH_TIMEOUT_SECONDS".to_string(),
            self.timeout.as_secs().max(1).to_string(),
        ));
        let spec = ChildSpec {
            program: program.clone(),
            args: vec![],
            env,
            stdin: token.cloned(),
            timeout: Some(self.timeout),
            database: false,
        };
        Ok((program, spec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ports::Output;

    #[test]
    fn a_runner_is_never_started_with_an_empty_job_handle() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("started");
        let cmd = dir.path().join("launch.sh");
        std::fs::write(
            &cmd,
            format!("#!/bin/sh\ncat > /dev/null\ntouch '{}'\n", marker.display()),
        )
        .unwrap();
        std::fs::set_permissions(&cmd, std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut launcher = CommandLauncher {
            command: Some(cmd),
            timeout: Duration::from_secs(10),
            stop: StopFlag::new(),
        };
        let outputs = Outputs::new();
        let req = |handle| LaunchRequest {
            runner_id: 7,
            runner_uuid: "u",
            runner_name: "ephemeral-c-1",
            job_id: 9,
            job_handle: handle,
            labels: "debian:host",
            forgejo_url: "https://forgejo.invalid",
            outputs: &outputs,
        };
        let token = Secret::new("t".into());
        let e = launcher.launch(&req(""), &token).unwrap_err();
        assert!(e.message.contains("empty JOB_HANDLE"), "{}", e.message);
        assert!(!marker.exists(), "the launch command ran");
        // The control: with a handle it runs.
        launcher.launch(&req("h-9"), &token).unwrap();
        assert!(marker.exists());
    }

    #[test]
    fn outputs_become_env() {
        let mut o = Outputs::new();
        o.insert(
            "address".into(),
            Output {
                sensitive: false,
                value: Value::String("10.0.0.1".into()),
            },
        );
        o.insert(
            "ports".into(),
            Output {
                sensitive: false,
                value: serde_json::json!([22, 80]),
            },
        );
        o.insert(
            "ssh-user".into(),
            Output {
                sensitive: true,
                value: Value::String("ci".into()),
            },
        );
        let env = output_env(&o);
        assert!(env.contains(&("TOFU_OUTPUT_ADDRESS".into(), "10.0.0.1".into())));
        assert!(env.contains(&("TOFU_OUTPUT_PORTS".into(), "[22,80]".into())));
        assert!(env.contains(&("TOFU_OUTPUT_SSH_USER".into(), "ci".into())));
    }
}
