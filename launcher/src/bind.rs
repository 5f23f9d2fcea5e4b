//! Binding ranks to cores (`ductile run --bind-to`), as `mpirun --bind-to` and
//! `srun --cpu-bind` do.
//!
//! The controller gives every rank a **slot**: its place among the job's live processes
//! on its host. Every simulated node runs on this host, so they share one count; each
//! host of `--hosts` counts its own. A new rank takes the lowest slot that no live rank
//! on its host holds ([`assign`]), so the ranks a growth starts take the cores a shrink
//! or a failure freed.
//!
//! The agent turns a slot into CPUs: the slot-th **unit** ([`units`]: a core with all its
//! hardware threads, or one hardware thread) of the CPUs the agent itself may run on,
//! which is what a batch system's cgroup, `srun` or `taskset` gave the job. With more
//! ranks on a host than units, slots wrap around and ranks share units (the agent says
//! so once). The mask is set in the child before it runs the program, so every thread
//! the rank starts inherits it.

use nix::sched::CpuSet;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

/// What each rank is bound to (`--bind-to`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum BindTo {
    /// Not bound: ranks run wherever the kernel puts them.
    #[default]
    None,
    /// One core each, with all of its hardware threads.
    Core,
    /// One hardware thread (one CPU) each.
    Hwthread,
}

impl BindTo {
    /// The unit's name in messages.
    #[must_use]
    pub fn unit(self) -> &'static str {
        match self {
            BindTo::None => "nothing",
            BindTo::Core => "core",
            BindTo::Hwthread => "hardware thread",
        }
    }
}

/// The slots of `new` ranks, each on the host its key names, given the slots `held` by
/// live ranks: on each host the lowest ones free, in the order of `new`.
#[must_use]
pub fn assign<K: Eq + Hash>(held: impl IntoIterator<Item = (K, u32)>, new: impl IntoIterator<Item = K>) -> Vec<u32> {
    let mut taken: HashMap<K, BTreeSet<u32>> = HashMap::new();
    for (k, s) in held {
        taken.entry(k).or_default().insert(s);
    }
    new.into_iter()
        .map(|k| {
            let t = taken.entry(k).or_default();
            // The lowest slot not taken: some slot in 0..=len is free.
            let s = (0..).find(|s| !t.contains(s)).unwrap_or(0);
            t.insert(s);
            s
        })
        .collect()
}

/// The units ranks are bound to, in order: each allowed CPU alone (`Hwthread`), or the
/// allowed CPUs of each core (`Core`; `siblings(cpu)` are the CPUs of `cpu`'s core, all
/// of them, or `None` when unknown, which counts `cpu` as a core of its own). A core
/// comes where its first allowed CPU does. None for `BindTo::None`.
#[must_use]
pub fn units(to: BindTo, allowed: &[u32], siblings: impl Fn(u32) -> Option<Vec<u32>>) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    let mut placed = BTreeSet::new();
    for &cpu in allowed {
        if to == BindTo::None || placed.contains(&cpu) {
            continue;
        }
        let mut unit = vec![cpu];
        if to == BindTo::Core {
            let core = siblings(cpu).unwrap_or_default();
            unit.extend(core.into_iter().filter(|c| *c != cpu && allowed.contains(c)));
            unit.sort_unstable();
            unit.dedup();
        }
        placed.extend(unit.iter().copied());
        out.push(unit);
    }
    out
}

/// The unit of `slot`: slots past the last unit wrap around. None without units.
#[must_use]
pub fn unit_of(units: &[Vec<u32>], slot: u32) -> Option<&[u32]> {
    let n = u32::try_from(units.len()).ok().filter(|&n| n > 0)?;
    units.get((slot % n) as usize).map(Vec::as_slice)
}

/// CPU numbers a list may hold: below this (Linux's own limit is 8192).
const CPU_LIMIT: u32 = 1 << 16;

/// Parses a Linux CPU list (`0-3,8,10-11`, as in sysfs and `/proc/*/status`): the CPUs
/// in increasing order, each once.
///
/// # Errors
/// A part that is not a number below [`CPU_LIMIT`] or a range of such numbers, or a
/// range that runs backwards.
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, String> {
    let mut cpus = BTreeSet::new();
    let num = |p: &str| {
        p.trim()
            .parse::<u32>()
            .ok()
            .filter(|&c| c < CPU_LIMIT)
            .ok_or_else(|| format!("{p:?} is not a CPU number in the list {s:?}"))
    };
    for part in s.trim().split(',').filter(|p| !p.trim().is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("the range {part:?} in the CPU list {s:?} runs backwards"));
                }
                cpus.extend(a..=b);
            }
            None => {
                cpus.insert(num(part)?);
            }
        }
    }
    Ok(cpus.into_iter().collect())
}

