//! `--labels`, read once, here, exactly as forgejo-runner reads each of its `--label` values.
//!
//! forgejo-runner (v12, `ppaslan/runner` at `a811c1ac`), `internal/pkg/labels/labels.go`
//! `Parse`: `SplitN(label, ":", 3)` gives the name, the scheme and its argument; a name that
//! starts or ends with a blank (`TrimSpace`) is refused; no scheme means `docker` (image
//! `//node:22-bookworm`); `host` takes no argument, not even an empty one; `lxc` defaults its
//! image (`//debian:bookworm`); `k8spod` and every other scheme (a plugin's) need one. `one-job`
//! takes each `--label` whole (a repeatable `StringArray`, `internal/app/cmd/cmd.go`), does not
//! start on one that `Parse` refuses (`connectionFromArguments`, `internal/app/cmd/args.go`) and
//! declares the names (`Labels.Names()`); Forgejo gives a job to a runner whose names cover its
//! `runs-on` (`ItRunsOn`, `models/actions/run_job.go`, names compared as they are). A `docker`
//! label makes it look for a Docker engine before it declares itself, and fail without one
//! (`configCheck`, `internal/app/cmd/daemon.go`); two labels of one name run its jobs the way the
//! last says (`PickPlatform` keeps one scheme per name).
//!
//! `--labels` is a comma-separated list of such values, each of which the launch command passes
//! as one `--label`. Refused, with the entry and the rule: what forgejo-runner would refuse or
//! read other than it is written, and what this tool cannot serve (a job that runs elsewhere than
//! on the VM: `k8spod`, a plugin's scheme).

use std::fmt;

use crate::core::escape::needs_escape;

/// The image a `docker` label without one runs its jobs in (`labels.ArgDocker`).
pub const DOCKER_DEFAULT_IMAGE: &str = "node:22-bookworm";
/// The image an `lxc` label without one runs its jobs in (`labels.ArgLXC`).
pub const LXC_DEFAULT_IMAGE: &str = "debian:bookworm";

/// How forgejo-runner runs the jobs of a label (the schemes this tool serves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// On the VM itself.
    Host,
    /// In a container of the VM's Docker engine.
    Docker,
    /// In an LXC container on the VM.
    Lxc,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Host => "host",
            Scheme::Docker => "docker",
            Scheme::Lxc => "lxc",
        }
    }
}

/// One entry of `--labels`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    /// What the runner declares and a job's `runs-on` names.
    pub name: String,
    pub scheme: Scheme,
    /// No scheme was written: forgejo-runner's default, `docker`.
    pub implicit: bool,
    /// The image of a `docker` or `lxc` label (its argument without the leading `//`, or the
    /// default); `None` for `host`.
    pub image: Option<String>,
}

impl Label {
    /// `debian (host)`, `ubuntu (docker, no scheme given, image node:22-bookworm)`.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.scheme.as_str().to_string()];
        if self.implicit {
            parts.push("no scheme given".into());
        }
        if let Some(image) = &self.image {
            parts.push(format!("image {image}"));
        }
        format!("{} ({})", self.name, parts.join(", "))
    }

    /// What the VM needs for this label beyond forgejo-runner, if anything.
    pub fn warning(&self) -> Option<String> {
        (self.scheme == Scheme::Docker).then(|| {
            format!(
                "{} is a docker label{}: it needs a Docker engine on the VM (forgejo-runner looks for one before it declares itself and fails without it); {}:host runs its jobs on the VM itself",
                self.name,
                if self.implicit { " (no scheme means docker)" } else { "" },
                self.name
            )
        })
    }
}

