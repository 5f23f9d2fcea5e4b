//! The hosts of a Slurm allocation (`ductile run --slurm`): `SLURM_JOB_NODELIST`, a
//! hostlist expression (`node[01-04,07],gpu1`), and `SLURM_TASKS_PER_NODE`, the task
//! count of each node in run-length form (`2(x3),1`), which gives each host its slots.
//! Pure parsing; [`from_env`] reads the two variables.
//!
//! Written by hand: the expansion is a few dozen lines, and the crates that do it bind
//! Slurm's C library, which a machine outside Slurm does not have.

use crate::hosts::Host;

/// Most hosts an expression may expand to (a bound against `n[0-999999999]`).
pub const MAX_HOSTS: usize = 65_536;
/// The remote shell inside an allocation: one task of a job step on the named node,
/// its stdin and stdout carried by `srun` (the words before the host name).
pub const SRUN_RSH: &str = "srun --overlap --nodes=1 --ntasks=1 --nodelist";

/// What is wrong with the allocation's description.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SlurmError {
    /// Not inside an allocation.
    #[error("--slurm needs a Slurm allocation (SLURM_JOB_NODELIST is not set)")]
    NoAllocation,
    /// A node list that does not parse.
    #[error("SLURM_JOB_NODELIST `{text}`: {why}")]
    BadList {
        /// The variable's value.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// Task counts that do not parse.
    #[error("SLURM_TASKS_PER_NODE `{text}`: {why}")]
    BadCounts {
        /// The variable's value.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// Counts for another number of nodes than the list names.
    #[error("SLURM_TASKS_PER_NODE gives {counts} counts for the {nodes} nodes of SLURM_JOB_NODELIST")]
    Mismatch {
        /// Nodes listed.
        nodes: usize,
        /// Counts given.
        counts: usize,
    },
}

/// Expands a hostlist expression into host names, in order.
///
/// # Errors
/// Unbalanced or empty brackets, a bad range, or more than [`MAX_HOSTS`] names.
pub fn expand_hostlist(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in split_top(text)? {
        if item.is_empty() {
            return Err("an empty name".into());
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            let (plain, after) = rest.split_at(rest.find('[').unwrap_or(rest.len()));
            names.iter_mut().for_each(|n| n.push_str(plain));
            if after.is_empty() {
                break;
            }
            let close = after.find(']').ok_or("a `[` without its `]`")?;
            let numbers = ranges(&after[1..close])?;
            if names.len().saturating_mul(numbers.len()) + out.len() > MAX_HOSTS {
                return Err(format!("more than {MAX_HOSTS} hosts"));
            }
            names = names.iter().flat_map(|n| numbers.iter().map(move |k| format!("{n}{k}"))).collect();
            rest = &after[close + 1..];
        }
        out.extend(names);
    }
    if out.len() > MAX_HOSTS {
        return Err(format!("more than {MAX_HOSTS} hosts"));
    }
    Ok(out)
}

/// The top-level items of a hostlist: split at commas outside brackets.
fn split_top(text: &str) -> Result<Vec<&str>, String> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("brackets inside brackets".into()),
            ']' => depth = depth.checked_sub(1).ok_or("a `]` without its `[`")?,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a `[` without its `]`".into());
    }
    items.push(&text[start..]);
    Ok(items)
}

/// The numbers of a bracket (`01-03,7`), each as written: zero-padded to the width of
/// its range's first bound.
fn ranges(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in text.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!("`[{text}]` is not a list of numbers and ranges"));
        }
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| "a bad number")?, hi.parse().map_err(|_| "a bad number")?);
        if a > b {
            return Err(format!("the range `{part}` runs backwards"));
        }
        if out.len() as u64 + (b - a) >= MAX_HOSTS as u64 {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        out.extend((a..=b).map(|k| format!("{k:0width$}", width = lo.len())));
    }
    Ok(out)
}

/// Expands run-length counts (`2(x3),1`) into one count per node.
///
/// # Errors
/// A count that is not a whole number from 1 up, a bad repeat, or more than
/// [`MAX_HOSTS`] counts.
pub fn expand_counts(text: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in text.split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')').ok_or_else(|| format!("`{part}` lacks its `)`"))?),
            None => (part, "1"),
        };
        let count: u32 = count
            .parse()
            .ok()
            .filter(|c| (1..=crate::hosts::MAX_SLOTS).contains(c))
            .ok_or_else(|| format!("`{count}` is not a count (1 to {})", crate::hosts::MAX_SLOTS))?;
        let times: usize = times.parse().ok().filter(|&t| t > 0).ok_or_else(|| format!("`{times}` is not a repeat"))?;
        if times > MAX_HOSTS - out.len() {
            return Err(format!("more than {MAX_HOSTS} counts"));
        }
        out.extend(std::iter::repeat_n(count, times));
    }
    Ok(out)
}

