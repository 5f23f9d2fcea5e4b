//! The command line of `ductile`.

use crate::bind::BindTo;
use crate::controller::{JobSpec, OnFailure};
use crate::layout;
use crate::plan::resize::Target;
use crate::plan::spawn::{Method, Strategy};
use crate::policy::{Bounds, PolicySpec};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Most seconds an option of seconds takes: a year (deadlines computed from it stay
/// far from the clock's limits).
pub const MAX_SECS: u64 = 366 * 24 * 3600;

/// ductile: run malleable parallel programs.
#[derive(Debug, Parser)]
#[command(name = "ductile", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a parallel job on simulated local nodes.
    Run(Box<RunArgs>),
    /// Ask a running job to grow or shrink at its next checkpoint.
    Resize(ResizeArgs),
    /// Show where a running job's processes are: its nodes, ranks and pids.
    Status(StatusArgs),
    /// Internal: the node agent started by `ductile run`.
    #[command(hide = true)]
    Agent(AgentArgs),
}

/// Arguments of the (internal) `ductile agent`.
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Started through a remote shell: the channel to whoever started it is stdin and
    /// stdout, not an inherited descriptor.
    #[arg(long)]
    pub stdio: bool,
    /// The log filter (`DUCTILE_LOG` of `ductile run`, for an agent on another host).
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,
}

