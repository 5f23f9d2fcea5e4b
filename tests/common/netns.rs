//! Test hosts in network namespaces that the test itself creates, for the multi-host
//! launcher tests (`ductile run --hosts h1,h2 --rsh "ip netns exec" ...`).
//!
//! A [`TestHosts`] is a "head" namespace, where the test runs `ductile run`, and `n` host
//! namespaces, all on one private /24 through a bridge inside the head namespace:
//!
//! ```text
//!   head ns (dtl-<pid>-<c>-head)          host ns i (dtl-<pid>-<c>-h<i>)
//!   br0   10.x.y.1/24  ── veth<i> ─────── eth0  10.x.y.(i+2)/24
//! ```
//!
//! Every link is created inside the namespaces (the veth pair inside the head namespace,
//! its peer directly in the host namespace), so nothing is ever created in, or changed
//! on, the root namespace's interfaces; the addresses exist only in these namespaces.
//! Needs root and iproute2's `ip`; without them [`TestHosts::create`] says so loudly and
//! returns `Ok(None)`, so that the caller can skip.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Prefix of every namespace this module creates: `dtl-<pid>-<counter>-...`.
const PREFIX: &str = "dtl-";
/// The bridge inside the head namespace.
const BRIDGE: &str = "br0";
/// The interface of a host namespace (the peer of the head's `veth<i>`).
const HOST_IF: &str = "eth0";
/// How long the links may take to come up after creation.
const LINK_UP_LIMIT: Duration = Duration::from_secs(5);
/// Where iproute2 installs `ip`, looked at before `PATH`.
const IP_CANDIDATES: [&str; 2] = ["/usr/sbin/ip", "/sbin/ip"];

/// Numbers the `TestHosts` of this test process, for unique names and subnets.
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A head namespace and `n` host namespaces on one private subnet. Dropping it kills the
/// processes still inside its namespaces and deletes them.
pub struct TestHosts {
    ip: PathBuf,
    head: String,
    hosts: Vec<String>,
    /// The first three octets of the subnet.
    net: [u8; 3],
    /// Every namespace created so far (the head first), for cleanup also after a failed
    /// `create`.
    created: Vec<String>,
}

impl TestHosts {
    /// Creates a "head" namespace (where the test runs `ductile run`) and `n` host
    /// namespaces, all on one private subnet through a bridge inside the head namespace.
    /// Returns `Ok(None)` after printing a loud line to stderr when not root or `ip` is
    /// missing; any other failure is an `Err` naming the failing command and its stderr
    /// (what was created until then is removed again).
    pub fn create(n: usize) -> Result<Option<TestHosts>, String> {
        if n > 253 {
            return Err(format!("TestHosts::create({n}): at most 253 hosts fit in a /24"));
        }
        let Some(ip) = find_ip() else {
            return skip("`ip` (iproute2) not found; network-namespace test hosts need root and iproute2");
        };
        if !is_root() {
            return skip("not running as root; network-namespace test hosts need root and iproute2");
        }
        sweep_stale(&ip);
        let pid = std::process::id();
        let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = format!("{PREFIX}{pid}-{counter}");
        let mut hosts = TestHosts {
            ip,
            head: format!("{base}-head"),
            hosts: (0..n).map(|i| format!("{base}-h{i}")).collect(),
            net: subnet(pid, counter),
            created: Vec::new(),
        };
        // On an error, dropping `hosts` removes what was created so far.
        hosts.build()?;
        Ok(Some(hosts))
    }

    /// The head namespace's name.
    pub fn head(&self) -> &str {
        &self.head
    }

    /// The host namespaces' names, in order.
    pub fn hosts(&self) -> Vec<String> {
        self.hosts.clone()
    }

    /// The head namespace's address (on its bridge).
    pub fn head_addr(&self) -> Ipv4Addr {
        let [a, b, c] = self.net;
        Ipv4Addr::new(a, b, c, 1)
    }

    /// Host `i`'s address; panics when there is no host `i` (a bug in the test).
    pub fn host_addr(&self, i: usize) -> Ipv4Addr {
        let [a, b, c] = self.net;
        assert!(i < self.hosts.len(), "host_addr({i}): there are only {} hosts", self.hosts.len());
        // `create` allows at most 253 hosts, so `i + 2` fits.
        Ipv4Addr::new(a, b, c, (i + 2) as u8)
    }

