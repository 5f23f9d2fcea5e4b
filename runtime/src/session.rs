//! Joining a job: [`init`] and the [`Session`] it returns.

use crate::bootstrap::{
    self, Change, CheckpointMode, Decision, FromRank, Membership, RankHandoff, SwitchTimes, ToRank, TransportSpec,
    HANDOFF_VERSION,
};
use crate::env::EnvSettings;
use crate::error::{Error, Result};
use crate::group::{AsyncGroup, Group, Memberships};
use crate::pset::ProcessSet;
use crate::redistribute::Method;
use crate::reduce::ReduceOp;
use crate::registry::{Manifest, Parts, Registry};
use ductile_transport::auth::Identity;
use ductile_transport::{Context, Endpoint, JobId, JobKey, Mailbox, NodeId, Rank, TransportSetup};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

mod adopt;
mod background;
mod control;
mod data;
mod recover;

pub use background::MoveHandle;
use background::Moving;
pub use recover::Recovery;

/// Facts about the job this process belongs to.
#[derive(Clone, Debug)]
pub struct JobInfo {
    /// The job's id.
    pub job: JobId,
    /// The node this process runs on.
    pub node: NodeId,
    /// Number of nodes in the job (in the current membership).
    pub nodes: u32,
    /// Whether the process was started by the launcher (false: standalone, one rank).
    pub launched: bool,
    /// The transport backend in use.
    pub transport: String,
    /// This process's endpoint id (stable across reconfigurations, unlike its rank).
    pub id: Rank,
}

/// A process's membership in a job. Create it with [`init`]; end it with
/// [`Session::finalize`].
pub struct Session {
    world: Group,
    /// The memberships this process has had (see [`Memberships`]).
    memberships: Memberships,
    spin: Duration,
    timeout: Duration,
    info: JobInfo,
    endpoint: Endpoint,
    control: Option<UnixStream>,
    /// Reads the control channel once the process has joined (see `control`).
    watcher: Option<control::Watcher>,
    /// A failed process is a shrink of the job (`--on-failure shrink`).
    recover: bool,
    rt: Option<Runtime>,
    membership: Membership,
    registry: Registry,
    /// How registered data moves unless an item says otherwise.
    method: Method,
    /// Checkpoints called so far.
    count: u64,
    /// A change needing new processes is under way (background checkpoints).
    pending: bool,
    /// Processes the application asked for, sent with the next checkpoint.
    want: Option<u32>,
    /// The change this process joined with, if it was started by a resize.
    joined: Option<Resize>,
    /// The latest change: its sequence number, the new ranks added, the old ranks removed.
    last_change: Option<(u32, Vec<u32>, Vec<u32>)>,
    /// The process left the group at a checkpoint.
    released: bool,
    /// Constant items move in the background (`--background`).
    background: bool,
    /// The share of time a background move may keep the processes busy
    /// (`DUCTILE_BACKGROUND_SHARE`).
    background_share: f64,
    /// A change whose constant items are moving in the background.
    moving: Option<Moving>,
    /// The epoch of a change whose data this process began to move and that it has
    /// not completed: its registered data is no longer that of its membership, whole.
    moved_for: Option<u64>,
    /// The blocking move of the change under way keeps the old blocks (with
    /// `--on-failure shrink`; see `Registry::redistribute`): this process's registered
    /// data is that of its membership, whole, until the change commits or is undone.
    keeping: bool,
    /// A change whose move this process finished but whose last collective lost a
    /// process: it commits ([`ToRank::Settled`]) or is undone (a recovery from the
    /// epoch before), as the controller decides.
    staged: Option<Staged>,
    /// Why a checkpoint failed, once one has: the process can only finalize.
    broken: Option<String>,
    /// The launcher this process started when, started alone, it grew (see `adopt`):
    /// `finalize` waits for it, so the job has ended when the process does.
    launcher: Option<std::process::Child>,
}

/// A change whose move is done, as it commits ([`Session::commit_change`]), or waits
/// to (`Session::staged`).
struct Staged {
    c: Change,
    transition: Group,
    tpos: usize,
    new_pos: Vec<Option<u32>>,
    overlap: Option<(Instant, Instant)>,
}

/// A change after the transition group agreed on the registry, before data moves.
struct Prepared {
    transition: Group,
    tpos: usize,
    members: Vec<Rank>,
    new_pos: Vec<Option<u32>>,
    parts: Parts,
    connect: Duration,
}

static TAKEN: AtomicBool = AtomicBool::new(false);

/// The failure flag of a background move meaning "the old processes finalized".
const ABANDONED: u64 = u64::MAX;

/// Bit of a transition group's context (world contexts have it clear).
const TRANSITION_CTX: u32 = 0x4000_0000;
/// Bits of the epoch in world and transition contexts.
const EPOCH_CTX_MASK: u64 = 0x3fff_ffff;

fn world_context(epoch: u64) -> Context {
    Context((epoch & EPOCH_CTX_MASK) as u32)
}

fn transition_context(epoch: u64) -> Context {
    Context(TRANSITION_CTX | (epoch & EPOCH_CTX_MASK) as u32)
}

/// The contexts of the change to `epoch` (its transition group and its background
/// moves): a failure notice of that epoch does not interrupt them (see `control`).
fn change_contexts(epoch: u64) -> [Context; 2] {
    [transition_context(epoch), background_context(epoch)]
}