/// Why an entry of `--labels` is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `a,,b`, a comma at either end: forgejo-runner would read `""` as a nameless docker label.
    EmptyEntry,
    /// `Parse` refuses it.
    BlankName,
    /// `:host`: `Parse` takes it, and the runner declares the name `""`.
    NoName,
    ControlCharacter,
    /// `debian: host`: forgejo-runner would take ` host` for a plugin's scheme.
    BlankScheme(String),
    /// `debian:` (refused by `Parse`) or `debian::x` (a plugin's scheme `""` to it).
    EmptyScheme,
    /// `x:host:…`: `Parse` refuses it.
    HostArgument,
    /// `x:docker:// node`: an image that is not the one written.
    BlankArgument,
    /// `k8spod` runs jobs in a Kubernetes pod, not on the VM; without an argument `Parse`
    /// refuses it too.
    K8sPod {
        argument: bool,
    },
    /// Any other scheme is a plugin's to forgejo-runner (refused by `Parse` without an argument).
    Plugin {
        scheme: String,
        argument: bool,
    },
    /// The name of an earlier entry (numbered from 1) again.
    Duplicate {
        first: usize,
    },
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SERVED: &str = "this tool serves host, docker and lxc";
        match self {
            Rule::EmptyEntry => write!(
                f,
                "it is empty (a comma too many); forgejo-runner would read it as a docker label without a name"
            ),
            Rule::BlankName => write!(
                f,
                "its name starts or ends with a blank, which forgejo-runner refuses"
            ),
            Rule::NoName => write!(
                f,
                "it has no name before its ':'; the runner would declare an empty name, which no job runs on"
            ),
            Rule::ControlCharacter => write!(f, "it holds a control character"),
            Rule::BlankScheme(s) => write!(
                f,
                "its scheme {s:?} starts or ends with a blank; forgejo-runner would take it for a plugin's scheme"
            ),
            Rule::EmptyScheme => write!(
                f,
                "its scheme after the ':' is empty; write host, docker or lxc (the name alone means docker)"
            ),
            Rule::HostArgument => write!(
                f,
                "the host scheme takes no argument, which forgejo-runner refuses; write NAME:host"
            ),
            Rule::BlankArgument => write!(f, "its argument starts or ends with a blank"),
            Rule::K8sPod { argument } => write!(
                f,
                "the k8spod scheme runs jobs in a Kubernetes pod, not on the VM{}: {SERVED}",
                if *argument {
                    ""
                } else {
                    " (and forgejo-runner refuses it without a pod spec argument)"
                }
            ),
            Rule::Plugin { scheme, argument } => write!(
                f,
                "{scheme:?} is not a scheme this tool serves: forgejo-runner takes it for a plugin's, {}; {SERVED}",
                if *argument {
                    "run by a plugin of its config file, which the launch command does not give it"
                } else {
                    "which needs an argument (NAME:SCHEME://…), so it refuses this one"
                }
            ),
            Rule::Duplicate { first } => write!(
                f,
                "it names the label of entry {first} again; forgejo-runner runs its jobs the way the last one says"
            ),
        }
    }
}

/// An entry of `--labels` that is refused: which one (numbered from 1), as written, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelError {
    pub position: usize,
    pub entry: String,
    pub rule: Rule,
}

impl fmt::Display for LabelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `{:?}`: the blanks show, a control character is escaped.
        write!(
            f,
            "--labels entry {} ({:?}): {}",
            self.position, self.entry, self.rule
        )
    }
}

impl std::error::Error for LabelError {}

/// The labels of a pool: at least one, each as forgejo-runner reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Labels {
    /// `--labels` as given (`RUNNER_LABELS`).
    given: String,
    labels: Vec<Label>,
}

impl Labels {
    /// Parses `--labels`. `Ok(None)`: there is none (the flag is empty).
    pub fn parse(list: &str) -> Result<Option<Labels>, LabelError> {
        if list.is_empty() {
            return Ok(None);
        }
        let mut labels: Vec<Label> = Vec::new();
        for (i, entry) in list.split(',').enumerate() {
            let err = |rule| LabelError {
                position: i + 1,
                entry: entry.to_string(),
                rule,
            };
            let label = parse_entry(entry).map_err(err)?;
            if let Some(first) = labels.iter().position(|l| l.name == label.name) {
                return Err(err(Rule::Duplicate { first: first + 1 }));
            }
            labels.push(label);
        }
        Ok(Some(Labels {
            given: list.to_string(),
            labels,
        }))
    }

