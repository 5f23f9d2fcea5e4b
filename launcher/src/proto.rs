//! Messages between the controller and its agents, over each agent's control channel
//! (length-prefixed postcard, as in `ductile::bootstrap`).

use ductile_transport::{EndpointAddr, JobId, JobKey, NodeId, Rank};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Version of the agent handoff.
pub const AGENT_VERSION: u32 = 1;

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
    /// Number of nodes in the job.
    pub nodes: u32,
    /// Number of ranks in the job.
    pub size: u32,
    /// The ranks this node runs.
    pub ranks: Vec<Rank>,
    /// The program (an absolute path, resolved by the controller).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Transport backend.
    pub transport: String,
    /// Timeout of every wait inside ranks, ms.
    pub timeout_ms: u64,
    /// Time each rank has to join the job (bind and report its address), ms.
    pub join_timeout_ms: u64,
    /// Prefix output lines with `[rank]`.
    pub tag_output: bool,
}

/// Controller → agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToAgent {
    /// The first message.
    Handoff(AgentHandoff),
    /// The full address table (the fence).
    Peers(Vec<EndpointAddr>),
    /// End the node world now.
    Abort,
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Exit {
    /// The shell's view of it: the code, or 128 + signal.
    #[must_use]
    pub fn code(self) -> i32 {
        match self {
            Self::Code(c) => c,
            Self::Signal(s) => 128 + s,
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
        }
    }
}

/// One started rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankStarted {
    /// Its rank.
    pub rank: Rank,
    /// Its pid.
    pub pid: u32,
    /// Its endpoint address.
    pub addr: EndpointAddr,
}

/// Agent → controller.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FromAgent {
    /// Every rank of the node is started and bound.
    Ready(Vec<RankStarted>),
    /// A rank ended.
    RankExited {
        /// Which.
        rank: Rank,
        /// How.
        exit: Exit,
    },
    /// The node world could not start or broke.
    Failed(String),
    /// Every rank ended and its output is forwarded; the agent exits next.
    Done,
}