/// Testing knob, `MEMBER:EPOCH`: the transition member it names aborts in the change to
/// EPOCH once the transition group is built, before the registry is agreed on and before
/// any data moves, so that the tests can check that such a change is abandoned and the
/// job recovers at the epoch before it.
const DIE_IN_PREPARE_ENV: &str = "DUCTILE_TEST_DIE_IN_PREPARE";
/// Testing knob, `MEMBER:EPOCH`: the transition member it names aborts in the change to
/// EPOCH once its data has moved, before the change's last collective, so that the tests
/// can check that the others, whose moves finished too, take the new group and recover
/// in it.
const DIE_AFTER_MOVE_ENV: &str = "DUCTILE_TEST_DIE_AFTER_MOVE";

/// Aborts this process if testing knob `env` names transition member `member` and
/// `epoch` (`MEMBER:EPOCH`), saying so with `when`.
fn dies_here(env: &'static str, member: usize, epoch: u64, when: &str) {
    let parse = || {
        let v = std::env::var(env).ok()?;
        let (m, e) = v.split_once(':')?;
        Some((m.parse::<usize>().ok()?, e.parse::<u64>().ok()?))
    };
    if parse() == Some((member, epoch)) {
        eprintln!("ductile: member {member} aborts {} ({env})", when.replace("{epoch}", &epoch.to_string()));
        std::process::abort();
    }
}

/// Waits until what this process sent for the move to `epoch` has left it for good
/// ([`ductile_transport::Transport::flush`]): a send completes once the transport has
/// the bytes, which may still be in this process (tcp's queue, quinn's buffers, a
/// rendezvous payload), and a process that died just after its move took them with it,
/// so that a new process missed part of its data and failed too. Peers that ended are
/// not waited for; a flush that fails is logged, and the targets' own receives say
/// what is missing.
fn flush_move(g: &Group, endpoint: &Endpoint, epoch: u64) {
    let ep = endpoint.clone();
    let limit = g.as_async().timeout();
    if let Err(e) = g.block(async move { ep.flush(limit).await.map_err(Error::from) }) {
        tracing::warn!("{}: the move to epoch {epoch} may not have reached every process: {e}", endpoint.rank());
    }
}

/// The context of a change's background moves: a transition context with the epoch's
/// bit 29 flipped (epochs never get near 2^29).
fn background_context(epoch: u64) -> Context {
    Context(TRANSITION_CTX | ((epoch ^ (1 << 29)) & EPOCH_CTX_MASK) as u32)
}

/// The context of a group built from a process set: FNV-1a over the epoch and ranks,
/// with the top bit set so it never equals a world or transition context. Every member
/// derives the same value on its own; distinct sets collide with probability 2^-31.
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

/// What a checkpoint found.
#[derive(Clone)]
#[non_exhaustive]
pub enum Checkpoint {
    /// No change: the group is the same.
    Unchanged,
    /// A change that needs new processes is under way; the group is the same for now
    /// (background checkpoints only).
    Pending,
    /// The group changed and this process is in the new one; registered data is
    /// already in its new place.
    Resized(Resize),
    /// This process is not in the new group. Its registered data has been handed over;
    /// it should call [`Session::finalize`] and exit.
    Released(Resize),
    /// Processes failed and the job went on without them (`ductile run --on-failure
    /// shrink`): a shrink it did not ask for. Registered data is in its new place, but
    /// what the failed processes held is lost (zero; [`Recovery::lost`] says where).
    Recovered(Recovery),
}

/// One change of the group, as seen by one process.
#[derive(Clone)]
pub struct Resize {
    /// Sequence number of the resource change (`rc/<seq>/...` process sets).
    pub seq: u32,
    /// The new membership epoch.
    pub epoch: u64,
    /// Group size before.
    pub old_size: usize,
    /// Group size after.
    pub new_size: usize,
    /// This process's rank before (`None`: it is new).
    pub old_rank: Option<usize>,
    /// Its rank after (`None`: it was released).
    pub new_rank: Option<usize>,
    /// The new rank of every old rank (`None`: released), indexed by old rank.
    pub mapping: Vec<Option<usize>>,
    /// The new ranks that are new processes.
    pub added: Vec<usize>,
    /// The group of every process taking part in the change: the old ranks in old order
    /// (positions `0..old_size`), then the new processes in new rank order. Use it to
    /// move data the registry does not hold.
    pub transition: Group,
    /// For a change whose constant items moved in the background while this process
    /// computed (`--background`): when the move started and when this process saw it
    /// finish. Iterations that ended in between overlapped it.
    pub overlap: Option<(Instant, Instant)>,
}