/// Arguments of `ductile run`.
#[derive(Debug, clap::Args)]
#[command(trailing_var_arg = true)]
pub struct RunArgs {
    /// Number of ranks (processes).
    #[arg(short = 'n', long = "np", value_name = "NPROCS")]
    pub n: Option<u32>,
    /// Number of nodes to start on (simulated local nodes, or the first hosts of
    /// --hosts/--hostfile).
    #[arg(long)]
    pub nodes: Option<u32>,
    /// Hosts the job runs on, one node each: `NAME` or `NAME:SLOTS`, comma-separated
    /// (a host without a count has --slots slots, else 1). Without it, or --hostfile,
    /// nodes are simulated on this host.
    #[arg(long, value_name = "HOSTS", conflicts_with = "hostfile")]
    pub hosts: Option<String>,
    /// A file of hosts: one per line, `NAME [slots=N]` (or `NAME:N`), `#` comments; a
    /// name repeated adds slots (as in a PBS node file).
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Run on the hosts of the Slurm allocation `ductile run` is in (SLURM_JOB_NODELIST,
    /// slots from SLURM_TASKS_PER_NODE), starting agents with `srun` unless --rsh or
    /// DUCTILE_RSH names another remote shell.
    #[arg(long, conflicts_with_all = ["hosts", "hostfile"])]
    pub slurm: bool,
    /// The remote shell that starts node agents on other hosts: the words before the
    /// host name (default: DUCTILE_RSH, then `ssh -T -o BatchMode=yes -o ConnectTimeout=10
    /// -o ServerAliveInterval=10`). Every host must
    /// have the launcher and the program at the same paths.
    #[arg(long, value_name = "COMMAND")]
    pub rsh: Option<String>,
    /// Process slots per node: one count, or a list for nodes 0, 1, ... (the last entry
    /// repeats), e.g. `4,2,8`.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    pub slots: Vec<u32>,
    /// Nodes in the pool the job may grow into (default: --nodes, or the largest step
    /// of a `steps:` policy).
    #[arg(long, value_name = "N")]
    pub max_nodes: Option<u32>,
    /// Fewest nodes the job may shrink to.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub min_nodes: u32,
    /// Preferred node count: no policy takes the job below it, and under `fixed` a job
    /// started below it grows to it at the first change point (DMR's sweet spot).
    /// Requests may still go below.
    #[arg(long, value_name = "N")]
    pub preferred_nodes: Option<u32>,
    /// When the job changes size: fixed, steps:A,B,C (node counts), inc-dec, random[:SEED].
    // The text is `--help`'s too, so the brackets stay as they are, not a link.
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long, default_value = "fixed", value_parser = parse_policy)]
    pub policy: PolicySpec,
    /// Checkpoints between change points of the policy.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub period: u64,
    /// Who starts new node worlds: every running process (tree) or one process.
    #[arg(long, value_enum, default_value_t = SpawnArg::Parallel)]
    pub spawn: SpawnArg,
    /// Growth method: keep the running processes and add the difference, or start the
    /// whole target anew and end the old processes.
    #[arg(long, value_enum, default_value_t = MethodArg::Merge)]
    pub method: MethodArg,
    /// Prefix every output line with `[rank]`.
    #[arg(long)]
    pub tag_output: bool,
    /// Bind each rank to a core of its own (with its hardware threads), or to one
    /// hardware thread, of the CPUs `ductile run` (or the node's agent) may use; ranks
    /// started by a growth take the cores that a shrink freed. More ranks on a host
    /// than cores share them, round-robin.
    #[arg(long, value_enum, value_name = "UNIT", default_value_t = BindTo::None)]
    pub bind_to: BindTo,
    /// Print where each rank was bound as it starts.
    #[arg(long)]
    pub report_bindings: bool,
    /// Do not print the job's id and control socket at start (child jobs of
    /// `Group::launch` run so).
    #[arg(long)]
    pub quiet: bool,
    /// End the job after this many seconds (exit code 124); waits inside ranks are bounded by it too (plus 10 s).
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub timeout: Option<u64>,
    /// Seconds ranks may take to start and call `ductile::init` (at start-up and when a
    /// resize adds processes) before the job ends naming the late ones.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub join_timeout: u64,
    /// Write a JSON report of the job here.
    #[arg(long, value_name = "FILE.json")]
    pub report: Option<PathBuf>,
    /// How registered data moves at a resize: an alltoallv over old and new ranks
    /// (collective), sends of each overlap (p2p), or reads from the old ranks' windows
    /// (rma).
    #[arg(long, value_name = "METHOD", default_value = "p2p", value_parser = parse_method)]
    pub redistribution: ductile::Method,
    /// Move constant registered items in the background: at a background checkpoint
    /// the application computes on while they travel, and switches at a later one.
    #[arg(long)]
    pub background: bool,
    /// What a failed process (one that exits with an error or is killed, or whose node
    /// is lost) does to the job: end it (abort), or shrink it to the processes left,
    /// which recover at their next checkpoint (shrink; the application is told what
    /// registered data was lost).
    #[arg(long, value_enum, value_name = "WHAT", default_value_t = OnFailure::Abort)]
    pub on_failure: OnFailure,
    /// Transport between ranks: tcp, quic (TLS 1.3) or fabric (libfabric).
    #[arg(long, default_value = "tcp", value_parser = parse_transport)]
    pub transport: String,
    /// libfabric provider of `--transport fabric` (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`,
    /// ...); default: `FI_PROVIDER`, then libfabric's choice.
    #[arg(long, value_name = "PROVIDER")]
    pub fabric_provider: Option<String>,
    /// Print the node map (and, for a `steps:` policy, every planned change) and exit
    /// without starting anything.
    #[arg(long)]
    pub dry_run: bool,
    /// Internal: adopt the running process that listens on this socket as rank 0
    /// instead of starting one (how a program started alone grows; see
    /// `ductile::Session::request_procs`). Needs `-n 1` and `--adopt-pid`.
    #[arg(long, value_name = "SOCKET", hide = true, requires = "adopt_pid")]
    pub adopt: Option<PathBuf>,
    /// Internal: the pid of the process `--adopt` names.
    #[arg(long, value_name = "PID", hide = true, requires = "adopt")]
    pub adopt_pid: Option<u32>,
    /// The program and its arguments.
    #[arg(value_name = "PROGRAM", allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// `--spawn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SpawnArg {
    /// Tree-parallel: every process spawns (hypercube / iterative diffusive).
    Parallel,
    /// One process starts every new node world.
    Single,
}

/// `--method`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    /// Keep the sources, spawn the difference.
    Merge,
    /// Spawn the whole target, end the sources.
    Baseline,
}

fn parse_method(s: &str) -> Result<ductile::Method, String> {
    s.parse()
}

fn parse_transport(s: &str) -> Result<String, String> {
    let built = ductile_transport::transport::backends();
    if built.contains(&s) {
        return Ok(s.to_string());
    }
    if ["quic", "fabric"].contains(&s) {
        return Err(format!("this ductile was built without the {s} transport (cargo feature `{s}`)"));
    }
    Err(format!("unknown transport (this build has: {})", built.join(", ")))
}

fn parse_policy(s: &str) -> Result<PolicySpec, String> {
    s.parse()
}

