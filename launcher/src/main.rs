//! The `ductile` binary.

use clap::Parser;
use ductile_launcher::cli::{Cli, Command};
use ductile_launcher::preview::preview;
use std::process::ExitCode;

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    // One thread: every child is forked from the main thread, which the parent-death
    // signal of children is tied to.
    tokio::runtime::Builder::new_current_thread().enable_all().build()
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

/// A clap error on one line: its message and details (missing arguments, possible
/// values, tips), without the usage and the pointer to `--help`.
fn one_line(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    let joined = lines.join(" ").trim_start_matches("error: ").to_string();
    if joined.is_empty() {
        "bad arguments".into()
    } else {
        joined
    }
}

/// `ductile` or `ductile <subcommand>`, for the pointer to `--help`.
fn command_name() -> String {
    // The first argument that is not an option (none of `ductile`'s own options takes
    // a value); not valid UTF-8 is no subcommand.
    let sub = std::env::args_os().skip(1).find(|a| !a.to_string_lossy().starts_with('-'));
    match sub.as_ref().and_then(|s| s.to_str()) {
        Some(sub @ ("run" | "resize" | "status")) => format!("ductile {sub}"),
        _ => "ductile".into(),
    }
}

fn main() -> ExitCode {
    let parsed = Cli::try_parse();
    // An agent on another host logs as `ductile run` was told to (its own environment
    // is the remote shell's).
    let given = match &parsed {
        Ok(Cli { command: Command::Agent(a) }) => a.log.clone(),
        _ => None,
    };
    let filter =
        given.and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok()).unwrap_or_else(tracing_subscriber_filter);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal, not in log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let cli = match parsed {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(2);
        }
        Err(e) => {
            ductile_launcher::say_errln!("ductile: {} (see {} --help)", one_line(&e.to_string()), command_name());
            return ExitCode::from(2);
        }
    };
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            ductile_launcher::say_errln!("ductile: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Agent(a) => match rt.block_on(ductile_launcher::agent::run(a.stdio)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                ductile_launcher::say_errln!("ductile agent: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Resize(args) => {
            let target = args.target();
            let wait = std::time::Duration::from_secs(args.wait.max(1));
            exit(rt.block_on(ductile_launcher::controller::socket::request(&args.job, target, wait)))
        }
        Command::Status(args) => {
            let wait = std::time::Duration::from_secs(args.wait.max(1));
            exit(rt.block_on(ductile_launcher::controller::socket::status(&args.job, wait)))
        }
        Command::Run(args) => {
            let dry = args.dry_run;
            let spec = match (*args).into_spec() {
                Ok(s) => s,
                Err(e) => {
                    ductile_launcher::say_errln!("ductile: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Some(r) = &spec.report {
                ductile_launcher::cli::keep_report_fd_private(r);
            }
            if dry {
                ductile_launcher::say!("{}", preview(&spec));
                return ExitCode::SUCCESS;
            }
            match rt.block_on(ductile_launcher::controller::run(spec)) {
                Ok(code) => exit(code),
                Err(e) => {
                    ductile_launcher::say_errln!("ductile: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn tracing_subscriber_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_env("DUCTILE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"))
}