impl Resize {
    /// The transition-group position of new rank `r`.
    #[must_use]
    pub fn transition_rank_of_new(&self, r: usize) -> Option<usize> {
        if let Some(old) = self.mapping.iter().position(|m| *m == Some(r)) {
            return Some(old);
        }
        self.added.iter().position(|&a| a == r).map(|k| self.old_size + k)
    }
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
    crate::block::set_huge_pages(env.huge_pages);
    crate::pages::set_handover(env.page_handover);
    crate::anon::set_recycling(env.page_recycle);
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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal, not in log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn standalone(rt: Runtime, env: &EnvSettings) -> Result<Session> {
    let boot = |e: getrandom::Error| Error::Bootstrap(format!("random source failed: {e}"));
    let h = RankHandoff {
        version: HANDOFF_VERSION,
        job: JobId::random().map_err(boot)?,
        key: JobKey::random().map_err(boot)?,
        id: Rank(0),
        node: NodeId(0),
        transport: TransportSpec::named("tcp"),
        timeout_ms: u64::try_from(env.timeout.as_millis()).unwrap_or(u64::MAX),
        joining: false,
        redistribution: Method::default(),
        background: false,
        tag_output: false,
        recover: false,
    };
    let endpoint = bind(&rt, &h)?;
    let m = Membership {
        epoch: 0,
        ranks: vec![Rank(0)],
        nodes: vec![NodeId(0)],
        addrs: vec![endpoint.transport().local_addr()],
    };
    endpoint.transport().set_peers(&m.addrs)?;
    Session::assemble(rt, env, &h, endpoint, None, m)
}

fn launched(rt: Runtime, env: &EnvSettings, fd: i32) -> Result<Session> {
    let mut control = bootstrap::take_control(fd).map_err(Error::Bootstrap)?;
    set_read_timeout(&control, Duration::from_secs(60))?;
    let h = match bootstrap::read_msg::<ToRank>(&mut control).map_err(control_err)? {
        ToRank::Handoff(h) if h.version == HANDOFF_VERSION => h,
        ToRank::Handoff(h) => {
            return Err(Error::Bootstrap(format!(
                "handoff version {} (this build speaks {HANDOFF_VERSION})",
                h.version
            )))
        }
        other => return Err(Error::Bootstrap(format!("expected the handoff from the agent, got {other:?}"))),
    };
    crate::launch::set_job(&h);
    let endpoint = match bind(&rt, &h) {
        Ok(e) => e,
        Err(e) => {
            // Best effort: the error is returned whether or not the agent hears it.
            let _ = bootstrap::write_msg(&mut control, &FromRank::Failed { reason: e.to_string() });
            return Err(e);
        }
    };
    bootstrap::write_msg(&mut control, &FromRank::Ready { addr: endpoint.transport().local_addr() })
        .map_err(control_err)?;
    set_read_timeout(&control, Duration::from_millis(h.timeout_ms.max(1)))?;
    let first = bootstrap::read_msg::<ToRank>(&mut control).map_err(control_err)?;
    match (h.joining, first) {
        (false, ToRank::Membership(m)) => {
            endpoint.transport().set_peers(&m.addrs)?;
            Session::assemble(rt, env, &h, endpoint, Some(control), m)
        }
        (true, ToRank::Decision(Decision::Change(c))) => {
            // Until the change is applied the process is a group of its own.
            let alone = Membership { epoch: c.after.epoch, ranks: vec![h.id], nodes: vec![h.node], addrs: Vec::new() };
            let mut s = Session::assemble(rt, env, &h, endpoint, Some(control), alone)?;
            let joined = match s.apply_change(c, true) {
                Ok(Checkpoint::Resized(r)) => r,
                Ok(_) => return Err(Error::Bootstrap("started by a resize but not part of the new group".into())),
                Err(e) => {
                    s.count = 0; // reported as joining, whatever the checkpoint
                    return Err(s.broken_by(e));
                }
            };
            s.joined = Some(joined);
            Ok(s)
        }
        (joining, other) => Err(Error::Bootstrap(format!(
            "unexpected first message from the agent for a {} process: {other:?}",
            if joining { "joining" } else { "starting" }
        ))),
    }
}

fn control_err(e: bootstrap::ControlError) -> Error {
    Error::Bootstrap(format!("control channel to the agent: {e}"))
}

fn set_read_timeout(c: &UnixStream, t: Duration) -> Result<()> {
    c.set_read_timeout(Some(t)).map_err(|e| Error::Bootstrap(format!("control channel: {e}")))
}

fn bind(rt: &Runtime, h: &RankHandoff) -> Result<Endpoint> {
    let mailbox = Arc::new(Mailbox::new());
    let setup = TransportSetup {
        identity: Identity { job: h.job, key: h.key.clone(), rank: h.id },
        size: h.id.0 + 1,
        config: h.transport.config(),
        mailbox: mailbox.clone(),
    };
    let _guard = rt.enter();
    let t = ductile_transport::bind(&h.transport.name, setup)?;
    Ok(Endpoint::new(t, mailbox, h.id))
}

fn node_count(m: &Membership) -> u32 {
    m.nodes.iter().collect::<std::collections::BTreeSet<_>>().len() as u32
}

/// The node of every endpoint of `ms`, for groups to say where a peer is in errors.
fn placement<'a>(ms: impl IntoIterator<Item = &'a Membership>) -> Arc<rustc_hash::FxHashMap<Rank, NodeId>> {
    Arc::new(ms.into_iter().flat_map(|m| m.ranks.iter().copied().zip(m.nodes.iter().copied())).collect())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Session {
    fn assemble(
        rt: Runtime,
        env: &EnvSettings,
        h: &RankHandoff,
        endpoint: Endpoint,
        control: Option<UnixStream>,
        membership: Membership,
    ) -> Result<Self> {
        let timeout = Duration::from_millis(h.timeout_ms);
        let spin = env.spin_for(endpoint.transport().capabilities());
        let memberships = Memberships::default();
        let world = Self::world_of(&rt, spin, &endpoint, &membership, timeout, &memberships)?;
        let info = JobInfo {
            job: h.job,
            node: h.node,
            nodes: node_count(&membership),
            launched: control.is_some(),
            transport: h.transport.name.clone(),
            id: h.id,
        };
        tracing::debug!("{} (rank {} of {}) joined job {} on {}", h.id, world.rank(), world.size(), h.job, h.node);
        let watcher = match &control {
            Some(c) => Some(control::Watcher::start(c, endpoint.mailbox().clone())?),
            None => None,
        };
        Ok(Self {
            world,
            memberships,
            spin,
            timeout,
            info,
            endpoint,
            control,
            watcher,
            recover: h.recover,
            rt: Some(rt),
            membership,
            registry: Registry::default(),
            method: h.redistribution,
            count: 0,
            pending: false,
            want: None,
            joined: None,
            last_change: None,
            released: false,
            background: h.background,
            background_share: env.background_share,
            moving: None,
            moved_for: None,
            keeping: false,
            staged: None,
            broken: None,
            launcher: None,
        })
    }

    /// The world's group of membership `m`, which begins a new membership of the
    /// session: the groups of earlier ones are stale from now on.
    fn world_of(
        rt: &Runtime,
        spin: Duration,
        ep: &Endpoint,
        m: &Membership,
        timeout: Duration,
        memberships: &Memberships,
    ) -> Result<Group> {
        let me = ep.rank();
        let pos =
            m.ranks.iter().position(|r| *r == me).ok_or_else(|| {
                Error::Bootstrap(format!("this process ({me}) is not in the membership it was given"))
            })?;
        let g = AsyncGroup::new(ep.clone(), world_context(m.epoch), m.ranks.clone(), pos, timeout)?;
        // Only a membership whose world could be made ends the one before: a failure
        // leaves the old groups as they were.
        let number = memberships.advance();
        Ok(Group::new(g.placed(placement([m])).fenced(memberships, number), rt.handle().clone(), spin))
    }

    /// The Tokio runtime that drives this session's transport and timers: where
    /// [`AsyncGroup`] operations run. From a thread of the application,
    /// `session.handle()?.block_on(world.as_async().barrier())` runs one to its end;
    /// `spawn` runs one beside the application. Operations polled on another runtime
    /// would start the transport's connection tasks there, which end with it.
    ///
    /// # Local
    ///
    /// # Errors
    /// The session has been finalized.
    pub fn handle(&self) -> Result<tokio::runtime::Handle> {
        self.rt.as_ref().map(|rt| rt.handle().clone()).ok_or_else(|| Error::Invalid("session is closed".into()))
    }

    fn in_group(&self) -> Result<()> {
        self.not_released()?;
        self.intact()
    }

    fn not_released(&self) -> Result<()> {
        if self.released {
            return Err(Error::Invalid("this process was released at a checkpoint; call finalize".into()));
        }
        Ok(())
    }

    /// Fails once a checkpoint has failed: the group and the registered blocks may be
    /// half-way through a change.
    fn intact(&self) -> Result<()> {
        match &self.broken {
            Some(why) => {
                Err(Error::Reconfigure(format!("an earlier checkpoint failed ({why}); this process can only finalize")))
            }
            None => Ok(()),
        }
    }

    /// Records that a checkpoint failed with `e` and tells the launcher (best effort),
    /// which ends the job soon unless it ends first: the ranks this one would have
    /// switched with must not wait for it until their timeouts. Returns `e`.
    fn broken_by(&mut self, e: Error) -> Error {
        let reason = e.to_string();
        tracing::debug!("{}: checkpoint {} failed: {reason}", self.endpoint.rank(), self.count);
        if let Some(c) = self.control.as_mut() {
            let msg = FromRank::CheckpointFailed {
                count: self.count,
                rank: self.world.rank() as u32,
                reason: reason.clone(),
            };
            let _ = bootstrap::write_msg(c, &msg);
        }
        self.broken = Some(reason);
        e
    }

    /// The group of every process in the job (in the current membership). A copy kept
    /// past a checkpoint that changed the membership refuses to address its members
    /// ([`Error::StaleGroup`]): take the world again after each checkpoint. (A process
    /// started alone that asks to grow becomes part of a launched job at that
    /// checkpoint, with a new endpoint: its world is new even when the checkpoint
    /// answers [`Checkpoint::Pending`] or [`Checkpoint::Unchanged`].)
    #[must_use]
    pub fn world(&self) -> &Group {
        &self.world
    }

    /// The current membership epoch: 0 at start, one more with every change.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.membership.epoch
    }

    /// The change this process joined with, if it was started by a resize: its rank,
    /// the group sizes, and (through the registry) the job's state.
    #[must_use]
    pub fn joined(&self) -> Option<&Resize> {
        self.joined.as_ref()
    }

    /// Asks for `procs` processes at the next checkpoint (an evolving job). The
    /// resource manager may grant, clamp or refuse it; the checkpoint's result says.
    ///
    /// # Local
    /// Only rank 0's request is sent.
    pub fn request_procs(&mut self, procs: u32) {
        self.want = Some(procs);
    }

    /// Where the group may change. Waits for the controller's decision: the group stays
    /// ([`Checkpoint::Unchanged`]), or changes, in which case registered data is moved
    /// and this process learns its role ([`Checkpoint::Resized`] or
    /// [`Checkpoint::Released`]). When new processes are needed it waits until they are
    /// ready.
    ///
    /// # Collective
    /// Every rank of the world calls it.
    ///
    /// # Errors
    /// The controller or a peer failed or timed out, or ranks registered different
    /// items. A failed checkpoint is final: the launcher is told and ends the job a few
    /// seconds later unless it ends first, and from then on this process's
    /// checkpoints and blocks are errors; it can only [`Session::finalize`] (which then
    /// skips the barrier).
    pub fn checkpoint(&mut self) -> Result<Checkpoint> {
        self.checkpoint_in(CheckpointMode::Blocking)
    }

    /// Like [`Session::checkpoint`], but when a change needs new processes it returns
    /// [`Checkpoint::Pending`] at once and lets them start while the application goes
    /// on computing; a later call switches once they are ready.
    ///
    /// # Collective
    /// Every rank of the world calls it.
    ///
    /// # Errors
    /// As [`Session::checkpoint`].
    pub fn checkpoint_background(&mut self) -> Result<Checkpoint> {
        self.checkpoint_in(CheckpointMode::Background)
    }

    fn checkpoint_in(&mut self, mode: CheckpointMode) -> Result<Checkpoint> {
        self.in_group()?;
        self.count += 1;
        let notified = self.watcher.as_ref().and_then(control::Watcher::failure);
        // A member this process's transport saw fail, before the launcher's notice came:
        // the checkpoint recovers, as after the notice. (Going on instead, rank 0 could
        // take the controller's answer for the old group, which it gave knowing of no
        // failure, and lead the others past checkpoints with a dead member.)
        let lost = if self.recover && self.moving.is_none() {
            self.endpoint.mailbox().lost_among(&self.membership.ranks)
        } else {
            None
        };
        let step = match (notified, lost) {
            (Some(f), _) => Err(Error::Transport(ductile_transport::TransportError::Interrupted(f.why))),
            (None, Some(r)) => Err(Error::Transport(ductile_transport::TransportError::PeerLost(r))),
            (None, None) => self.checkpoint_step(mode),
        };
        // Once a failure is notified, the error of a change it interrupted (a dial to a
        // process the launcher ended meanwhile that timed out, say) is the failure's too.
        // A change staged here (see `complete_change`) waits for the controller's word.
        let told = |s: &Self| s.watcher.as_ref().is_some_and(|w| w.failure().is_some()) || s.staged.is_some();
        match step {
            Err(e) if self.recover && (e.is_failure() || told(self)) => {
                tracing::debug!("{}: checkpoint {}: {e}; recovering", self.endpoint.rank(), self.count);
                self.recover().map_err(|e| self.broken_by(e))
            }
            other => other.map_err(|e| self.broken_by(e)),
        }
    }

    fn checkpoint_step(&mut self, mode: CheckpointMode) -> Result<Checkpoint> {
        if self.moving.is_some() {
            return self.poll_moving(mode);
        }
        let mut decision = if self.world.rank() == 0 { self.root_decision(mode)? } else { Decision::Continue };
        if self.world.size() > 1 {
            self.world.broadcast_value(0, &mut decision)?;
        }
        match decision {
            Decision::Continue => {
                self.pending = false;
                Ok(Checkpoint::Unchanged)
            }
            Decision::Tidy(addrs) => {
                self.pending = false;
                self.endpoint.transport().set_peers(&addrs)?;
                self.membership.addrs = addrs;
                Ok(Checkpoint::Unchanged)
            }
            Decision::Pending => {
                self.pending = true;
                Ok(Checkpoint::Pending)
            }
            Decision::Change(c) => {
                self.pending = false;
                self.apply_change_in(c, false, mode)
            }
        }
    }

    /// Rank 0's side: asks the controller (once per change) and reads its answer.
    fn root_decision(&mut self, mode: CheckpointMode) -> Result<Decision> {
        let want = self.want.take();
        if self.control.is_none() && want.is_some_and(|n| n > 1) {
            // Started alone and asked to grow: become rank 0 of a launched job. A
            // process that cannot is refused, as a resource manager may refuse.
            if let Err(e) = self.adopt() {
                tracing::warn!("{e}; the process goes on alone");
                return Ok(Decision::Continue);
            }
        }
        // Read after an adoption, which sets the launcher's.
        let timeout = self.timeout;
        let (epoch, count, pending) = (self.membership.epoch, self.count, self.pending);
        let (Some(c), Some(watcher)) = (self.control.as_mut(), self.watcher.as_ref()) else {
            return Ok(Decision::Continue);
        };
        if !pending {
            let msg = FromRank::Checkpoint { epoch, count, mode, want_procs: want };
            bootstrap::write_msg(c, &msg).map_err(control_err)?;
        }
        let got = if pending && mode == CheckpointMode::Background {
            match watcher.try_next().map_err(|e| Error::Bootstrap(format!("control channel to the agent: {e}")))? {
                Some(m) => m,
                None => return Ok(Decision::Pending),
            }
        } else {
            watcher.next(timeout).map_err(|e| {
                Error::Reconfigure(format!("no decision from the controller at checkpoint {count}: {e}"))
            })?
        };
        match got {
            ToRank::Decision(d) => Ok(d),
            // Processes failed: the decision, if any, is moot.
            ToRank::Failure(f) => Err(Error::Transport(ductile_transport::TransportError::Interrupted(f.why))),
            other => Err(Error::Reconfigure(format!("expected a decision from the controller, got {other:?}"))),
        }
    }

    /// Switches to the membership of `c`: installs the address table, hands the
    /// registry's manifest and replicated state from the old rank 0 to everyone, moves
    /// the distributed items, and builds the new world.
    fn apply_change(&mut self, c: Change, joined: bool) -> Result<Checkpoint> {
        self.apply_change_in(c, joined, CheckpointMode::Blocking)
    }

    /// As [`Session::apply_change`]; with `--background` and constant items, their move
    /// starts first, and an old rank at a background checkpoint returns
    /// [`Checkpoint::Pending`] and computes on while it runs.
    fn apply_change_in(&mut self, c: Change, joined: bool, mode: CheckpointMode) -> Result<Checkpoint> {
        let prep = self.prepare_change(&c, joined)?;
        if !(self.background && self.registry.has_constant()) {
            return self.complete_change(c, prep, None);
        }
        let epoch = c.after.epoch;
        let rt = self.rt.as_ref().ok_or_else(|| Error::Invalid("session is closed".into()))?;
        // The move runs in a group of its own context, so its messages never meet the
        // transition group's collectives.
        let g = AsyncGroup::new(
            self.endpoint.clone(),
            background_context(epoch),
            prep.members.clone(),
            prep.tpos,
            self.timeout,
        )?
        .placed(placement([&self.membership, &c.after]));
        self.moved_for = Some(epoch);
        let work = self.registry.start_background(g, prep.parts, &prep.new_pos, self.method, self.background_share);
        let m = Moving::spawn(rt, c, prep, work);
        let old = m.prep.tpos < m.prep.parts.old_n as usize;
        if old && mode == CheckpointMode::Background {
            self.moving = Some(m);
            return Ok(Checkpoint::Pending);
        }
        self.complete_moving(m)
    }

    /// The first half of a change: address table, transition group, the old rank 0's
    /// registry checked on every member.
    fn prepare_change(&mut self, c: &Change, joined: bool) -> Result<Prepared> {
        let t0 = Instant::now();
        let me = self.endpoint.rank();
        let epoch = c.after.epoch;
        if !joined && (c.before != self.membership.ranks || epoch <= self.membership.epoch) {
            return Err(Error::Reconfigure(format!(
                "change to epoch {epoch} does not follow this process's membership (epoch {})",
                self.membership.epoch
            )));
        }
        if c.after.ranks.is_empty() || c.after.nodes.len() != c.after.ranks.len() || c.before.is_empty() {
            return Err(Error::Reconfigure(format!("malformed change to epoch {epoch}")));
        }
        self.endpoint.transport().set_peers(&c.after.addrs)?;
        let old: std::collections::HashSet<Rank> = c.before.iter().copied().collect();
        let members: Vec<Rank> =
            c.before.iter().copied().chain(c.after.ranks.iter().copied().filter(|r| !old.contains(r))).collect();
        let tpos = members
            .iter()
            .position(|r| *r == me)
            .ok_or_else(|| Error::Reconfigure(format!("{me} is not part of the change to epoch {epoch}")))?;
        let tg =
            AsyncGroup::new(self.endpoint.clone(), transition_context(epoch), members.clone(), tpos, self.timeout)?
                .placed(placement([&self.membership, &c.after]));
        let transition = Group::new(tg, self.handle()?, self.spin);
        dies_here(DIE_IN_PREPARE_ENV, tpos, epoch, "as the change to epoch {epoch} connects");
        if let Some(k) = self.agree_on_registry(&transition, joined)? {
            return Err(Error::Reconfigure(format!(
                "the registered items of {} differ from rank 0's; the change to epoch {epoch} is abandoned",
                members.get(k).map_or_else(|| format!("member {k}"), ToString::to_string)
            )));
        }
        if joined {
            self.count = c.checkpoint;
        }
        let connect = t0.elapsed();
        let new_pos: Vec<Option<u32>> =
            members.iter().map(|r| c.after.ranks.iter().position(|x| x == r).map(|p| p as u32)).collect();
        let parts = Parts { old_n: c.before.len() as u32, new_n: c.after.ranks.len() as u32 };
        Ok(Prepared { transition, tpos, members, new_pos, parts, connect })
    }

    /// Every member of `g` takes the registry of `g`'s first member (`joined`: this
    /// process is new, its own registry empty). Returns the member whose registry
    /// differs, if one does: every member learns it, so that each fails naming the
    /// cause instead of waiting on a process that already gave up.
    fn agree_on_registry(&mut self, g: &Group, joined: bool) -> Result<Option<usize>> {
        let mut manifest = if g.rank() == 0 { self.registry.manifest() } else { Manifest::default() };
        g.broadcast_value(0, &mut manifest)?;
        let adopted = self.registry.adopt(manifest, joined);
        let flag = if adopted.is_err() { g.rank() as u64 + 1 } else { 0 };
        let differs = g.allreduce(&[flag], ReduceOp::Max)?[0];
        adopted?;
        Ok(usize::try_from(differs).ok().and_then(|d| d.checked_sub(1)))
    }

    /// The second half: the (remaining) items move, the new world is built.
    ///
    /// With `--on-failure shrink`, a blocking move keeps the old blocks until the change
    /// commits (`keeping`), so that a failure anywhere in the move leaves this process's
    /// data of the old epoch whole, and the change can be abandoned. A process whose
    /// move is done when the change's last collective loses a process does not commit
    /// on its own: the change is `staged`, and it commits or is undone as the controller
    /// decides ([`Session::recover`]).
    fn complete_change(
        &mut self,
        c: Change,
        prep: Prepared,
        overlap: Option<(Instant, Instant)>,
    ) -> Result<Checkpoint> {
        let Prepared { transition, tpos, members: _, new_pos, parts, connect } = prep;
        let me = self.endpoint.rank();
        let epoch = c.after.epoch;
        if overlap.is_some() {
            // Replicated state may have changed while the application computed on.
            let mut manifest = if tpos == 0 { self.registry.manifest() } else { Manifest::default() };
            transition.broadcast_value(0, &mut manifest)?;
            self.registry.refresh(manifest)?;
        }
        let t1 = Instant::now();
        self.moved_for = Some(epoch);
        // A process new in the change has no old blocks: if the change is abandoned, it
        // is ended.
        let old = tpos < c.before.len();
        self.keeping = self.recover && overlap.is_none() && old;
        let registry = &mut self.registry;
        let how = (self.method, overlap.is_some(), self.keeping);
        transition.block(registry.redistribute(transition.core_async(), parts, &new_pos, how))?;
        flush_move(&transition, &self.endpoint, epoch);
        let redistribute = t1.elapsed();
        let background = overlap.map_or(0, |(from, to)| micros(to.saturating_duration_since(from)));
        dies_here(DIE_AFTER_MOVE_ENV, tpos, epoch, "after its move to epoch {epoch}");
        let times = match transition.allreduce(&[micros(connect), micros(redistribute), background], ReduceOp::Max) {
            Ok(times) => Some(times),
            // A process leaving in this change that took it and left, while this one
            // still waited on it: another had failed, and the leaver was told to go on.
            Err(e) if self.keeping && (e.is_failure() || e.closed_by().is_some_and(|r| Self::leaves_in(&c, r))) => {
                // Its move is done, but another's may not be: nobody may have committed
                // (the collective completes nowhere before every move is done), and the
                // change may still be abandoned. It waits for the controller's word.
                tracing::debug!("{me}: the change to epoch {epoch} lost a process after its move ({e}); staged");
                self.staged = Some(Staged { c, transition, tpos, new_pos, overlap });
                return Err(e);
            }
            Err(e) if self.recover && e.is_failure() => {
                // A new process (or an old one whose constant items moved in the
                // background, which keeps nothing): its move is done, so its part of the
                // new layout is whole. It takes the new group all the same, and recovers
                // in it at its next checkpoint (a new one is ended if the change is
                // abandoned; a failure in a background change ends the job).
                tracing::debug!("{me}: the change to epoch {epoch} lost a process after its move ({e}); taking it");
                None
            }
            Err(e) => return Err(e),
        };
        self.commit_change(Staged { c, transition, tpos, new_pos, overlap }, times)
    }

    /// Whether `r` leaves in change `c`.
    fn leaves_in(c: &Change, r: Rank) -> bool {
        c.before.contains(&r) && !c.after.ranks.contains(&r)
    }

    /// Takes the new membership of a change whose move is done (`times`: its switch
    /// times, which its new rank 0 reports; `None`: the change's last collective lost a
    /// process, and nothing is reported).
    fn commit_change(&mut self, st: Staged, times: Option<Vec<u64>>) -> Result<Checkpoint> {
        let Staged { c, transition, tpos, new_pos, overlap } = st;
        let me = self.endpoint.rank();
        let epoch = c.after.epoch;
        self.registry.settle();
        self.keeping = false;
        let old_size = c.before.len();
        let resize = Resize {
            seq: c.seq,
            epoch,
            old_size,
            new_size: c.after.ranks.len(),
            old_rank: (tpos < old_size).then_some(tpos),
            new_rank: new_pos[tpos].map(|p| p as usize),
            mapping: new_pos[..old_size].iter().map(|p| p.map(|p| p as usize)).collect(),
            added: new_pos[old_size..].iter().filter_map(|p| p.map(|p| p as usize)).collect(),
            transition,
            overlap,
        };
        let removed: Vec<u32> = (0..old_size as u32).filter(|&o| new_pos[o as usize].is_none()).collect();
        self.last_change = Some((c.seq, resize.added.iter().map(|&a| a as u32).collect(), removed));
        if resize.new_rank.is_none() {
            self.released = true;
            self.moved_for = None;
            // Its world is the old one's, stale now.
            self.memberships.advance();
            tracing::debug!("{me} released at epoch {epoch}");
            return Ok(Checkpoint::Released(resize));
        }
        let rt = self.rt.as_ref().ok_or_else(|| Error::Invalid("session is closed".into()))?;
        self.world = Self::world_of(rt, self.spin, &self.endpoint, &c.after, self.timeout, &self.memberships)?;
        self.info.nodes = node_count(&c.after);
        self.membership = c.after;
        self.moved_for = None;
        if let (Some(0), Some(times)) = (resize.new_rank, times) {
            if let Some(ctl) = self.control.as_mut() {
                let times = SwitchTimes { connect_us: times[0], redistribute_us: times[1], background_us: times[2] };
                bootstrap::write_msg(ctl, &FromRank::Switched { epoch, times }).map_err(control_err)?;
            }
        }
        tracing::debug!("{me} is rank {} of {} at epoch {epoch}", self.world.rank(), self.world.size());
        Ok(Checkpoint::Resized(resize))
    }

    /// A named process set of the current membership: `world`, `self`, `node/<id>`,
    /// or, for the latest change, `rc/<seq>/added` (new ranks that are new processes,
    /// current epoch) and `rc/<seq>/removed` (old ranks that left, previous epoch).
    ///
    /// # Local
    ///
    /// # Errors
    /// An unknown name.
    pub fn pset(&self, name: &str) -> Result<ProcessSet> {
        let (rank, size, epoch) = (self.world.rank() as u32, self.world.size() as u32, self.membership.epoch);
        if let Some(id) = name.strip_prefix("node/") {
            let id: u32 = id.parse().map_err(|_| Error::Invalid(format!("bad node id in {name:?}")))?;
            let ranks = (0..size).filter(|&r| self.membership.nodes[r as usize] == NodeId(id));
            return Ok(ProcessSet::node(epoch, id, ranks));
        }
        if let Some((seq, added, removed)) = &self.last_change {
            if *name == format!("rc/{seq}/added") {
                return Ok(ProcessSet::new(name, epoch, added.iter().copied()));
            }
            if *name == format!("rc/{seq}/removed") {
                return Ok(ProcessSet::new(name, epoch.saturating_sub(1), removed.iter().copied()));
            }
        }
        match name {
            "world" => Ok(ProcessSet::world(epoch, size)),
            "self" => Ok(ProcessSet::own(epoch, rank)),
            other => Err(Error::Invalid(format!(
                "unknown process set {other:?} (known: world, self, node/<id>, rc/<seq>/added, rc/<seq>/removed)"
            ))),
        }
    }

    /// A group of the ranks of `set`, ordered by rank, with a context of its own.
    ///
    /// # Local
    /// Every member builds the same group independently: the context is derived from
    /// the set's epoch and ranks.
    ///
    /// # Errors
    /// The set is of another epoch, or this process is not in it (or no longer in the
    /// job: it was released at a checkpoint).
    pub fn group(&self, set: &ProcessSet) -> Result<Group> {
        self.not_released()?;
        if set.epoch() != self.membership.epoch {
            return Err(Error::Invalid(format!("{set} is not of the current membership")));
        }
        let me = self.world.rank() as u32;
        let members: Vec<Rank> = set
            .ranks()
            .map(|r| self.membership.ranks.get(r as usize).copied())
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Invalid(format!("{set} names ranks outside the world")))?;
        let pos = set
            .ranks()
            .position(|r| r == me)
            .ok_or_else(|| Error::Invalid(format!("this process (rank {me}) is not in {set}")))?;
        let g = AsyncGroup::new(self.endpoint.clone(), set_context(set), members, pos, self.timeout)?;
        let g = g.placed(placement([&self.membership])).fenced(&self.memberships, self.memberships.current());
        Ok(Group::new(g, self.handle()?, self.spin))
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
    /// peers and tells the agent. A process released at a checkpoint leaves without the
    /// barrier (the change already synchronised it).
    ///
    /// # Collective
    /// Every rank of the world (or a released process on its own).
    ///
    /// # Errors
    /// The barrier failed (a peer is gone or silent past the timeout).
    pub fn finalize(mut self) -> Result<()> {
        if let Some(m) = self.moving.take() {
            // The application ended before the change could complete. The move is let
            // finish (bounded by the timeout), then every member of the change learns
            // it is abandoned: processes started to join it exit, the old ones end
            // here with their old blocks.
            let Moving { prep, task, handle, .. } = m;
            let abort = task.abort_handle();
            let _ = prep.transition.block(async { task.await.map_err(|e| Error::Reconfigure(e.to_string())) });
            abort.abort();
            handle.end();
            let _ = prep.transition.allreduce(&[ABANDONED], ReduceOp::Max);
            self.registry.abandon_background();
        }
        // After a failed checkpoint the world may be half-way through a change, and
        // some of its ranks gone: no barrier.
        if !self.released && self.broken.is_none() {
            self.world.barrier()?;
        }
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
            // Shut, so that the agent of an adopted process sees its part end here,
            // and the watcher its last read.
            control::shut(c);
        }
        self.control = None;
        match self.launcher.take() {
            Some(launcher) => adopt::await_launcher(launcher, self.timeout),
            None => Ok(()),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(c) = &self.control {
            control::shut(c);
        }
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

    #[test]
    fn a_world_that_cannot_be_made_leaves_the_membership_as_it_was() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ep = ductile_transport::mem::MemHub::endpoints(1).pop().unwrap();
        let memberships = Memberships::default();
        let m = |ranks: Vec<Rank>| Membership { epoch: 1, nodes: vec![NodeId(0); ranks.len()], ranks, addrs: vec![] };
        let spin = Duration::ZERO;
        let timeout = Duration::from_secs(5);
        let world = Session::world_of(&rt, spin, &ep, &m(vec![Rank(0)]), timeout, &memberships).unwrap();
        world.barrier().unwrap();
        for bad in [vec![Rank(1)], vec![Rank(0), Rank(0)]] {
            assert!(Session::world_of(&rt, spin, &ep, &m(bad), timeout, &memberships).is_err());
            world.barrier().expect("the world still current");
        }
    }
}