    /// A `Command` that runs `program` (add its arguments) inside the head namespace:
    /// `ip netns exec HEAD program ...`.
    pub fn in_head(&self, program: &Path) -> Command {
        let mut c = Command::new(&self.ip);
        c.args(["netns", "exec", &self.head]).arg(program);
        c
    }

    /// A `Command` that runs `program` (add its arguments) inside host `i`'s namespace.
    pub fn in_host(&self, i: usize, program: &Path) -> Command {
        let mut c = Command::new(&self.ip);
        c.args(["netns", "exec", &self.hosts[i]]).arg(program);
        c
    }

    /// Cuts host `i` off the network (its link on the bridge goes down), as a host whose
    /// cable or switch port failed: its processes keep running, and nothing they send
    /// arrives.
    pub fn cut(&self, i: usize) -> Result<(), String> {
        ip_ok(&self.ip, &["-n", &self.head, "link", "set", &format!("veth{i}"), "down"]).map(drop)
    }

    /// Pids of every process now inside any of the namespaces (`ip netns pids NAME`).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.created.iter().flat_map(|ns| ns_pids(&self.ip, ns)).collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Creates the namespaces, the bridge, the veth pairs and the addresses, and waits
    /// until the links are up.
    fn build(&mut self) -> Result<(), String> {
        for ns in std::iter::once(&self.head).chain(&self.hosts).cloned().collect::<Vec<_>>() {
            ip_ok(&self.ip, &["netns", "add", &ns])?;
            self.created.push(ns.clone());
            ip_ok(&self.ip, &["-n", &ns, "link", "set", "lo", "up"])?;
        }
        let head = self.head.as_str();
        let head_cidr = format!("{}/24", self.head_addr());
        ip_ok(&self.ip, &["-n", head, "link", "add", BRIDGE, "type", "bridge"])?;
        ip_ok(&self.ip, &["-n", head, "addr", "add", &head_cidr, "dev", BRIDGE])?;
        ip_ok(&self.ip, &["-n", head, "link", "set", BRIDGE, "up"])?;
        for (i, host) in self.hosts.iter().enumerate() {
            let veth = format!("veth{i}");
            let cidr = format!("{}/24", self.host_addr(i));
            ip_ok(
                &self.ip,
                &["-n", head, "link", "add", &veth, "type", "veth", "peer", "name", HOST_IF, "netns", host],
            )?;
            ip_ok(&self.ip, &["-n", head, "link", "set", &veth, "master", BRIDGE])?;
            ip_ok(&self.ip, &["-n", head, "link", "set", &veth, "up"])?;
            ip_ok(&self.ip, &["-n", host, "addr", "add", &cidr, "dev", HOST_IF])?;
            ip_ok(&self.ip, &["-n", host, "link", "set", HOST_IF, "up"])?;
        }
        if !self.hosts.is_empty() {
            self.await_up(head, BRIDGE)?;
        }
        for host in &self.hosts {
            self.await_up(host, HOST_IF)?;
        }
        Ok(())
    }