/// `cpus` as a list for people: `0-3,8`.
#[must_use]
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { cpus[i].to_string() } else { format!("{}-{}", cpus[i], cpus[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// The CPUs this process may run on (its affinity mask).
///
/// # Errors
/// The kernel does not say.
pub fn allowed_cpus() -> nix::Result<Vec<u32>> {
    let set = nix::sched::sched_getaffinity(Pid::from_raw(0))?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).filter_map(|c| u32::try_from(c).ok()).collect())
}

/// The CPUs of `cpu`'s core, from sysfs (None where the kernel does not say).
fn core_siblings(cpu: u32) -> Option<Vec<u32>> {
    let dir = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
    // `core_cpus_list` since Linux 5.4, `thread_siblings_list` before.
    ["core_cpus_list", "thread_siblings_list"]
        .iter()
        .find_map(|f| std::fs::read_to_string(format!("{dir}/{f}")).ok())
        .and_then(|s| parse_cpu_list(&s).ok())
}

/// This host's units for `to`, from this process's affinity mask and the kernel's CPU
/// topology.
///
/// # Errors
/// The affinity mask cannot be read.
pub fn host_units(to: BindTo) -> nix::Result<Vec<Vec<u32>>> {
    Ok(units(to, &allowed_cpus()?, core_siblings))
}

/// The mask of `cpus`.
///
/// # Errors
/// A CPU past what a mask holds.
pub fn cpu_set(cpus: &[u32]) -> nix::Result<CpuSet> {
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c as usize)?;
    }
    Ok(set)
}

/// Binds the calling process to `set`. Async-signal-safe (one system call): called in
/// a forked child before it runs the program.
///
/// # Errors
/// The kernel refuses the mask.
pub fn bind_self(set: &CpuSet) -> std::io::Result<()> {
    nix::sched::sched_setaffinity(Pid::from_raw(0), set).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("5").unwrap(), vec![5]);
        assert_eq!(parse_cpu_list("3,1,1-2").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<u32>::new());
        for bad in ["a", "1-", "-1", "3-1", "1,,x", "1-2-3", "99999999999", "0-65536"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} parsed");
        }
        for cpus in [vec![], vec![0], vec![0, 1, 2, 3, 8], vec![1, 3, 5], vec![0, 1, 3, 4, 5, 9]] {
            assert_eq!(parse_cpu_list(&format_cpu_list(&cpus)).unwrap(), cpus);
        }
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
    }

    /// Two cores of two hardware threads numbered as Linux numbers them on x86 (0 and 2
    /// share a core, 1 and 3 the other), and a fifth CPU whose core is unknown.
    fn smt(cpu: u32) -> Option<Vec<u32>> {
        match cpu {
            0 | 2 => Some(vec![0, 2]),
            1 | 3 => Some(vec![1, 3]),
            _ => None,
        }
    }

    #[test]
    fn units_are_cores_or_hardware_threads_of_the_allowed_cpus() {
        let all = [0, 1, 2, 3, 4];
        assert_eq!(units(BindTo::Core, &all, smt), vec![vec![0, 2], vec![1, 3], vec![4]]);
        assert_eq!(units(BindTo::Hwthread, &all, smt), vec![vec![0], vec![1], vec![2], vec![3], vec![4]]);
        assert!(units(BindTo::None, &all, smt).is_empty());
        // Only what the mask allows: a core with one allowed thread is that thread.
        assert_eq!(units(BindTo::Core, &[1, 2, 3], smt), vec![vec![1, 3], vec![2]]);
        assert!(units(BindTo::Core, &[], smt).is_empty());
    }

    #[test]
    fn slots_wrap_around_the_units() {
        let u = vec![vec![0, 2], vec![1, 3]];
        assert_eq!(unit_of(&u, 0), Some(&[0, 2][..]));
        assert_eq!(unit_of(&u, 1), Some(&[1, 3][..]));
        assert_eq!(unit_of(&u, 2), Some(&[0, 2][..]));
        assert_eq!(unit_of(&u, u32::MAX), Some(&[1, 3][..]));
        assert_eq!(unit_of(&[], 0), None);
    }

    #[test]
    fn new_ranks_take_the_lowest_free_slots_of_their_host() {
        // Nothing held: 0, 1, 2 in order, each host counting its own.
        assert_eq!(assign(Vec::<(u8, u32)>::new(), [0, 0, 0]), vec![0, 1, 2]);
        assert_eq!(assign(Vec::<(u8, u32)>::new(), [0, 1, 0, 1]), vec![0, 0, 1, 1]);
        // A shrink freed slots 1 and 3: a growth takes them first, then goes on past 4.
        assert_eq!(assign([(0u8, 0), (0, 2), (0, 4), (1, 0)], [0, 0, 0, 1]), vec![1, 3, 5, 1]);
    }

    #[test]
    fn this_process_has_cpus_to_bind_to() {
        let cpus = allowed_cpus().unwrap();
        assert!(!cpus.is_empty());
        let cores = host_units(BindTo::Core).unwrap();
        // Every allowed CPU is in exactly one core.
        let mut seen: Vec<u32> = cores.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, cpus);
        assert_eq!(host_units(BindTo::Hwthread).unwrap().len(), cpus.len());
        assert!(cpu_set(&cpus).is_ok());
        assert!(cpu_set(&[u32::MAX]).is_err());
    }
}
