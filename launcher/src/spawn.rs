//! Starting child processes with a control channel as fd 3.
//!
//! Children get: the channel as [`CONTROL_FD`] (named in `DUCTILE_CONTROL_FD`), a
//! parent-death signal (SIGKILL) so nothing outlives its parent (except agents started
//! by other agents, whose lifeline is their connection to the controller), and, for
//! agents, a new process group so a whole node world can be ended with one `killpg`. Spawning happens
//! on the launcher's main thread (a current-thread runtime), which matters because the
//! parent-death signal follows the thread that forked.

use crate::proto::{ChannelRead, ChannelWrite, Network, ToAgent, STDIO_MAGIC};
use ductile::bootstrap::{CONTROL_FD, CONTROL_FD_ENV};
use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use tokio::process::{Child, Command};

/// How a child's output is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Inherit the parent's stdout and stderr.
    Inherit,
    /// Pipes, read by the parent.
    Piped,
}

/// What a child reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// Nothing (`/dev/null`).
    Null,
    /// The parent's stdin.
    Inherit,
}

/// Switches read by the PSM libraries that Debian's libfabric links (`libinfinipath`,
/// `libpsm2`): unless set, their constructors take over SIGSEGV, SIGBUS, SIGILL,
/// SIGABRT, SIGINT and SIGTERM in every process that loads libfabric, print a backtrace
/// and `exit(1)`. A rank over the fabric transport that aborted was then reported as
/// "exited with code 1" instead of killed by signal 6, and SIGTERM no longer ended it
/// as a signal. Open MPI sets the same two for the same reason; a value the user set is
/// kept.
const PSM_NO_BACKTRACE: [&str; 2] = ["IPATH_NO_BACKTRACE", "HFI_NO_BACKTRACE"];

/// How a child is set up before it runs its program.
#[derive(Clone, Copy, Debug, Default)]
pub struct Setup {
    /// In a process group of its own.
    pub new_group: bool,
    /// With the parent-death signal (SIGKILL when the spawning thread ends).
    pub parent_death: bool,
    /// Bound to these CPUs (see [`crate::bind`]).
    pub cpus: Option<nix::sched::CpuSet>,
}

