//! Messages between the controller and its agents, over each agent's control channel
//! (length-prefixed postcard, as in `ductile::bootstrap`).

use crate::output::Stream;
use crate::plan::resize::Target;
use ductile::bootstrap::{FromRank, Membership, ToRank, TransportSpec};
use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;

/// The reading half of a control channel: a Unix socket, a TCP connection, or a
/// remote shell's stdout.
pub type ChannelRead = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
/// The writing half of a control channel.
pub type ChannelWrite = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

/// What an agent started through a remote shell writes first on its stdout, so that
/// whoever started it can tell its channel from what a shell start-up file printed
/// (and an agent of another version from this one); its pid (4 bytes, little-endian)
/// follows.
pub const STDIO_MAGIC: &[u8; 16] = b"\0ductile-agent8\n";

/// Version of the agent handoff.
pub const AGENT_VERSION: u32 = 10;

/// Everything an agent needs to start its node world.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentHandoff {
    /// Must be [`AGENT_VERSION`].
    pub version: u32,
    /// The job.
    pub job: JobId,
    /// The job key (passed on to ranks over their private channels).
    pub key: JobKey,
    /// This agent's node.
    pub node: NodeId,
    /// Endpoint ids of the processes this node world runs.
    pub ids: Vec<Rank>,
    /// What each rank is bound to (`--bind-to`).
    pub bind_to: crate::bind::BindTo,
    /// The binding slot of each of `ids` on this host (see [`crate::bind`]); empty when
    /// ranks are not bound.
    pub slots: Vec<u32>,
    /// Say where each rank was bound (`--report-bindings`).
    pub report_bindings: bool,
    /// The program (an absolute path, resolved by the controller).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Transport backend and its settings.
    pub transport: TransportSpec,
    /// How registered data moves at a change.
    pub redistribution: ductile::Method,
    /// Constant items move in the background (`--background`).
    pub background: bool,
    /// Timeout of every wait inside ranks, ms.
    pub timeout_ms: u64,
    /// Time each rank (and each node world this agent starts) has to come up, ms.
    pub join_timeout_ms: u64,
    /// Prefix output lines with `[rank]`.
    pub tag_output: bool,
    /// A failed process is a shrink of the job (`--on-failure shrink`).
    pub recover: bool,
    /// The controller's socket (agents started by a resize connect to it).
    pub socket: String,
    /// Set for a node world started by a resize.
    pub joining: Option<Joining>,
    /// Set for the first node world of a program started alone: its rank is that
    /// running process, reached through this socket, not a process the agent starts.
    pub adopt: Option<Adopt>,
    /// Set when the job spans hosts.
    pub network: Option<Network>,
    /// This agent was started through the remote shell: its channel to whoever started
    /// it is its stdin and stdout, and its ranks' output goes to the controller as
    /// [`FromAgent::Output`].
    pub remote: bool,
}

/// What the node worlds of a job that spans hosts need to reach each other.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Network {
    /// The controller's TCP addresses: agents started on other hosts by a resize
    /// connect to the first that answers, and every agent binds its ranks to its own
    /// address on the route to the first.
    pub controller: Vec<SocketAddr>,
    /// The remote shell: the words before the host name (`ssh -T -o BatchMode=yes ...`).
    pub rsh: Vec<String>,
    /// The launcher's path, the same on every host.
    pub exe: String,
    /// `ductile run`'s environment, given to the ranks on other hosts (as `srun` does;
    /// names that describe one host or session are left out).
    pub env: Vec<(String, String)>,
    /// `ductile run`'s working directory, the ranks' on other hosts where it exists.
    pub cwd: String,
    /// The address node worlds on the controller's host bind their ranks to: the one
    /// on the route to the first other host whose name resolves, else the first of
    /// `controller`.
    pub here: std::net::IpAddr,
    /// Silence from the controller after which an agent on another host ends its node
    /// world, ms ([`HEARTBEAT_LOSS`]; tests shorten it).
    pub heartbeat_loss_ms: u64,
    /// `DUCTILE_LOG` of `ductile run`, passed to agents started through the remote
    /// shell (on their command line: it is no secret, and checked to need no quoting).
    pub log: Option<String>,
}

/// A running process an agent adopts as its node world's rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adopt {
    /// The Unix socket the process listens on.
    pub socket: String,
    /// Its pid.
    pub pid: u32,
}

/// How a node world started by a resize names itself to the controller, and what it
/// starts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Joining {
    /// Proof of who this agent is, sent in its [`Hello`].
    pub token: Token,
    /// Node worlds this one starts in turn.
    pub spawns: Vec<SpawnOrder>,
}

/// A random one-time secret naming one agent to the controller.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Token(pub [u8; 32]);

impl Token {
    /// A fresh token.
    ///
    /// # Errors
    /// The random source failed.
    pub fn random() -> Result<Self, getrandom::Error> {
        let mut t = [0u8; 32];
        getrandom::fill(&mut t)?;
        Ok(Self(t))
    }

    /// Constant-time comparison.
    #[must_use]
    pub fn matches(&self, other: &Self) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// One node world to start during a growth.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpawnOrder {
    /// The spawning process (its position in the spawn plan): the orders of one
    /// spawner run one after another, those of different spawners side by side.
    pub spawner: u32,
    /// Step of the plan.
    pub step: u32,
    /// Node of the new world.
    pub node: NodeId,
    /// Endpoint ids of its processes.
    pub ids: Vec<Rank>,
    /// Their binding slots on their host (empty when ranks are not bound).
    pub slots: Vec<u32>,
    /// The host it runs on, for a job that spans hosts (unset: the spawner's).
    pub host: Option<String>,
    /// The new agent's token.
    pub token: Token,
    /// What the new world starts in turn.
    pub spawns: Vec<SpawnOrder>,
}

