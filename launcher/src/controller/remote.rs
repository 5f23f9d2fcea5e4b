//! Jobs that span hosts: the controller's TCP listener, which agents started on other
//! hosts by a resize connect to (authenticated with the job key, then named by their
//! one-time token as on the Unix socket), and what every agent of such a job is told
//! about the network ([`Network`]).

use super::socket::Arrival;
use super::{stdin_for, Ending, Event};
use crate::proto::ToAgent;
use crate::proto::{ChannelRead, ChannelWrite};
use crate::proto::{Hello, Network};
use crate::spawn::{spawn_with_channel, Output, Setup};
use ductile::bootstrap::nonblocking;
use ductile_transport::{auth, JobId, JobKey, NodeId, Rank};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::net::UnixStream;
use tokio::process::Child;
use tokio::sync::{mpsc, Semaphore};

/// The controller's rank in the handshake with agents (which claim their node's number).
pub const CONTROLLER_RANK: Rank = Rank(u32::MAX);
/// Time a TCP connection has to authenticate and say hello, in all.
const GREET_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections greeted at once: agents arrive one per new node, so more means
/// someone without the key is holding connections open.
const MAX_GREETINGS: usize = 64;
/// Most connections held at once, greeted or waiting for their turn; more are closed
/// at once.
const MAX_WAITING: usize = 1024;
/// Refused connections logged one by one; after them, every 100th.
const LOGGED_REFUSALS: u64 = 5;
/// The remote shell when neither `--rsh` nor this variable names one.
pub const RSH_ENV: &str = "DUCTILE_RSH";
/// The default remote shell: never asks for a password (nobody could type it), gives
/// up on a host that does not answer within 10 s, and notices one that stops
/// answering within 30 s.
pub const DEFAULT_RSH: &str = "ssh -T -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=10";

/// Variables of `ductile run`'s environment not given to ranks on other hosts: they
/// describe this host, this login or this terminal (`srun` leaves out the same kind).
const HOST_ONLY: [&str; 17] = [
    "HOSTNAME",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "DISPLAY",
    "XAUTHORITY",
    "TERM",
    "TMPDIR",
    "XDG_RUNTIME_DIR",
    "XDG_SESSION_ID",
    "DBUS_SESSION_BUS_ADDRESS",
    "KRB5CCNAME",
    "TMUX",
    "TMUX_PANE",
    "STY",
    "WINDOWID",
];

/// Prefixes of variables that describe one node, one task or the launcher's own
/// launcher (a batch system's per-node and per-task settings, devices, process-manager
/// wiring): the remote side's own values, if any, stay.
const NODE_ONLY_PREFIXES: [&str; 9] =
    ["SSH_", "DUCTILE_CONTROL", "SLURM_STEP_", "SLURM_TOPOLOGY_", "PMI_", "PMIX_", "OMPI_", "PRTE_", "FLUX_TASK_"];
/// Variables that describe one node or task of a batch job, or its devices.
const NODE_ONLY: [&str; 14] = [
    "SLURMD_NODENAME",
    "SLURM_NODEID",
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "SLURM_CPUS_ON_NODE",
    "SLURM_TASK_PID",
    "SLURM_GTIDS",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_JOB_CPUS_PER_NODE_LOCAL",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK",
];

/// Which variables of `ductile run`'s environment ranks on other hosts get.
fn forwarded(name: &str) -> bool {
    !HOST_ONLY.contains(&name)
        && !NODE_ONLY.contains(&name)
        && !NODE_ONLY_PREFIXES.iter().any(|p| name.starts_with(p))
        && name != super::TEST_KEY_ENV
}