/// Starts `program args` with `channel` as its control channel, reading `input` and
/// writing to `output`, set up as `setup` says, and with `network`'s environment and
/// working directory (a rank on another host than `ductile run`'s).
///
/// # Errors
/// The program cannot be started.
pub fn spawn_with_channel(
    program: &OsStr,
    args: &[impl AsRef<OsStr>],
    channel: &UnixStream,
    setup: Setup,
    (input, output): (Input, Output),
    network: Option<&Network>,
) -> std::io::Result<Child> {
    let fd = channel.as_raw_fd();
    let parent = std::process::id();
    let mut cmd = Command::new(program);
    if let Some(n) = network {
        cmd.envs(n.env.iter().map(|(k, v)| (k, v)));
        if std::path::Path::new(&n.cwd).is_dir() {
            cmd.current_dir(&n.cwd).env("PWD", &n.cwd);
        } else {
            tracing::warn!("{} does not exist here: the ranks start in the agent's directory", n.cwd);
        }
    }
    cmd.args(args).env(CONTROL_FD_ENV, CONTROL_FD.to_string()).kill_on_drop(false);
    if program == OWN_IMAGE {
        // Named as it was started, not as `/proc/self/exe`, in `ps` and the like.
        if let Ok(exe) = std::env::current_exe() {
            cmd.arg0(exe);
        }
    }
    cmd.stdin(if input == Input::Inherit { Stdio::inherit() } else { Stdio::null() });
    cmd.env_remove(crate::controller::TEST_KEY_ENV);
    // Processes launch child jobs with the launcher that started them (see
    // `ductile::Group::launch`), unless the user named another.
    if std::env::var_os(ductile::LAUNCHER_ENV).is_none() {
        if let Ok(exe) = std::env::current_exe() {
            cmd.env(ductile::LAUNCHER_ENV, exe);
        }
    }
    for var in PSM_NO_BACKTRACE {
        if std::env::var_os(var).is_none() {
            cmd.env(var, "1");
        }
    }
    if output == Output::Piped {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (fcntl, dup2, setpgid, prctl, getppid,
    // sched_setaffinity).
    unsafe {
        cmd.pre_exec(move || {
            child_setup(Some(fd), setup.new_group, setup.parent_death.then_some(parent))?;
            setup.cpus.as_ref().map_or(Ok(()), crate::bind::bind_self)
        });
    }
    cmd.spawn()
}

/// Where the running image of this program is: what starts another agent on this
/// host.
const OWN_IMAGE: &str = "/proc/self/exe";

/// The program that starts another of this process's kind (an agent) on this host:
/// on Linux the running image itself (`/proc/self/exe`), so that a launcher installed
/// anew while jobs run (an upgrade on a cluster, a rebuild) does not break their
/// growths: the path it was started from is then gone (`current_exe` says `... (deleted)`)
/// or holds another build. Elsewhere, that path.
///
/// # Errors
/// Neither is known.
pub fn own_exe() -> std::io::Result<std::path::PathBuf> {
    let image = std::path::Path::new(OWN_IMAGE);
    if image.exists() {
        Ok(image.to_path_buf())
    } else {
        std::env::current_exe()
    }
}

/// Starts `ductile agent --stdio` on `host` through the job's remote shell (`net.rsh`,
/// its words before the host name), in a process group of its own, with the
/// parent-death signal if `parent_death`: the remote shell's stdin and stdout are the
/// new agent's channel, its stderr is this process's. The launcher's path and the log
/// filter go through the remote host's shell, so they must need no quoting (checked by
/// the controller).
///
/// # Errors
/// The remote shell cannot be started.
pub fn spawn_remote(
    net: &Network,
    host: &str,
    parent_death: bool,
) -> std::io::Result<(Child, ChannelRead, ChannelWrite)> {
    let (program, words) = net.rsh.split_first().ok_or_else(|| std::io::Error::other("the remote shell is empty"))?;
    let parent = std::process::id();
    let mut cmd = Command::new(program);
    cmd.args(words).args([host, net.exe.as_str(), "agent", "--stdio"]).kill_on_drop(false);
    if let Some(filter) = &net.log {
        cmd.args(["--log", filter]);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).env_remove(crate::controller::TEST_KEY_ENV);
    // SAFETY: as in `spawn_with_channel`.
    unsafe {
        cmd.pre_exec(move || child_setup(None, true, parent_death.then_some(parent)));
    }
    let mut child = cmd.spawn()?;
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Err(std::io::Error::other("the remote shell's pipes are missing"));
    };
    Ok((child, Box::new(stdout), Box::new(stdin)))
}

/// Checks that the channel (on `rx`) of an agent started through the remote shell
/// begins with [`STDIO_MAGIC`], then hands it its first message `msg` on `tx`, all
/// within `limit`; returns the agent's pid on its host.
///
/// # Errors
/// Why not, in words for the user: the time ran out, the remote shell ended, or what
/// came first was not the agent's.
pub async fn hand_off_remote(
    rx: &mut ChannelRead,
    tx: &mut ChannelWrite,
    msg: &ToAgent,
    limit: std::time::Duration,
) -> Result<u32, String> {
    use tokio::io::AsyncReadExt as _;
    let exchange = async {
        // The agent speaks first; what a shell printed instead is reported as such,
        // and the handoff (the job key with it) goes only to an agent.
        let mut first = [0u8; STDIO_MAGIC.len()];
        match rx.read_exact(&mut first).await {
            Ok(_) if &first != STDIO_MAGIC => {
                // Whatever else came with it, briefly, to show what the shell printed.
                let mut more = [0u8; 240];
                let n = tokio::time::timeout(std::time::Duration::from_millis(200), rx.read(&mut more)).await;
                let mut seen = first.to_vec();
                seen.extend_from_slice(&more[..n.ok().and_then(Result::ok).unwrap_or(0)]);
                Err(format!(
                    "the remote shell printed {:?} before the agent's channel began (does a shell start-up file \
                     print, or is the launcher there another version?)",
                    String::from_utf8_lossy(&seen)
                ))
            }
            Ok(_) => {
                let mut pid = [0u8; 4];
                rx.read_exact(&mut pid).await.map_err(|e| format!("the agent ended as it started ({e})"))?;
                ductile::bootstrap::nonblocking::write_msg(tx, msg)
                    .await
                    .map_err(|e| format!("cannot hand the agent its settings: {e}"))?;
                Ok(u32::from_le_bytes(pid))
            }
            Err(e) => Err(format!("the remote shell ended before the agent started ({e})")),
        }
    };
    match tokio::time::timeout(limit, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!("the agent did not start through the remote shell within {limit:?}")),
    }
}