/// Arguments of `ductile resize`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("size").required(true).args(["nodes", "procs"])))]
pub struct ResizeArgs {
    /// The job: its id (printed at start) or the path of its control socket.
    pub job: String,
    /// Target number of nodes.
    #[arg(long)]
    pub nodes: Option<u32>,
    /// Target number of processes.
    #[arg(long)]
    pub procs: Option<u32>,
    /// Seconds to wait for the job to carry it out.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub wait: u64,
}

/// Arguments of `ductile status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The job: its id (printed at start) or the path of its control socket.
    pub job: String,
    /// Seconds to wait for the answer.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
    pub wait: u64,
}

impl ResizeArgs {
    /// The requested size.
    #[must_use]
    pub fn target(&self) -> Target {
        match (self.nodes, self.procs) {
            (Some(n), _) => Target::Nodes(n),
            (None, Some(p)) => Target::Procs(p),
            // clap's required group guarantees one of them.
            (None, None) => Target::Nodes(0),
        }
    }
}

/// Finds a program the way a shell would: a path with a slash as is, else on `PATH`.
///
/// # Errors
/// Not found, or not an executable file.
pub fn resolve_program(name: &str) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false);
    if name.is_empty() {
        return Err("the program name is empty".into());
    }
    if name.contains('/') {
        let p = Path::new(name);
        if !p.exists() {
            return Err(format!("program not found: {name}"));
        }
        if !runnable(p) {
            return Err(format!("not an executable file: {name}"));
        }
        return std::path::absolute(p).map_err(|e| format!("{name}: {e}"));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| runnable(p)).ok_or_else(|| {
        match name.starts_with('-') {
            // Options go before the program, so this one is not an option of `run`.
            true => format!("unknown option {name} (see ductile run --help)"),
            false => format!("program not found on PATH: {name}"),
        }
    })
}