/// Controller → agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToAgent {
    /// The first message.
    Handoff(Box<AgentHandoff>),
    /// The job's first membership (the start-up fence).
    Membership(Membership),
    /// Start these node worlds (and, through them, their subtrees), for the growth
    /// with this sequence number (echoed in the report).
    Grow {
        /// The growth's sequence number.
        seq: u32,
        /// The node worlds this agent's ranks spawn.
        orders: Vec<SpawnOrder>,
    },
    /// Pass a message to one of the node's ranks.
    ToRank(Rank, ToRank),
    /// End these ranks (released ones that did not leave in time).
    End(Vec<Rank>),
    /// End the node world now.
    Abort,
    /// Deliver this signal (SIGUSR1 or SIGUSR2, forwarded from `ductile run`) to every
    /// rank of the node.
    Signal(i32),
    /// The controller is alive (sent every [`HEARTBEAT`] to agents on other hosts).
    Heartbeat,
}

/// How often the controller tells agents on other hosts that it is alive.
pub const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);
/// Silence after which an agent on another host ends its node world: the controller
/// or the network to it is gone (a connection to a host that vanished may never say
/// so).
pub const HEARTBEAT_LOSS: std::time::Duration = std::time::Duration::from_secs(30);

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
    /// An adopted process (not the agent's child, so its status is its own parent's)
    /// that left the job without finalizing: it ended, or closed its channel.
    Left,
}

impl Exit {
    /// The shell's view of it: the code, or 128 + signal.
    #[must_use]
    pub fn code(self) -> i32 {
        match self {
            Self::Code(c) => c,
            Self::Signal(s) => 128 + s,
            Self::Left => 1,
        }
    }

    /// From a process's wait status.
    #[must_use]
    pub fn from_status(s: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (s.code(), s.signal()) {
            (Some(c), _) => Self::Code(c),
            (None, Some(sig)) => Self::Signal(sig),
            (None, None) => Self::Code(1),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(c) => write!(f, "exited with code {c}"),
            Self::Signal(s) => write!(f, "was killed by signal {s}"),
            Self::Left => f.write_str("left the job without finalizing"),
        }
    }
}

/// One started rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankStarted {
    /// Its endpoint id.
    pub id: Rank,
    /// Its pid.
    pub pid: u32,
    /// Its endpoint address.
    pub addr: EndpointAddr,
}

/// A node world that came up during a growth.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStarted {
    /// Its node.
    pub node: NodeId,
    /// Its agent's pid.
    pub agent_pid: u32,
    /// Its ranks.
    pub ranks: Vec<RankStarted>,
}

/// Agent → controller (and a started agent → the agent that started it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FromAgent {
    /// A started agent has taken over its node world (it reached the controller); its
    /// ranks and its own spawn orders start next. Sent to its spawner only.
    Started,
    /// Every rank of the node is started and bound.
    Ready(Vec<RankStarted>),
    /// The node worlds of a subtree of a growth are up.
    Grown(Vec<NodeStarted>),
    /// A message from one of the node's ranks.
    Rank(Rank, FromRank),
    /// A rank ended.
    RankExited {
        /// Which (endpoint id).
        rank: Rank,
        /// How.
        exit: Exit,
    },
    /// The node world could not start or broke.
    Failed(String),
    /// To the controller: how the node worlds a `Grow` asked for came up (or why they
    /// did not). The sequence number tells a late report of a growth that was given up
    /// from one of the growth under way.
    GrowthReport {
        /// The `Grow`'s sequence number.
        seq: u32,
        /// The node worlds started, or why they failed.
        result: Result<Vec<NodeStarted>, String>,
    },
    /// Output of the node's ranks, from an agent on another host (one on the
    /// controller's host writes it to the stdout and stderr it shares with the
    /// controller).
    Output(Stream, Vec<u8>),
    /// Every rank ended and its output is forwarded; the agent exits next.
    Done,
}

/// The first message on the controller's socket.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Hello {
    /// An agent started by a resize.
    Agent {
        /// Its node.
        node: NodeId,
        /// The token from its handoff.
        token: Token,
        /// Its pid (on its host; over the Unix socket, the socket's credentials
        /// count).
        pid: u32,
    },
    /// `ductile resize`.
    Resize(Target),
    /// `ductile status`: the controller answers with a [`String`], the job's layout.
    Status,
    /// Over TCP: an agent on another host finding its address on a path to the
    /// controller (it closes next).
    Probe,
}

/// The controller's answers to `ductile resize`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResizeReply {
    /// Accepted; it happens at the job's next checkpoint.
    Queued,
    /// Refused, with the reason; the job is unchanged.
    Refused(String),
    /// Done, with a summary.
    Done(String),
    /// It failed (and so did the job), with the reason.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile::bootstrap::read_msg;

    proptest::proptest! {
        /// Whatever bytes reach the controller's socket, an agent's channel or a
        /// `ductile resize` client: a message or an error, never a panic.
        #[test]
        fn any_bytes_decode_to_a_message_or_an_error(body: Vec<u8>) {
            let mut framed = u32::try_from(body.len()).unwrap().to_le_bytes().to_vec();
            framed.extend_from_slice(&body);
            let _ = read_msg::<Hello>(&mut &framed[..]);
            let _ = read_msg::<ToAgent>(&mut &framed[..]);
            let _ = read_msg::<FromAgent>(&mut &framed[..]);
            let _ = read_msg::<ResizeReply>(&mut &framed[..]);
            let _ = read_msg::<AgentHandoff>(&mut &framed[..]);
        }
    }
}
