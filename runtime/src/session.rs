//! Joining a job: [`init`] and the [`Session`] it returns.

use crate::bootstrap::{self, FromRank, RankHandoff, ToRank, HANDOFF_VERSION};
use crate::env::EnvSettings;
use crate::error::{Error, Result};
use crate::group::{AsyncGroup, Group};
use crate::pset::ProcessSet;
use ductile_transport::auth::Identity;
use ductile_transport::{Context, Endpoint, JobId, JobKey, Mailbox, NodeId, Rank, TransportConfig, TransportSetup};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Runtime;

/// Facts about the job this process belongs to.
#[derive(Clone, Debug)]
pub struct JobInfo {
    /// The job's id.
    pub job: JobId,
    /// The node this process runs on.
    pub node: NodeId,
    /// Number of nodes in the job.
    pub nodes: u32,
    /// Whether the process was started by the launcher (false: standalone, one rank).
    pub launched: bool,
    /// The transport backend in use.
    pub transport: String,
}

/// A process's membership in a job. Create it with [`init`]; end it with
/// [`Session::finalize`].
pub struct Session {
    world: Group,
    spin: Duration,
    timeout: Duration,
    info: JobInfo,
    endpoint: Endpoint,
    control: Option<UnixStream>,
    rt: Option<Runtime>,
}

static TAKEN: AtomicBool = AtomicBool::new(false);

/// The membership epoch (changes with reconfigurations).
const EPOCH: u64 = 0;

/// The context of a group built from a process set: FNV-1a over the epoch and ranks,
/// with the top bit set so it never equals the world's context 0. Every member derives
/// the same value on its own; distinct sets collide with probability 2^-31.
fn set_context(set: &ProcessSet) -> Context {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u32::from(*b);
            h = h.wrapping_mul(0x0100_0193);
        }
    };
    eat(&set.epoch().to_le_bytes());
    for r in set.ranks() {
        eat(&r.to_le_bytes());
    }
    Context(h | 0x8000_0000)
}

/// Joins the job this process was launched into, or, when started without the launcher,
/// forms a job of one rank (like MPI's singleton init).
///
/// # Collective
/// Every rank of a launched job calls it; it returns once all ranks' endpoints are known.
///
/// # Errors
/// Bad `DUCTILE_*` settings, a control channel that is not from this process's agent,
/// a refused handoff, or a transport that cannot bind. Calling it twice is an error.
pub fn init() -> Result<Session> {
    init_logging();
    if TAKEN.swap(true, Ordering::AcqRel) {
        return Err(Error::Invalid("ductile::init was already called in this process".into()));
    }
    let env = EnvSettings::from_env().map_err(Error::Bootstrap)?;
    if env.malloc_tuning {
        tune_malloc();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env.threads)
        .thread_name("ductile-progress")
        .enable_all()
        .build()
        .map_err(|e| Error::Bootstrap(format!("cannot start the progress runtime: {e}")))?;
    match env.control_fd {
        Some(fd) => launched(rt, &env, fd),
        None => standalone(rt, &env),
    }
}

/// Keeps large message buffers in the heap instead of fresh `mmap`s: received payloads
/// are allocated per message, and a fresh mapping per message costs a page fault per
/// 4 KiB (zeroing included), which halves streaming bandwidth. MPI libraries tune the
/// allocator for the same reason. Off with `DUCTILE_MALLOC_TUNING=0`.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc allocator parameters; both values are within
    // the documented ranges (32 MiB is the largest mmap threshold glibc accepts).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DUCTILE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Another subscriber installed by the application wins; that is fine.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn standalone(rt: Runtime, env: &EnvSettings) -> Result<Session> {
    let boot = |e: getrandom::Error| Error::Bootstrap(format!("random source failed: {e}"));
    let h = RankHandoff {
        version: HANDOFF_VERSION,
        job: JobId::random().map_err(boot)?,
        key: JobKey::random().map_err(boot)?,
        rank: Rank(0),
        size: 1,
        node: NodeId(0),
        nodes: 1,
        transport: "tcp".into(),
        timeout_ms: u64::try_from(env.timeout.as_millis()).unwrap_or(u64::MAX),
    };
    let endpoint = bind(&rt, &h)?;
    let table = vec![endpoint.transport().local_addr()];
    endpoint.transport().set_peers(&table)?;
    Session::assemble(rt, env, h, endpoint, None, false)
}

fn launched(rt: Runtime, env: &EnvSettings, fd: i32) -> Result<Session> {
    let mut control = bootstrap::take_control(fd).map_err(Error::Bootstrap)?;
    let boot = |e: bootstrap::ControlError| Error::Bootstrap(format!("control channel to the agent: {e}"));
    control.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| Error::Bootstrap(e.to_string()))?;
    let h = match bootstrap::read_msg::<ToRank>(&mut control).map_err(boot)? {
        ToRank::Handoff(h) if h.version == HANDOFF_VERSION => h,
        ToRank::Handoff(h) => {
            return Err(Error::Bootstrap(format!(
                "handoff version {} (this build speaks {HANDOFF_VERSION})",
                h.version
            )))
        }
        ToRank::Peers(_) => return Err(Error::Bootstrap("agent sent the address table before the handoff".into())),
    };
    let endpoint = bind(&rt, &h)?;
    bootstrap::write_msg(&mut control, &FromRank::Ready { addr: endpoint.transport().local_addr() }).map_err(boot)?;
    control
        .set_read_timeout(Some(Duration::from_millis(h.timeout_ms.max(1))))
        .map_err(|e| Error::Bootstrap(e.to_string()))?;
    let table = match bootstrap::read_msg::<ToRank>(&mut control).map_err(boot)? {
        ToRank::Peers(t) if t.len() == h.size as usize => t,
        ToRank::Peers(t) => {
            return Err(Error::Bootstrap(format!("address table of {} ranks for a job of {}", t.len(), h.size)))
        }
        ToRank::Handoff(_) => return Err(Error::Bootstrap("second handoff".into())),
    };
    endpoint.transport().set_peers(&table)?;
    control.set_read_timeout(None).map_err(|e| Error::Bootstrap(e.to_string()))?;
    Session::assemble(rt, env, h, endpoint, Some(control), true)
}