fn child_setup(fd: Option<i32>, new_group: bool, parent: Option<u32>) -> std::io::Result<()> {
    let check = |rc: i32| if rc < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
    // SAFETY: plain syscalls on descriptors and the calling process.
    unsafe {
        match fd {
            Some(fd) if fd == CONTROL_FD => check(libc::fcntl(fd, libc::F_SETFD, 0))?,
            Some(fd) => check(libc::dup2(fd, CONTROL_FD))?,
            None => {}
        }
        if new_group {
            check(libc::setpgid(0, 0))?;
        }
        if let Some(parent) = parent {
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
            // The parent may have died before the death signal was armed.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("parent exited during spawn"));
            }
        }
    }
    Ok(())
}

/// Sends `sig` to a process (ignoring one that is already gone).
pub fn signal_pid(pid: u32, sig: i32) {
    if let Ok(p) = i32::try_from(pid) {
        // 0 and -1 would signal a whole group or every process: never pass them on.
        if p > 1 {
            // SAFETY: kill with a positive pid signals one process that we started.
            unsafe {
                libc::kill(p, sig);
            }
        }
    }
}

/// Sends `sig` to a process group led by `pgid` (ignoring one that is gone).
pub fn signal_group(pgid: u32, sig: i32) {
    if let Ok(p) = i32::try_from(pgid) {
        if p > 1 {
            // SAFETY: killpg of a group we created (the agent's own group).
            unsafe {
                libc::killpg(p, sig);
            }
        }
    }
}

/// Fields of `/proc/<pid>/stat` after the command name's closing ')': the state
/// first, the parent second, the start time (clock ticks after boot) 20th.
fn stat_fields(pid: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().map(str::to_owned).collect())
}

/// Whether `pid` is in the middle of exiting: it has released its memory, and with it
/// its command line, but is not a zombie yet (an agent on a simulated host whose
/// channel just closed, say). Such a process needs no signal, only to be reaped.
fn exiting(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.is_empty())
}

/// This process's children that started after it did (so not a shell's jobs that
/// `exec`ed into it), from `/proc` (Linux): each pid, and whether it is still running
/// (not a zombie waiting to be reaped, nor [`exiting`]).
fn children() -> Vec<(u32, bool)> {
    let me = std::process::id();
    let Some(born) = stat_fields("self").and_then(|f| f.get(19)?.parse::<u64>().ok()) else { return Vec::new() };
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let f = stat_fields(&pid.to_string())?;
            let (parent, started) = (f.get(1)?.parse::<u32>().ok()?, f.get(19)?.parse::<u64>().ok()?);
            (parent == me && started >= born).then(|| (pid, f[0] != "Z" && !exiting(pid)))
        })
        .collect()
}