/// Whether this process's stdin is a file or a pipe (data meant for rank 0), not a
/// terminal or `/dev/null`.
fn stdin_is_data() -> bool {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat fills `st` for an open descriptor, or fails and leaves it unread.
    if unsafe { libc::fstat(0, st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstat succeeded, so `st` is initialised.
    let mode = unsafe { st.assume_init() }.st_mode & libc::S_IFMT;
    mode == libc::S_IFIFO || mode == libc::S_IFREG
}

/// A path the remote shell passes through the other host's shell as it is: no
/// quoting is needed.
fn shell_safe(path: &str) -> bool {
    !path.is_empty() && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._-+,:@%=".contains(&b))
}

/// Listens on each address of this host for agents on other hosts; returns the
/// addresses they may reach it at (this host's IPv4 interfaces, loopback left out).
///
/// A peer that connects must prove the job key before anything is read beyond the
/// handshake's fixed-size messages: at most [`MAX_GREETINGS`] connections are greeted
/// at once (more are closed at once), each within [`GREET_TIMEOUT`] in all, and
/// refusals are logged a few times, then counted.
///
/// # Errors
/// No address to offer, or a listener cannot be bound.
pub async fn serve(
    job: JobId,
    key: JobKey,
    nodes: u32,
    tx: mpsc::UnboundedSender<Arrival>,
) -> anyhow::Result<Vec<SocketAddr>> {
    let ips: Vec<_> = crate::netaddr::local_addrs()?.into_iter().filter(std::net::IpAddr::is_ipv4).collect();
    anyhow::ensure!(!ips.is_empty(), "this host has no IPv4 address (other than loopback) for other hosts to reach");
    let me = auth::Identity { job, key, rank: CONTROLLER_RANK };
    let greeting = Arc::new(Semaphore::new(MAX_GREETINGS));
    let waiting = Arc::new(Semaphore::new(MAX_WAITING));
    let refused = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::with_capacity(ips.len());
    for ip in ips {
        let listener = TcpListener::bind((ip, 0)).await?;
        addrs.push(listener.local_addr()?);
        let (me, tx, greeting, refused) = (me.clone(), tx.clone(), greeting.clone(), refused.clone());
        let waiting = waiting.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((s, from)) => {
                        let Ok(waiting) = waiting.clone().try_acquire_owned() else {
                            note_refusal(&refused, from, "too many connections are waiting to be greeted");
                            continue;
                        };
                        let (me, tx, refused, greeting) = (me.clone(), tx.clone(), refused.clone(), greeting.clone());
                        tokio::spawn(async move {
                            let _ = s.set_nodelay(true);
                            let _ = crate::netaddr::keep_alive(&s);
                            // The wait for a turn counts in the greeting's time.
                            let greeted = tokio::time::timeout(GREET_TIMEOUT, async {
                                let _turn = greeting.acquire_owned().await;
                                greet(s, &me, nodes, tx).await
                            })
                            .await;
                            drop(waiting);
                            match greeted {
                                Ok(Ok(())) => {}
                                // An agent that got through at another of this host's
                                // addresses first drops the rest of its attempts.
                                Ok(Err(e)) if closed_early(&e) => tracing::debug!("control listener: {from} hung up"),
                                Ok(Err(e)) => note_refusal(&refused, from, &format!("{e:#}")),
                                Err(_) => note_refusal(&refused, from, "it did not finish its greeting in time"),
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!("control listener: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
    }
    Ok(addrs)
}

/// Whether a greeting failed because the peer closed before it said anything wrong.
fn closed_early(e: &anyhow::Error) -> bool {
    let eof = |io: &std::io::Error| io.kind() == std::io::ErrorKind::UnexpectedEof;
    match (e.downcast_ref::<auth::HandshakeError>(), e.downcast_ref::<ductile::bootstrap::ControlError>()) {
        (Some(auth::HandshakeError::Io(io)), _) => eof(io),
        (_, Some(ductile::bootstrap::ControlError::Io(io))) => eof(io),
        _ => false,
    }
}

/// Logs a refused connection: the first [`LOGGED_REFUSALS`] each, then every 100th.
fn note_refusal(count: &AtomicU64, from: SocketAddr, why: &str) {
    let n = count.fetch_add(1, Ordering::Relaxed) + 1;
    if n <= LOGGED_REFUSALS {
        tracing::warn!("control listener: refused {from}: {why}");
    } else if n.is_multiple_of(100) {
        tracing::warn!("control listener: {n} connections refused so far (the last from {from}: {why})");
    }
}

/// Authenticates a TCP connection (the peer claims a node of the pool and must prove
/// the job key) and reads its hello: only an agent's is accepted over TCP.
async fn greet<S>(mut s: S, me: &auth::Identity, nodes: u32, tx: mpsc::UnboundedSender<Arrival>) -> anyhow::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let node = auth::accept(&mut s, me, |r| r.0 < nodes, GREET_TIMEOUT).await?;
    let hello = tokio::time::timeout(GREET_TIMEOUT, nonblocking::read_msg::<Hello>(&mut s)).await??;
    match hello {
        Hello::Agent { node: claimed, token, pid } if claimed == NodeId(node.0) => {
            let (rx, w) = tokio::io::split(s);
            let arrival = Arrival::Agent { node: claimed, token, pid, rx: Box::new(rx), tx: Box::new(w), remote: true };
            let _ = tx.send(arrival);
            Ok(())
        }
        Hello::Agent { node: claimed, .. } => anyhow::bail!("authenticated as node {} but claims {claimed}", node.0),
        Hello::Probe => Ok(()),
        other => anyhow::bail!("{other:?} is only taken on the control socket"),
    }
}

/// What the agents of a job on `pool` need to know, with the controller reachable at
/// `controller`.
///
/// # Errors
/// The launcher's own path cannot be passed through a remote shell.
pub async fn network(rsh: &[String], hosts: &[String], controller: Vec<SocketAddr>) -> anyhow::Result<Network> {
    let exe = std::env::current_exe()?.to_string_lossy().into_owned();
    anyhow::ensure!(shell_safe(&exe), "the launcher's path {exe:?} cannot be passed through a remote shell unquoted");
    let cwd = std::env::current_dir().map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
    let mut env = Vec::new();
    for (k, v) in std::env::vars_os() {
        match (k.into_string(), v.into_string()) {
            (Ok(k), Ok(v)) if forwarded(&k) => env.push((k, v)),
            (Ok(_), Ok(_)) => {}
            (k, _) => {
                let name = k.unwrap_or_else(|k| k.to_string_lossy().into_owned());
                crate::say_errln!("ductile: {name} is not valid UTF-8; ranks on other hosts do not get it");
            }
        }
    }
    let here = here(hosts, &controller).await;
    let heartbeat_loss_ms = heartbeat_loss().as_millis().try_into().unwrap_or(u64::MAX);
    let log = std::env::var("DUCTILE_LOG").ok().filter(|f| shell_safe(f));
    Ok(Network { controller, rsh: rsh.to_vec(), exe, env, cwd, here, heartbeat_loss_ms, log })
}

/// Tests only: [`HEARTBEAT_LOSS`](crate::proto::HEARTBEAT_LOSS) in ms, so that a test
/// can see an agent end its node world without waiting for the real one. Only debug
/// builds (which the tests run) honour it.
pub const TEST_HEARTBEAT_LOSS_ENV: &str = "DUCTILE_TEST_HEARTBEAT_LOSS_MS";

/// The silence after which agents on other hosts end their node worlds.
fn heartbeat_loss() -> Duration {
    let asked =
        std::env::var(TEST_HEARTBEAT_LOSS_ENV).ok().and_then(|v| v.parse().ok()).filter(|_| cfg!(debug_assertions));
    asked.map_or(crate::proto::HEARTBEAT_LOSS, Duration::from_millis)
}

/// Time allowed to resolve the other hosts' names when choosing [`Network::here`].
const RESOLVE_LIMIT: Duration = Duration::from_secs(2);

/// The address ranks on this host bind to: this host's end of the route to the first
/// other host whose name resolves (a name the remote shell reaches is on the network
/// the job uses), else the first of `controller` (test hosts in namespaces, whose
/// names are no host names).
///
/// The names resolve on a thread of their own, in order, the first [`RESOLVED_HOSTS`]
/// at most, for [`RESOLVE_LIMIT`] in all: a resolver that hangs (no DNS reachable) must
/// neither hold up the job nor its end, which a blocking task of the runtime would.
async fn here(hosts: &[String], controller: &[SocketAddr]) -> std::net::IpAddr {
    let names: Vec<String> =
        hosts.iter().filter(|h| !crate::hosts::is_local(h)).take(RESOLVED_HOSTS).cloned().collect();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let resolving = std::thread::Builder::new().name("ductile-resolve".into()).spawn(move || {
        let route = |host: &String| {
            let addr =
                std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), 22)).ok()?.find(SocketAddr::is_ipv4)?;
            crate::netaddr::route_source(addr).ok().filter(|ip| !ip.is_loopback())
        };
        let _ = tx.send(names.iter().find_map(route));
    });
    let found = match resolving {
        Ok(_) => tokio::time::timeout(RESOLVE_LIMIT, rx).await.ok().and_then(Result::ok).flatten(),
        Err(_) => None,
    };
    found.unwrap_or_else(|| {
        controller.first().map_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), SocketAddr::ip)
    })
}

/// Most other hosts' names tried when choosing [`here`].
const RESOLVED_HOSTS: usize = 8;

impl super::Ctl {
    /// Tells every connected agent on another host that the controller is alive.
    pub(super) async fn heartbeat(&mut self) {
        for a in 0..self.agents.len() {
            let ag = &self.agents[a];
            if ag.remote && ag.tx.is_some() && !ag.done {
                self.send(a, &crate::proto::ToAgent::Heartbeat).await;
            }
        }
    }

    /// The host of `node` if it is another than this one.
    pub(super) fn remote_host(&self, node: NodeId) -> Option<&str> {
        let name = self.spec.hosts.as_ref()?.names.get(node.0 as usize)?;
        (self.network.is_some() && !crate::hosts::is_local(name)).then_some(name.as_str())
    }

    /// The host of `node` as agents on any host name it: as the user wrote it, but
    /// this host by its name, not as `localhost` or a loopback address.
    pub(super) fn host_name(&self, node: NodeId) -> Option<String> {
        let name = self.spec.hosts.as_ref()?.names.get(node.0 as usize)?;
        match crate::hosts::is_loopback(name) {
            true => crate::netaddr::hostname().ok().or_else(|| Some(name.clone())),
            false => Some(name.clone()),
        }
    }

    /// `e` for the user: the node named with its host, on a job on hosts.
    pub(super) fn explain(&self, e: &Ending) -> String {
        let text = e.describe();
        let node = match e {
            Ending::Rank(_, n, _) | Ending::Node(n, _) => *n,
            _ => return text,
        };
        match self.host_name(node) {
            Some(h) => text.replacen(&node.to_string(), &format!("{node} ({h})"), 1),
            None => text,
        }
    }

    /// Names the host of every node world `o` and its subtree start, and its
    /// processes' binding slots (from `slots`).
    pub(super) fn place(&self, o: &mut crate::proto::SpawnOrder, slots: &HashMap<Rank, u32>) {
        o.host = self.host_name(o.node);
        o.slots = o.ids.iter().filter_map(|r| slots.get(r).copied()).collect();
        for s in &mut o.spawns {
            self.place(s, slots);
        }
    }

    /// Starts node `node`'s agent here, with a channel as fd 3.
    pub(super) fn start_local_agent(&self, node: NodeId) -> anyhow::Result<(Child, ChannelRead, ChannelWrite)> {
        let exe = crate::spawn::own_exe()?;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let input = stdin_for(node, self.spec.adopt.is_some());
        // A node world of its own, ended with the controller.
        let setup = Setup { new_group: true, parent_death: true, cpus: None };
        let child = spawn_with_channel(exe.as_os_str(), &["agent"], &theirs, setup, (input, Output::Inherit), None)?;
        drop(theirs);
        ours.set_nonblocking(true)?;
        let (rx, tx) = UnixStream::from_std(ours)?.into_split();
        Ok((child, Box::new(rx), Box::new(tx)))
    }

    /// Starts agent `idx` (of node `node`) on `host` through the remote shell, in a task:
    /// at most [`REMOTE_FANOUT`] remote shells connect at once (as pdsh's fan-out), the
    /// job's signals and limits stay live meanwhile, and each host's handoff runs within
    /// the agent's join limit, so that its precise reason is what the user sees. The
    /// remote shell ([`Event::ShellStarted`]) and then the channel ([`Event::HandedOff`])
    /// come back as events.
    pub(super) fn start_remote_agent(&self, idx: usize, host: &str, msg: ToAgent) {
        let Some(net) = self.network.clone() else { return };
        if self.agents[idx].node == NodeId(0) && stdin_is_data() {
            crate::say_errln!("ductile: rank 0 runs on {host}: the launcher's stdin is not passed on to it");
        }
        let (events, limit, host) = (self.events.clone(), super::agent_join_limit(self.fence_limit), host.to_owned());
        let (fanout, closing) = (self.fanout.clone(), self.closing.clone());
        tokio::spawn(async move {
            let Ok(_turn) = fanout.acquire_owned().await else { return };
            if closing.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            let (child, mut rx, mut tx) = match crate::spawn::spawn_remote(&net, &host, true) {
                Ok(started) => started,
                Err(e) => {
                    let hint = if e.raw_os_error() == Some(libc::EMFILE) { " (raise `ulimit -n`)" } else { "" };
                    let why = format!("cannot start the remote shell `{}`: {e}{hint}", net.rsh.join(" "));
                    let _ = events.send(Event::HandedOff(idx, Err(why)));
                    return;
                }
            };
            let _ = events.send(Event::ShellStarted(idx, child));
            let r = crate::spawn::hand_off_remote(&mut rx, &mut tx, &msg, limit).await;
            let _ = events.send(Event::HandedOff(idx, r.map(|pid| (rx, tx, pid))));
        });
    }
}

/// Most remote shells connecting at once.
pub const REMOTE_FANOUT: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Token;

    fn ident(rank: Rank, key: u8) -> auth::Identity {
        auth::Identity { job: JobId(7), key: JobKey::from_bytes([key; 32]), rank }
    }

    /// An agent of node `node` holding key `key` says `hello` to a controller of a
    /// pool of 2 nodes; returns what the controller made of it and what arrived.
    async fn greeted(node: u32, key: u8, hello: Hello) -> (anyhow::Result<()>, Option<Arrival>) {
        let (mut agent, controller) = tokio::io::duplex(4096);
        let (tx, mut arrivals) = mpsc::unbounded_channel();
        let serve = tokio::spawn(async move { greet(controller, &ident(CONTROLLER_RANK, 1), 2, tx).await });
        let me = ident(Rank(node), key);
        if auth::dial(&mut agent, &me, CONTROLLER_RANK, Duration::from_secs(5)).await.is_ok() {
            nonblocking::write_msg(&mut agent, &hello).await.unwrap();
        }
        drop(agent);
        let result = serve.await.unwrap();
        (result, arrivals.try_recv().ok())
    }

    #[tokio::test]
    async fn only_an_agent_with_the_key_and_its_own_node_arrives() {
        let agent = |node| Hello::Agent { node: NodeId(node), token: Token([3; 32]), pid: 42 };
        match greeted(1, 1, agent(1)).await {
            (Ok(()), Some(Arrival::Agent { node, pid, remote, .. })) => {
                assert_eq!((node, pid, remote), (NodeId(1), 42, true));
            }
            (r, _) => panic!("refused: {r:?}"),
        }
        let refused = [
            // The agent sees the controller's proof fail first, and hangs up.
            (greeted(1, 2, agent(1)).await, "eof"),
            (greeted(1, 1, agent(0)).await, "claims node 0"),
            (greeted(2, 1, agent(2)).await, "not a member"),
            (greeted(1, 1, Hello::Status).await, "only taken on the control socket"),
        ];
        for ((result, arrival), why) in refused {
            let e = format!("{:#}", result.expect_err(why));
            assert!(arrival.is_none(), "{why}: something arrived");
            assert!(e.contains(why), "{why}: {e}");
        }
    }

    #[test]
    fn host_only_variables_stay_here() {
        for v in [
            "HOSTNAME",
            "SSH_AUTH_SOCK",
            "DUCTILE_CONTROL_FD",
            "DISPLAY",
            super::super::TEST_KEY_ENV,
            "SLURM_PROCID",
            "SLURM_STEP_ID",
            "CUDA_VISIBLE_DEVICES",
            "PMIX_RANK",
            "OMPI_COMM_WORLD_RANK",
        ] {
            assert!(!forwarded(v), "{v}");
        }
        for v in ["PATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "DUCTILE_LOG", "HOME", "SLURM_JOB_ID"] {
            assert!(forwarded(v), "{v}");
        }
    }

    #[test]
    fn only_plain_paths_go_through_a_remote_shell() {
        assert!(shell_safe("/usr/local/bin/ductile"));
        assert!(shell_safe("/work/target/release/ductile-1.0_x"));
        for bad in ["", "/a b/ductile", "/x;rm", "/x$(y)", "/x`y`", "/x'y", "/x\"y", "/x\\y", "/x\ny", "/x*"] {
            assert!(!shell_safe(bad), "{bad:?}");
        }
    }
}