    /// Waits until `link` in `ns` reports `state UP` (a bridge does once a port forwards).
    fn await_up(&self, ns: &str, link: &str) -> Result<(), String> {
        let deadline = Instant::now() + LINK_UP_LIMIT;
        loop {
            let shown = ip_ok(&self.ip, &["-n", ns, "-o", "link", "show", "dev", link])?;
            if shown.contains(" state UP ") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{link} in namespace {ns} is not up after {LINK_UP_LIMIT:?}: {}", shown.trim()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestHosts {
    fn drop(&mut self) {
        kill_inside(&self.ip, &self.created);
        if self.created.first() == Some(&self.head) {
            // Deleting a veth end deletes its peer in the host namespace too.
            for i in 0..self.hosts.len() {
                let _ = ip_out(&self.ip, &["-n", &self.head, "link", "delete", &format!("veth{i}")]);
            }
            let _ = ip_out(&self.ip, &["-n", &self.head, "link", "delete", BRIDGE]);
        }
        for ns in self.created.iter().rev() {
            let _ = ip_out(&self.ip, &["netns", "delete", ns]);
        }
    }
}

/// The first three octets of a private 10.x.y.0/24 for this process and counter. Two
/// `TestHosts` sharing one would not conflict anyway: each lives in namespaces of its own.
fn subnet(pid: u32, counter: u32) -> [u8; 3] {
    let v = pid.wrapping_mul(131).wrapping_add(counter) & 0xffff;
    [10, (v >> 8) as u8, (v & 0xff) as u8]
}

/// Variable that turns a skip into a failure: `scripts/test.sh` sets it, as CI runs as
/// root with iproute2 and openssh-server installed, so nothing is skipped there.
pub const REQUIRE_ENV: &str = "DUCTILE_TEST_REQUIRE_HOSTS";

/// Says loudly that a test is skipped, or fails when [`REQUIRE_ENV`] is set.
pub fn skip<T>(why: &str) -> Result<Option<T>, String> {
    if std::env::var_os(REQUIRE_ENV).is_some() {
        return Err(format!("{why} ({REQUIRE_ENV} is set: the test hosts are required)"));
    }
    eprintln!("SKIPPED: {why}");
    Ok(None)
}

/// Whether this process's effective uid is 0 (from `/proc/self/status`, whose `Uid:` line
/// lists the real, effective, saved and filesystem uids).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1)) == Some("0")
    })
}

/// iproute2's `ip`, if installed.
fn find_ip() -> Option<PathBuf> {
    let fixed = IP_CANDIDATES.iter().map(PathBuf::from);
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("ip")).collect::<Vec<_>>())
        .unwrap_or_default();
    fixed.chain(on_path).find(|p| p.is_file())
}

/// Runs `ip args`: its output, or why it could not run.
fn ip_out(ip: &Path, args: &[&str]) -> Result<std::process::Output, String> {
    Command::new(ip)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("`{} {}` could not start: {e}", ip.display(), args.join(" ")))
}

/// Runs `ip args`, which must succeed: its stdout, or the command and its stderr.
fn ip_ok(ip: &Path, args: &[&str]) -> Result<String, String> {
    let out = ip_out(ip, args)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{} {}` failed ({}): {}",
            ip.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Pids of the processes inside namespace `ns` (none when it cannot be read).
fn ns_pids(ip: &Path, ns: &str) -> Vec<u32> {
    match ip_out(ip, &["netns", "pids", ns]) {
        Ok(out) if out.status.success() => {
            String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect()
        }
        _ => Vec::new(),
    }
}

/// SIGKILLs, by pid, the processes inside the namespaces `names` (never this process),
/// again while new ones appear (a process may fork while the others die), for at most
/// about two seconds.
fn kill_inside(ip: &Path, names: &[String]) {
    let me = std::process::id();
    for _ in 0..100 {
        let pids: Vec<u32> = names.iter().flat_map(|ns| ns_pids(ip, ns)).filter(|&p| p != me).collect();
        if pids.is_empty() {
            return;
        }
        for p in pids {
            if let Ok(p) = i32::try_from(p) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<u32> = names.iter().flat_map(|ns| ns_pids(ip, ns)).filter(|&p| p != me).collect();
    if !left.is_empty() {
        eprintln!("WARNING: processes {left:?} still run in the test hosts {names:?} after 2 s of SIGKILL");
    }
}

/// Deletes the namespaces `dtl-<pid>-...` whose test process `<pid>` is gone (killed
/// before its `TestHosts` were dropped), after killing what still runs inside them.
/// Failures are ignored: another test process may be sweeping the same ones.
fn sweep_stale(ip: &Path) {
    let Ok(out) = ip_out(ip, &["netns", "list"]) else { return };
    let me = u64::from(std::process::id());
    let stale: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| {
            let owner = name.strip_prefix(PREFIX).and_then(|rest| rest.split('-').next()?.parse::<u64>().ok());
            owner.is_some_and(|pid| pid != me && !super::is_alive(pid))
        })
        .map(str::to_owned)
        .collect();
    if stale.is_empty() {
        return;
    }
    kill_inside(ip, &stale);
    for ns in &stale {
        let _ = ip_out(ip, &["netns", "delete", ns]);
    }
}
