//! The command line of `ductile`.

use crate::controller::JobSpec;
use crate::layout;
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    Run(RunArgs),
    /// Internal: the node agent started by `ductile run`.
    #[command(hide = true)]
    Agent,
}

/// Arguments of `ductile run`.
#[derive(Debug, clap::Args)]
#[command(trailing_var_arg = true)]
pub struct RunArgs {
    /// Number of ranks (processes).
    #[arg(short = 'n', long = "np", value_name = "NPROCS")]
    pub n: Option<u32>,
    /// Number of simulated nodes.
    #[arg(long)]
    pub nodes: Option<u32>,
    /// Process slots per node.
    #[arg(long)]
    pub slots: Option<u32>,
    /// Prefix every output line with `[rank]`.
    #[arg(long)]
    pub tag_output: bool,
    /// End the job after this many seconds (exit code 124); waits inside ranks are bounded by it too (plus 10 s).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Write a JSON report of the job here.
    #[arg(long, value_name = "FILE.json")]
    pub report: Option<PathBuf>,
    /// Transport between ranks.
    #[arg(long, default_value = "tcp", value_parser = ["tcp"])]
    pub transport: String,
    /// Print the node map and exit without starting anything.
    #[arg(long)]
    pub dry_run: bool,
    /// The program and its arguments.
    #[arg(value_name = "PROGRAM", allow_hyphen_values = true)]
    pub command: Vec<String>,
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
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| runnable(p))
        .ok_or_else(|| format!("program not found on PATH: {name}"))
}

impl RunArgs {
    /// Checks the arguments and builds the job.
    ///
    /// # Errors
    /// One line saying what is wrong.
    pub fn into_spec(self) -> Result<JobSpec, String> {
        let layout = layout::plan(self.n, self.nodes, self.slots).map_err(|e| e.to_string())?;
        let mut command = self.command.into_iter();
        let program = command.next().ok_or("no program given (usage: ductile run [OPTIONS] -- PROGRAM [ARGS...])")?;
        if self.timeout == Some(0) {
            return Err("--timeout must be at least 1 second".into());
        }
        Ok(JobSpec {
            layout,
            program: resolve_program(&program)?,
            args: command.collect(),
            tag_output: self.tag_output,
            timeout: self.timeout.map(Duration::from_secs),
            transport: self.transport,
            report: self.report,
        })
    }
}

/// The node map printed by `--dry-run`.
#[must_use]
pub fn node_map(spec: &JobSpec) -> String {
    let mut s = format!(
        "{} ranks on {} simulated nodes; program {}\n",
        spec.layout.size(),
        spec.layout.nodes.len(),
        spec.program.display()
    );
    for n in &spec.layout.nodes {
        let last = n.ranks.end.saturating_sub(1);
        s += &format!("  {}: {} slots, ranks {}..={}\n", n.node, n.slots, n.ranks.start, last);
    }
    s
}