/// Fails unless the report can be written at `path` when the job ends (a long job must
/// not lose its report to a typo): an existing file must be writable, else its directory
/// must exist and be writable.
/// A report path naming one of this process's descriptors (`/dev/fd/N`, how
/// `Group::launch` hands its child launcher a `memfd`): kept from the job's processes,
/// which would otherwise inherit it. Reopening it by path still works.
pub fn keep_report_fd_private(path: &Path) {
    let fd = path.to_str().and_then(|p| p.strip_prefix("/dev/fd/").or_else(|| p.strip_prefix("/proc/self/fd/")));
    if let Some(fd) = fd.and_then(|n| n.parse::<i32>().ok()).filter(|&fd| fd > 2) {
        // SAFETY: fcntl on a descriptor number; an unopened one only makes it fail.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}

fn check_report_path(path: &Path) -> Result<(), String> {
    use nix::unistd::{access, AccessFlags};
    let cannot = |why: String| Err(format!("cannot write the report to {}: {why}", path.display()));
    if path.is_dir() {
        return cannot("it is a directory".into());
    }
    if path.exists() {
        return access(path, AccessFlags::W_OK).or_else(|e| cannot(e.desc().to_string()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return cannot(format!("{} is not a directory", dir.display()));
    }
    access(dir, AccessFlags::W_OK).or_else(|e| cannot(format!("{}: {}", dir.display(), e.desc())))
}

impl RunArgs {
    /// Checks the arguments and builds the job.
    ///
    /// # Errors
    /// One line saying what is wrong.
    pub fn into_spec(self) -> Result<JobSpec, String> {
        let (pool, slot_list, layout) = self.placement()?;
        let initial = layout.nodes.len() as u32;
        let steps_max = match &self.policy {
            PolicySpec::Steps(s) => s.iter().copied().max().unwrap_or(1),
            _ => 1,
        };
        let max = self.max_nodes.or(pool.as_ref().map(|h| h.len() as u32)).unwrap_or(initial.max(steps_max));
        // Before anything is built per node: every node holds at least one rank.
        if max.max(steps_max) > layout::MAX_RANKS {
            let limit = layout::MAX_RANKS;
            return Err(match (steps_max > limit, self.max_nodes) {
                (true, _) => format!("--policy asks for {steps_max} nodes, more than the limit of {limit}"),
                (false, Some(_)) => format!("--max-nodes asks for {max} nodes, more than the limit of {limit}"),
                (false, None) => format!(
                    "the job may grow to all {max} nodes of its hosts, more than the limit of {limit}: \
                     bound it with --max-nodes"
                ),
            });
        }
        if initial > max {
            return Err(format!("the job starts on {initial} nodes, above --max-nodes {max}"));
        }
        if steps_max > max {
            return Err(format!("--policy asks for {steps_max} nodes, above --max-nodes {max}"));
        }
        if self.min_nodes > max {
            return Err(format!("--min-nodes {} is above --max-nodes {max}", self.min_nodes));
        }
        if initial < self.min_nodes {
            return Err(format!("the job starts on {initial} nodes, below --min-nodes {}", self.min_nodes));
        }
        let steps_min = match &self.policy {
            PolicySpec::Steps(s) => s.iter().copied().min(),
            _ => None,
        };
        if let Some(low) = steps_min.filter(|&m| m < self.min_nodes) {
            return Err(format!("--policy asks for {low} nodes, below --min-nodes {}", self.min_nodes));
        }
        let bounds = Bounds::new(self.min_nodes, max, self.preferred_nodes).map_err(|e| e.to_string())?;
        let slots: Vec<u32> = (0..max as usize)
            .map(|i| layout.nodes.get(i).map_or_else(|| layout::slots_of(&slot_list, i), |n| n.slots))
            .collect();
        let pool_slots: u64 = slots.iter().copied().map(u64::from).sum();
        if pool_slots > u64::from(layout::MAX_RANKS) {
            return Err(format!(
                "a pool of {max} nodes has {pool_slots} slots, more than the limit of {} ranks{}",
                layout::MAX_RANKS,
                // Only a pool's size, not a size the job asks for, can be bounded.
                if self.max_nodes.is_none() && max > initial.max(steps_max) {
                    ": bound the job with --max-nodes"
                } else {
                    ""
                }
            ));
        }
        self.check_transport(pool.as_deref())?;
        let adopt = match (self.adopt, self.adopt_pid) {
            (Some(socket), Some(pid)) if layout.nodes.len() == 1 && layout.nodes[0].ranks.len() == 1 => {
                Some(crate::proto::Adopt { socket: socket.display().to_string(), pid })
            }
            (Some(_), _) => return Err("--adopt needs a job of one process (-n 1)".into()),
            _ => None,
        };
        if adopt.is_some() && self.method == MethodArg::Baseline {
            // A baseline growth would release the adopted process: the user's own.
            return Err("--adopt needs --method merge".into());
        }
        let mut command = self.command.into_iter();
        let program = command.next().ok_or("no program given (usage: ductile run [OPTIONS] -- PROGRAM [ARGS...])")?;
        if let Some(path) = &self.report {
            check_report_path(path)?;
        }
        // The ranks inherit this environment: a setting they would refuse fails the job
        // here, before any process starts.
        ductile::env::EnvSettings::from_env().map_err(|e| format!("{e} (the ranks would inherit it)"))?;
        let hosts = pool.map(|h| crate::controller::HostPool {
            names: h.into_iter().map(|h| h.name).collect(),
            rsh: rsh_words(
                self.rsh.as_deref(),
                if self.slurm { crate::slurm::SRUN_RSH } else { crate::controller::remote::DEFAULT_RSH },
            ),
        });
        Ok(JobSpec {
            layout,
            slots,
            bounds,
            policy: self.policy,
            period: self.period,
            method: match self.method {
                MethodArg::Merge => Method::Merge,
                MethodArg::Baseline => Method::Baseline,
            },
            strategy: match self.spawn {
                SpawnArg::Parallel => Strategy::Parallel,
                SpawnArg::Single => Strategy::Single,
            },
            program: resolve_program(&program)?,
            args: command.collect(),
            tag_output: self.tag_output,
            bind_to: self.bind_to,
            report_bindings: self.report_bindings,
            timeout: self.timeout.map(Duration::from_secs),
            join_timeout: Duration::from_secs(self.join_timeout),
            transport: ductile::bootstrap::TransportSpec {
                name: self.transport,
                fabric_provider: self.fabric_provider,
                bind_host: None,
            },
            report: self.report,
            redistribution: self.redistribution,
            background: self.background,
            on_failure: self.on_failure,
            adopt,
            quiet: self.quiet,
            hosts,
        })
    }

    /// Fails on transport settings that cannot work: a provider without the fabric
    /// transport, or libfabric's shm provider for a job that spans hosts.
    fn check_transport(&self, pool: Option<&[crate::hosts::Host]>) -> Result<(), String> {
        if self.fabric_provider.is_some() && self.transport != "fabric" {
            return Err(format!("--fabric-provider needs --transport fabric (this job's is {})", self.transport));
        }
        let provider = self.fabric_provider.clone().or_else(|| std::env::var("FI_PROVIDER").ok());
        let spans = pool.is_some_and(|h| h.iter().any(|h| !crate::hosts::is_local(&h.name)));
        if spans && self.transport == "fabric" && provider.as_deref() == Some("shm") {
            return Err(
                "libfabric's shm provider cannot reach other hosts (use tcp;ofi_rxm, verbs;ofi_rxm, ...)".into()
            );
        }
        Ok(())
    }

    /// The hosts (if given), the slots of every node of the pool, and the layout at
    /// start.
    #[allow(clippy::type_complexity)]
    fn placement(&self) -> Result<(Option<Vec<crate::hosts::Host>>, Vec<u32>, layout::Layout), String> {
        let pool = self.host_pool()?;
        let slot_list = match &pool {
            Some(hosts) => hosts
                .iter()
                .enumerate()
                .map(|(i, h)| h.slots.unwrap_or_else(|| layout::slots_of(&self.slots, i)))
                .collect(),
            None => self.slots.clone(),
        };
        // On hosts, a job without -n or --nodes fills every slot of every host.
        let nodes = match &pool {
            Some(hosts) if self.n.is_none() => {
                Some(self.nodes.unwrap_or(u32::try_from(hosts.len()).unwrap_or(u32::MAX)))
            }
            _ => self.nodes,
        };
        let layout = layout::plan_slots(self.n, nodes, &slot_list).map_err(|e| e.to_string())?;
        if let Some(hosts) = &pool {
            check_fits(hosts.len(), layout.nodes.len() as u32, self.max_nodes)?;
        }
        Ok((pool, slot_list, layout))
    }

    /// The hosts of --hosts or --hostfile, if given.
    fn host_pool(&self) -> Result<Option<Vec<crate::hosts::Host>>, String> {
        let hosts = match (&self.hosts, &self.hostfile) {
            (Some(list), _) => crate::hosts::parse_list(list).map_err(|e| format!("--hosts: {e}"))?,
            (None, _) if self.slurm => crate::slurm::from_env().map_err(|e| e.to_string())?,
            (None, Some(path)) => {
                let text =
                    read_hostfile(path).map_err(|e| format!("cannot read the hostfile {}: {e}", path.display()))?;
                crate::hosts::parse_file(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            (None, None) if self.rsh.is_some() => return Err("--rsh needs --hosts, --hostfile or --slurm".into()),
            (None, None) => return Ok(None),
        };
        if hosts.is_empty() {
            return Err("no hosts given".into());
        }
        if self.rsh.as_deref().is_some_and(|r| r.trim().is_empty()) {
            return Err("--rsh is empty".into());
        }
        Ok(Some(hosts))
    }
}

/// Largest hostfile read, bytes (a million hosts' worth of lines is far past any
/// pool; `/dev/zero` is not a hostfile).
const MAX_HOSTFILE: u64 = 16 << 20;

/// The text of a hostfile: a regular file (not a FIFO that may never end) of at most
/// [`MAX_HOSTFILE`] bytes.
fn read_hostfile(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    file.take(MAX_HOSTFILE + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_HOSTFILE {
        return Err(std::io::Error::other(format!("larger than {} MiB", MAX_HOSTFILE >> 20)));
    }
    Ok(text)
}

/// Fails unless a job starting on `initial` nodes, with at most `max` (if given), fits
/// on `hosts` hosts.
fn check_fits(hosts: usize, initial: u32, max: Option<u32>) -> Result<(), String> {
    let plural = if hosts == 1 { "" } else { "s" };
    if initial as usize > hosts {
        return Err(format!("the job needs {initial} nodes, but there are {hosts} host{plural}"));
    }
    match max.filter(|&m| m as usize > hosts) {
        Some(m) => Err(format!("--max-nodes {m} is more than the {hosts} host{plural}")),
        None => Ok(()),
    }
}

/// The remote shell's words: `--rsh`, else `DUCTILE_RSH`, else `default`.
fn rsh_words(given: Option<&str>, default: &str) -> Vec<String> {
    let from_env = std::env::var(crate::controller::remote::RSH_ENV).ok().filter(|v| !v.trim().is_empty());
    let text = given.map(str::to_owned).or(from_env).unwrap_or_else(|| default.into());
    text.split_whitespace().map(str::to_owned).collect()
}