/// Ends the processes a job left outside its node worlds' process groups (a rank's
/// `setsid` child, or the launcher of a child job a rank started with
/// `Group::launch`): once their parents have exited they are this process's children,
/// as it is a subreaper, so they are the job's. Asks them to end (SIGTERM: a child
/// job's launcher then ends its own job cleanly, removing what it made) and gives them
/// [`TERM_GRACE`], then kills and reaps them, and the children they leave in turn, and
/// reaps the job's processes that died here already (the ranks of an agent that was
/// killed), within [`ADOPTION_GRACE`] (a process that cannot die, stuck in the kernel,
/// is left); returns how many were still running.
pub async fn end_adopted() -> usize {
    end_adopted_except(&|_| false).await
}

/// Raises this process's soft limit of open files to its hard limit: a launcher of a
/// job on many hosts holds a few descriptors per host (the remote shell's pipes, an
/// agent's connection), past the common soft limit of 1024 at some 300 hosts.
pub fn raise_open_files_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit on this process, with a valid rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                tracing::debug!("cannot raise the open files limit: {}", std::io::Error::last_os_error());
            }
        }
    }
}

/// Makes this process the reaper of its orphaned descendants (see [`end_adopted`]).
pub fn become_subreaper() {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER only sets a flag on this process.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        tracing::warn!("cannot become a subreaper: {}", std::io::Error::last_os_error());
    }
}

/// [`end_adopted`], sparing the children for which `spare` says so (an agent's: the
/// node worlds it started in growths, which live on without it).
pub async fn end_adopted_except(spare: &dyn Fn(u32) -> bool) -> usize {
    // Every use below sees only the children not spared.
    let children = || -> Vec<(u32, bool)> { children().into_iter().filter(|&(pid, _)| !spare(pid)).collect() };
    // A process that is already on its way out (an agent whose channel has just
    // closed) is given a moment to finish on its own, not counted as left behind.
    let settle = tokio::time::Instant::now() + SETTLE;
    while children().iter().any(|&(_, running)| running) && tokio::time::Instant::now() < settle {
        reap_children();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Every running child is asked once, those that become ours meanwhile (the
    // children of one that ended) too, until none is left or the grace is over.
    let mut asked = std::collections::HashSet::new();
    let grace = tokio::time::Instant::now() + TERM_GRACE;
    loop {
        let running: Vec<u32> = children().into_iter().filter(|&(_, r)| r).map(|(pid, _)| pid).collect();
        if running.is_empty() || tokio::time::Instant::now() >= grace {
            break;
        }
        for pid in running {
            if asked.insert(pid) {
                signal_pid(pid, libc::SIGTERM);
            }
        }
        reap_children();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let deadline = tokio::time::Instant::now() + ADOPTION_GRACE;
    let mut ended = asked.len();
    let mut signalled = asked;
    loop {
        let left = children();
        if left.is_empty() {
            return ended;
        }
        for &(pid, running) in &left {
            if running && signalled.insert(pid) {
                ended += 1;
            }
            if running {
                signal_pid(pid, libc::SIGKILL);
            }
        }
        reap_children();
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!("{} processes of the job did not end within {ADOPTION_GRACE:?}", children().len());
            return ended;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Reaps this process's children that have exited, without blocking.
fn reap_children() {
    for (pid, _) in children() {
        if let Ok(p) = i32::try_from(pid) {
            // SAFETY: waitpid on one child of ours, without blocking.
            unsafe {
                libc::waitpid(p, std::ptr::null_mut(), libc::WNOHANG);
            }
        }
    }
}

/// How long [`end_adopted`] gives what it asked to end before it kills it: a child
/// job's launcher ends its job in milliseconds when its ranks end on SIGTERM (one
/// whose ranks do not is killed, and what it made is removed by later jobs).
const TERM_GRACE: std::time::Duration = std::time::Duration::from_secs(3);
/// How long [`end_adopted`] waits for processes to end on their own before it asks.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(200);
/// How long [`end_adopted`] waits for what it killed to end.
const ADOPTION_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