/// The hosts of an allocation: `nodelist` expanded, each with its count of `tasks`
/// (else no slot count of its own).
///
/// # Errors
/// Either does not parse, a name is no usable host name, or they disagree in length.
pub fn pool(nodelist: &str, tasks: Option<&str>) -> Result<Vec<Host>, SlurmError> {
    let bad_list = |why: String| SlurmError::BadList { text: nodelist.into(), why };
    let names = expand_hostlist(nodelist).map_err(bad_list)?;
    // The names go on a remote shell's command line: the same rules as --hosts.
    let hosts = crate::hosts::parse_list(&names.join(",")).map_err(|e| bad_list(e.to_string()))?;
    let Some(tasks) = tasks else { return Ok(hosts) };
    let counts = expand_counts(tasks).map_err(|why| SlurmError::BadCounts { text: tasks.into(), why })?;
    if counts.len() != hosts.len() {
        return Err(SlurmError::Mismatch { nodes: hosts.len(), counts: counts.len() });
    }
    Ok(hosts.into_iter().zip(counts).map(|(h, c)| Host { slots: Some(c), ..h }).collect())
}

/// The hosts of the allocation this process runs in.
///
/// # Errors
/// Not in an allocation, or its description does not parse.
pub fn from_env() -> Result<Vec<Host>, SlurmError> {
    let list = std::env::var("SLURM_JOB_NODELIST").map_err(|_| SlurmError::NoAllocation)?;
    let tasks = std::env::var("SLURM_TASKS_PER_NODE").ok();
    pool(&list, tasks.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(text: &str) -> Vec<String> {
        expand_hostlist(text).unwrap()
    }

    #[test]
    fn hostlists_expand_as_slurm_writes_them() {
        assert_eq!(names("login1"), ["login1"]);
        assert_eq!(names("node[1-3]"), ["node1", "node2", "node3"]);
        assert_eq!(names("node[01-03,07]"), ["node01", "node02", "node03", "node07"]);
        // Each range has the width of its first bound.
        assert_eq!(names("n[01-02,7]"), ["n01", "n02", "n7"]);
        assert_eq!(names("a[08-10],b"), ["a08", "a09", "a10", "b"]);
        assert_eq!(names("n[9-11]"), ["n9", "n10", "n11"]);
        assert_eq!(names("rack[1-2]-n[1-2]"), ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]);
        assert_eq!(names("gpu[2],cpu[001-002]x"), ["gpu2", "cpu001x", "cpu002x"]);
    }

    #[test]
    fn bad_hostlists_are_errors() {
        for bad in ["", "a,,b", "n[1-", "n1-2]", "n[]", "n[3-1]", "n[a-b]", "n[[1]]", "n[1-999999999]", "n[-1]"] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn counts_expand_their_repeats() {
        assert_eq!(expand_counts("4").unwrap(), [4]);
        assert_eq!(expand_counts("2(x3),1").unwrap(), [2, 2, 2, 1]);
        let huge = [
            "1,1(x18446744073709551615)", // a repeat that overflowed the running count
            "1(x65536),1",
            "100000", // more than a host's slots
        ];
        for bad in ["", "0", "2(x0)", "2(x3", "x", "2(y3)", "-1", "4294967296"].into_iter().chain(huge) {
            assert!(expand_counts(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_allocation_gives_each_host_its_tasks() {
        let hosts = pool("node[1-3]", Some("2(x2),4")).unwrap();
        let got: Vec<(&str, Option<u32>)> = hosts.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(got, [("node1", Some(2)), ("node2", Some(2)), ("node3", Some(4))]);
        assert_eq!(pool("a,b", None).unwrap().len(), 2);
        assert_eq!(pool("n[1-3]", Some("2")), Err(SlurmError::Mismatch { nodes: 3, counts: 1 }));
        assert!(matches!(pool("n[1-2];x", None), Err(SlurmError::BadList { .. })));
        assert!(matches!(pool("n1", Some("z")), Err(SlurmError::BadCounts { .. })));
    }

    proptest::proptest! {
        /// Whatever the variables hold: hosts or an error, never a panic.
        #[test]
        fn any_text_gives_hosts_or_an_error(list in "[a-z0-9\\[\\],\\-]{0,40}", counts in "[0-9x(),]{0,20}") {
            let _ = pool(&list, Some(&counts));
        }
    }
}