fn bind(rt: &Runtime, h: &RankHandoff) -> Result<Endpoint> {
    let mailbox = Arc::new(Mailbox::new());
    let setup = TransportSetup {
        identity: Identity { job: h.job, key: h.key.clone(), rank: h.rank },
        size: h.size,
        config: TransportConfig::default(),
        mailbox: mailbox.clone(),
    };
    let _guard = rt.enter();
    let t = ductile_transport::bind(&h.transport, setup)?;
    Ok(Endpoint::new(t, mailbox, h.rank))
}

impl Session {
    fn assemble(
        rt: Runtime,
        env: &EnvSettings,
        h: RankHandoff,
        endpoint: Endpoint,
        control: Option<UnixStream>,
        launched: bool,
    ) -> Result<Self> {
        let members: Vec<Rank> = (0..h.size).map(Rank).collect();
        let timeout = Duration::from_millis(h.timeout_ms);
        let world = AsyncGroup::new(endpoint.clone(), Context(0), members, h.rank.index(), timeout)?;
        let world = Group::new(world, rt.handle().clone(), env.spin);
        let info = JobInfo { job: h.job, node: h.node, nodes: h.nodes, launched, transport: h.transport };
        tracing::debug!("{} of {} joined job {} on {}", h.rank, h.size, h.job, h.node);
        Ok(Self { world, spin: env.spin, timeout, info, endpoint, control, rt: Some(rt) })
    }

    /// The group of every process in the job.
    #[must_use]
    pub fn world(&self) -> &Group {
        &self.world
    }

    /// A named process set of the current membership: `world` or `self`.
    ///
    /// # Local
    ///
    /// # Errors
    /// An unknown name.
    pub fn pset(&self, name: &str) -> Result<ProcessSet> {
        let (rank, size) = (self.world.rank() as u32, self.world.size() as u32);
        match name {
            "world" => Ok(ProcessSet::world(EPOCH, size)),
            "self" => Ok(ProcessSet::own(EPOCH, rank)),
            other => Err(Error::Invalid(format!("unknown process set {other:?} (known: world, self)"))),
        }
    }

    /// A group of the ranks of `set`, ordered by rank, with a context of its own.
    ///
    /// # Local
    /// Every member builds the same group independently: the context is derived from
    /// the set's epoch and ranks.
    ///
    /// # Errors
    /// The set is of another epoch, or this process is not in it.
    pub fn group(&self, set: &ProcessSet) -> Result<Group> {
        if set.epoch() != EPOCH {
            return Err(Error::Invalid(format!("{set} is not of the current membership")));
        }
        let me = self.endpoint.rank();
        let members: Vec<Rank> = set.ranks().map(Rank).collect();
        let pos = members
            .iter()
            .position(|r| *r == me)
            .ok_or_else(|| Error::Invalid(format!("this process ({me}) is not in {set}")))?;
        let g = AsyncGroup::new(self.endpoint.clone(), set_context(set), members, pos, self.timeout)?;
        let handle =
            self.rt.as_ref().map(|rt| rt.handle().clone()).ok_or(Error::Invalid("session is closed".into()))?;
        Ok(Group::new(g, handle, self.spin))
    }

    /// The address this process's endpoint listens on (for diagnostics and tests).
    #[must_use]
    pub fn local_addr(&self) -> String {
        self.endpoint.transport().local_addr().0
    }

    /// Facts about the job.
    #[must_use]
    pub fn info(&self) -> &JobInfo {
        &self.info
    }

    /// Leaves the job: waits for every rank (a barrier), says goodbye to connected
    /// peers and tells the agent.
    ///
    /// # Collective
    ///
    /// # Errors
    /// The barrier failed (a peer is gone or silent past the timeout).
    pub fn finalize(mut self) -> Result<()> {
        self.world.barrier()?;
        let t = self.endpoint.transport().clone();
        // Goodbyes are bounded by the transport's own timeouts; the group's timeout
        // bounds the whole call as well.
        self.world.block(async {
            t.close().await;
            Ok(())
        })?;
        if let Some(c) = self.control.as_mut() {
            // The agent may already be gone; finalizing locally is still complete.
            let _ = bootstrap::write_msg(c, &FromRank::Finalized);
        }
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // No network work here: stop the progress threads without waiting.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_contexts_are_deterministic_distinct_and_never_the_worlds() {
        let a = ProcessSet::new("a", 0, [1, 2, 3]);
        let same = ProcessSet::new("renamed", 0, [3, 2, 1]);
        assert_eq!(set_context(&a), set_context(&same));
        assert_ne!(set_context(&a), set_context(&ProcessSet::new("b", 0, [1, 2])));
        assert_ne!(set_context(&a), set_context(&ProcessSet::new("a", 1, [1, 2, 3])));
        assert!(set_context(&ProcessSet::world(0, 4)).0 >= 0x8000_0000);
    }
}
