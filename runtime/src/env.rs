//! The `DUCTILE_*` environment variables, parsed in one place.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `DUCTILE_LOG` | `tracing` filter for the runtime's logs | `warn` |
//! | `DUCTILE_SPIN_US` | how long a blocking wait spins before parking, µs | [`DEFAULT_SPIN_US`] with tcp and fabric, [`UNPOLLED_SPIN_US`] with quic (and the in-process mem backend) |
//! | `DUCTILE_THREADS` | progress threads per process, 1 to [`MAX_THREADS`] | [`DEFAULT_THREADS`] |
//! | `DUCTILE_TIMEOUT` | timeout of every wait of a standalone process, s (launched ranks get theirs from the launcher) | [`DEFAULT_TIMEOUT_SECS`] |
//! | `DUCTILE_BACKGROUND_SHARE` | share of the time a background redistribution may keep the processes busy, in (0, 1]; 1 moves at full speed | [`DEFAULT_BACKGROUND_SHARE`] |
//! | `DUCTILE_HUGE_PAGES` | `1`: new blocks of registered data of 32 MiB and more get transparent huge pages when the kernel has them free (see `block`) | `0` |
//! | `DUCTILE_PAGE_HANDOVER` | `0`: one-sided moves over fabric shm do not hand whole pages over between processes (see `pages`); they copy, into recycled pages unless `DUCTILE_PAGE_RECYCLE=0` too | `1` |
//! | `DUCTILE_PAGE_RECYCLE` | `0`: moves over tcp and fabric shm fault in fresh pages for every new block instead of reusing the pages of the old one (see `anon`) | `1` |
//! | `DUCTILE_MALLOC_TUNING` | `0` leaves glibc's allocator settings alone (see `init`) | `1` |
//! | `DUCTILE_CONTROL_FD` | set by the agent: the control channel's descriptor | unset (standalone) |
//! | `DUCTILE_LAUNCHER` | the `ductile` binary that child jobs (`Group::launch`) and the growth of a process started alone run; set by the agent to its own | `ductile` from `PATH` |

use std::time::Duration;

/// Default spin time of a blocking wait, µs, with a backend whose data the waiting thread
/// moves itself while it spins (tcp, fabric; see `Capabilities::polled`).
pub const DEFAULT_SPIN_US: u64 = 1000;
/// Default spin time of a blocking wait, µs, with a backend whose own tasks move all data
/// (quic). Spinning only waits for them, and on a full node takes their processor. Over
/// quic on 2 cores (single runs, 4 MiB stream and 8 B one-way): 1000 µs gave 1.4 GiB/s
/// and 35 µs, 400 µs 2.1-2.4 and 35, 100 µs 2.65 and 33-35, 50 µs 2.6-2.7 and 47-56
/// (a reply after ~70 µs then finds the thread asleep).
pub const UNPOLLED_SPIN_US: u64 = 100;
/// Default share of the time a background redistribution may keep busy. Measured with
/// `benches/overlap.rs` on 2 cores that the solver fills: at full speed a move slows
/// the solver's iterations 3-6 × (ω); at 0.15 the move takes about 4 × longer and ω
/// stays near 1.5 or below (docs/BENCHMARKS.md).
pub const DEFAULT_BACKGROUND_SHARE: f64 = 0.15;
/// Default number of progress threads.
pub const DEFAULT_THREADS: usize = 1;
/// Most progress threads per process: each has a stack, and a rank needs few.
pub const MAX_THREADS: usize = 1024;
/// Default timeout of every wait, seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// Most seconds `DUCTILE_TIMEOUT` (and microseconds `DUCTILE_SPIN_US`) take: a year,
/// so that deadlines computed from them stay far from the clock's limits.
pub const MAX_SECS: u64 = 366 * 24 * 3600;

/// Settings read from the environment.
#[derive(Clone, Debug)]
pub struct EnvSettings {
    /// Spin time of blocking waits; None: the backend's default (see [`EnvSettings::spin_for`]).
    pub spin: Option<Duration>,
    /// Progress threads.
    pub threads: usize,
    /// Timeout of every wait (standalone).
    pub timeout: Duration,
    /// Control channel descriptor, if launched.
    pub control_fd: Option<i32>,
    /// Whether `init` tunes the allocator for large messages.
    pub malloc_tuning: bool,
    /// Whether large new blocks may get transparent huge pages.
    pub huge_pages: bool,
    /// Whether one-sided moves may hand pages over between processes of a host.
    pub page_handover: bool,
    /// Whether moves may recycle the pages of old blocks into new ones.
    pub page_recycle: bool,
    /// Share of the time a background redistribution may keep busy, in (0, 1].
    pub background_share: f64,
}

fn parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>, String> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| format!("{name}={v:?} is not a valid value")),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not valid UTF-8")),
    }
}

impl EnvSettings {
    /// Reads the environment.
    ///
    /// # Errors
    /// A variable that is set but does not parse, named in the message.
    pub fn from_env() -> Result<Self, String> {
        let threads = parse::<usize>("DUCTILE_THREADS")?.unwrap_or(DEFAULT_THREADS);
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(format!("DUCTILE_THREADS must be from 1 to {MAX_THREADS}, not {threads}"));
        }
        let background_share = parse::<f64>("DUCTILE_BACKGROUND_SHARE")?.unwrap_or(DEFAULT_BACKGROUND_SHARE);
        if !(background_share > 0.0 && background_share <= 1.0) {
            return Err(format!("DUCTILE_BACKGROUND_SHARE must be in (0, 1], not {background_share}"));
        }
        let timeout = parse::<u64>("DUCTILE_TIMEOUT")?.unwrap_or(DEFAULT_TIMEOUT_SECS);
        if !(1..=MAX_SECS).contains(&timeout) {
            return Err(format!("DUCTILE_TIMEOUT must be from 1 to {MAX_SECS} seconds, not {timeout}"));
        }
        let spin = parse::<u64>("DUCTILE_SPIN_US")?;
        if let Some(us) = spin.filter(|&us| us > MAX_SECS) {
            return Err(format!("DUCTILE_SPIN_US must be at most {MAX_SECS} µs, not {us}"));
        }
        Ok(Self {
            background_share,
            spin: spin.map(Duration::from_micros),
            threads,
            timeout: Duration::from_secs(timeout),
            control_fd: parse(crate::bootstrap::CONTROL_FD_ENV)?,
            malloc_tuning: parse::<u8>("DUCTILE_MALLOC_TUNING")?.unwrap_or(1) != 0,
            huge_pages: parse::<u8>("DUCTILE_HUGE_PAGES")?.unwrap_or(0) != 0,
            page_handover: parse::<u8>("DUCTILE_PAGE_HANDOVER")?.unwrap_or(1) != 0,
            page_recycle: parse::<u8>("DUCTILE_PAGE_RECYCLE")?.unwrap_or(1) != 0,
        })
    }

    /// The spin time of blocking waits over a backend with `caps`: `DUCTILE_SPIN_US` if
    /// set, else [`DEFAULT_SPIN_US`] for a polled backend and [`UNPOLLED_SPIN_US`] for
    /// one whose own tasks move all data.
    #[must_use]
    pub fn spin_for(&self, caps: ductile_transport::Capabilities) -> Duration {
        let default = if caps.polled { DEFAULT_SPIN_US } else { UNPOLLED_SPIN_US };
        self.spin.unwrap_or(Duration::from_micros(default))
    }
}