    /// `--labels` as given: what the launch command gets as `RUNNER_LABELS`.
    pub fn given(&self) -> &str {
        &self.given
    }

    pub fn iter(&self) -> impl Iterator<Item = &Label> {
        self.labels.iter()
    }

    /// The names the runner declares, in order.
    pub fn names(&self) -> Vec<String> {
        self.labels.iter().map(|l| l.name.clone()).collect()
    }

    /// Each label, as [`Label::describe`] shows it, comma-separated.
    pub fn describe(&self) -> String {
        self.labels
            .iter()
            .map(Label::describe)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// One entry, by `Parse`'s steps, refusing more than it does (see [`Rule`]).
fn parse_entry(entry: &str) -> Result<Label, Rule> {
    if entry.is_empty() {
        return Err(Rule::EmptyEntry);
    }
    let mut parts = entry.splitn(3, ':');
    let name = parts.next().unwrap_or_default();
    let scheme = parts.next();
    let argument = parts.next();
    if name.trim() != name {
        return Err(Rule::BlankName);
    }
    if name.is_empty() {
        return Err(Rule::NoName);
    }
    if entry.chars().any(needs_escape) {
        return Err(Rule::ControlCharacter);
    }
    let (scheme, implicit) = match scheme {
        None => ("docker", true),
        Some(s) if s.trim() != s => return Err(Rule::BlankScheme(s.to_string())),
        Some("") => return Err(Rule::EmptyScheme),
        Some(s) => (s, false),
    };
    if scheme == "host" && argument.is_some() {
        return Err(Rule::HostArgument);
    }
    let argument = argument.unwrap_or_default();
    if argument.trim() != argument {
        return Err(Rule::BlankArgument);
    }
    // `PickPlatform` drops one leading `//` of a docker or lxc argument.
    let image = |default: &str| {
        Some(match argument {
            "" => default.to_string(),
            a => a.strip_prefix("//").unwrap_or(a).to_string(),
        })
    };
    let (scheme, image) = match scheme {
        "host" => (Scheme::Host, None),
        "docker" => (Scheme::Docker, image(DOCKER_DEFAULT_IMAGE)),
        "lxc" => (Scheme::Lxc, image(LXC_DEFAULT_IMAGE)),
        "k8spod" => {
            return Err(Rule::K8sPod {
                argument: !argument.is_empty(),
            });
        }
        other => {
            return Err(Rule::Plugin {
                scheme: other.to_string(),
                argument: !argument.is_empty(),
            });
        }
    };
    Ok(Label {
        name: name.to_string(),
        scheme,
        implicit,
        image,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(entry: &str) -> Result<Label, Rule> {
        Labels::parse(entry)
            .map(|l| l.unwrap().labels[0].clone())
            .map_err(|e| e.rule)
    }

    #[test]
    fn each_scheme_reads_as_forgejo_runner_reads_it() {
        let l = one("debian:host").unwrap();
        assert_eq!(
            (l.name.as_str(), l.scheme, l.implicit),
            ("debian", Scheme::Host, false)
        );
        assert_eq!(l.image, None);
        let l = one("ubuntu").unwrap();
        assert_eq!((l.scheme, l.implicit), (Scheme::Docker, true));
        assert_eq!(l.image.as_deref(), Some(DOCKER_DEFAULT_IMAGE));
        assert_eq!(
            one("u:docker").unwrap().image.as_deref(),
            Some(DOCKER_DEFAULT_IMAGE)
        );
        assert_eq!(
            one("u:docker:").unwrap().image.as_deref(),
            Some(DOCKER_DEFAULT_IMAGE)
        );
        assert_eq!(
            one("u:docker://node:22").unwrap().image.as_deref(),
            Some("node:22")
        );
        assert_eq!(
            one("u:docker:node:22").unwrap().image.as_deref(),
            Some("node:22")
        );
        assert_eq!(
            one("c:lxc").unwrap().image.as_deref(),
            Some(LXC_DEFAULT_IMAGE)
        );
        assert_eq!(
            one("c:lxc://debian:trixie").unwrap().image.as_deref(),
            Some("debian:trixie")
        );
        // A blank inside a name is a name (forgejo-runner trims only the ends).
        assert_eq!(one("big box:host").unwrap().name, "big box");
    }

    // Mutation caught: core::labels takes a plugin's scheme as host.
    #[test]
    fn what_forgejo_runner_refuses_or_misreads_is_refused_with_its_rule() {
        for (entry, rule) in [
            (" debian:host", Rule::BlankName),
            ("debian :host", Rule::BlankName),
            ("\u{a0}debian", Rule::BlankName),
            (":host", Rule::NoName),
            ("de\u{1b}bian:host", Rule::ControlCharacter),
            ("debian: host", Rule::BlankScheme(" host".into())),
            ("debian:host ", Rule::BlankScheme("host ".into())),
            ("debian:", Rule::EmptyScheme),
            ("debian::x", Rule::EmptyScheme),
            ("x:host:foo", Rule::HostArgument),
            ("x:host:", Rule::HostArgument),
            ("x:docker://node:22 ", Rule::BlankArgument),
            ("x:k8spod", Rule::K8sPod { argument: false }),
            ("x:k8spod://pod.yaml", Rule::K8sPod { argument: true }),
            (
                "x:hots",
                Rule::Plugin {
                    scheme: "hots".into(),
                    argument: false,
                },
            ),
            (
                "x:myplugin://cfg",
                Rule::Plugin {
                    scheme: "myplugin".into(),
                    argument: true,
                },
            ),
        ] {
            assert_eq!(one(entry), Err(rule), "{entry:?}");
        }
    }

    // Mutation caught: core::labels without the check for a name given twice.
    #[test]
    fn the_list_is_refused_at_its_first_bad_entry_which_the_error_names() {
        let e = Labels::parse(" debian:host , docker ,,").unwrap_err();
        assert_eq!((e.position, e.rule.clone()), (1, Rule::BlankName));
        assert!(
            e.to_string().starts_with(
                "--labels entry 1 (\" debian:host \"): its name starts or ends with a blank"
            ),
            "{e}"
        );
        let e = Labels::parse("debian:host,,gpu:host").unwrap_err();
        assert_eq!(
            (e.position, e.entry.as_str(), e.rule),
            (2, "", Rule::EmptyEntry)
        );
        let e = Labels::parse("debian:host,").unwrap_err();
        assert_eq!((e.position, e.rule), (2, Rule::EmptyEntry));
        let e = Labels::parse("debian:host,gpu:host,debian:docker").unwrap_err();
        assert_eq!((e.position, e.rule), (3, Rule::Duplicate { first: 1 }));
        assert_eq!(Labels::parse(""), Ok(None));
    }

    #[test]
    fn names_describe_and_warnings() {
        let l = Labels::parse("debian:host,ubuntu,arm64:docker://node:22,c:lxc")
            .unwrap()
            .unwrap();
        assert_eq!(l.names(), ["debian", "ubuntu", "arm64", "c"]);
        assert_eq!(l.given(), "debian:host,ubuntu,arm64:docker://node:22,c:lxc");
        assert_eq!(
            l.describe(),
            "debian (host), ubuntu (docker, no scheme given, image node:22-bookworm), arm64 (docker, image node:22), c (lxc, image debian:bookworm)"
        );
        let warned: Vec<String> = l.iter().filter_map(Label::warning).collect();
        assert_eq!(warned.len(), 2, "{warned:?}");
        assert!(
            warned[0].starts_with(
                "ubuntu is a docker label (no scheme means docker): it needs a Docker engine on the VM"
            ),
            "{warned:?}"
        );
        assert!(
            warned[1].starts_with("arm64 is a docker label: it needs"),
            "{warned:?}"
        );
    }
}
