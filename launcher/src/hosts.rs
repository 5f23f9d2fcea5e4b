//! The host pool of a multi-host job, parsed by pure functions from `--hosts` and
//! `--hostfile`.
//!
//! A **host** is a machine the controller reaches through a remote shell (ssh) to start
//! one agent there; its **slots** are how many ranks it may run. Two forms name hosts:
//!
//! - a list (`--hosts`): comma-separated `name` or `name:SLOTS`, e.g. `node1,node2:4`;
//! - a hostfile (`--hostfile`), in the style of Open MPI and PBS: one host per line as
//!   `name`, `name slots=N` or `name:N`; `#` starts a comment (a whole line or the rest
//!   of one); blank lines are skipped. `max_slots=N` is refused: ductile never places
//!   more than `slots` ranks on a host, so a limit above that would be silently ignored.
//!
//! A host named more than once is one host whose slots add up, an entry without slots
//! counting 1, kept where it first appears; so a `PBS_NODEFILE`, which repeats a host
//! once per slot, reads as it should. Names are compared ignoring ASCII case. A host
//! named once without slots keeps `slots: None`: the launcher's default applies.
//!
//! Host names go on the remote shell's command line, so only `[A-Za-z0-9._-]` is
//! accepted (no shell metacharacters, no IPv6 literals) and no leading `-`, which ssh
//! would read as an option.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;

/// Most slots one host may have, in one entry or added up over its entries.
pub const MAX_SLOTS: u32 = 4096;
/// Longest host name, in bytes (the limit of a DNS name).
pub const MAX_NAME_LEN: usize = 253;
/// Longest piece of user text quoted in an error message, in characters.
const SHOWN_CHARS: usize = 40;

/// One host of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    /// Its name, as first written: `[A-Za-z0-9._-]`, not starting with `-`.
    pub name: String,
    /// Ranks it may run, 1 to [`MAX_SLOTS`]; `None` if never given (the default applies).
    pub slots: Option<u32>,
}

/// Where in the user's text an error is: 1-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// An entry of a `--hosts` list.
    Entry(usize),
    /// A line of a hostfile.
    Line(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Entry(i) => write!(f, "host list entry {i}"),
            Self::Line(i) => write!(f, "hostfile line {i}"),
        }
    }
}

/// Why a host name cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameProblem {
    /// Longer than [`MAX_NAME_LEN`] bytes; the length.
    TooLong(usize),
    /// Starts with `-`.
    LeadingDash,
    /// Contains a character outside `[A-Za-z0-9._-]`; the first such.
    BadChar(char),
}

impl fmt::Display for NameProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLong(n) => write!(f, "it is {n} bytes long, more than {MAX_NAME_LEN}"),
            Self::LeadingDash => write!(f, "it starts with `-`"),
            Self::BadChar(c) => write!(f, "it contains {c:?} (only letters, digits, `.`, `_` and `-` may be used)"),
        }
    }
}

/// A host list or hostfile that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostsError {
    /// A list entry with nothing in it (`a,,b`, a trailing comma, or an empty list).
    #[error("{0} is empty")]
    EmptyEntry(Location),
    /// An entry with slots but no name (`:4`).
    #[error("{0}: the host name is empty")]
    EmptyName(Location),
    /// A host name that cannot be used.
    #[error("{at}: `{}` is not a usable host name: {problem}", shown(.name))]
    BadName {
        /// Where.
        at: Location,
        /// The name as written.
        name: String,
        /// What is wrong with it.
        problem: NameProblem,
    },
    /// A slot count that is not a whole number from 1 to [`MAX_SLOTS`].
    #[error("{at}: `{}` is not a slot count (1 to {MAX_SLOTS})", shown(.text))]
    BadSlots {
        /// Where.
        at: Location,
        /// The word that holds it, as written (`slots=x`, `node:x`).
        text: String,
    },
    /// Slots given twice on one line (`node:2 slots=4`).
    #[error("{0}: slots are given more than once")]
    SlotsTwice(Location),
    /// A hostfile setting ductile does not support (`max_slots=N`).
    #[error("{at}: `{}` is not supported (ductile places at most `slots` ranks on a host)", shown(.word))]
    Unsupported {
        /// Where.
        at: Location,
        /// The word, as written.
        word: String,
    },
    /// A word after the host name that is not a known setting.
    #[error("{at}: `{}` is not a known setting (only `slots=N`)", shown(.word))]
    UnknownWord {
        /// Where.
        at: Location,
        /// The word, as written.
        word: String,
    },
    /// A host whose slots, added up over its entries, pass [`MAX_SLOTS`].
    #[error("{at}: host `{}` has more than {MAX_SLOTS} slots in total", shown(.name))]
    TooManySlots {
        /// Where the total first passes the limit.
        at: Location,
        /// The host, as first written.
        name: String,
    },
    /// A hostfile with no host in it.
    #[error("the hostfile names no hosts")]
    NoHosts,
}

/// User text for a one-line message: escaped, and cut short if long.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(SHOWN_CHARS).flat_map(char::escape_debug).collect();
    if s.chars().nth(SHOWN_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// Parses a `--hosts` list: comma-separated `name` or `name:SLOTS`, e.g.
/// `node1,node2:4`. Spaces around an entry are ignored. Repeated hosts are merged (see
/// the module docs). `Ok` holds at least one host.
///
/// # Errors
/// An empty entry, an unusable name, a bad slot count, or a host with more than
/// [`MAX_SLOTS`] slots in total.
pub fn parse_list(s: &str) -> Result<Vec<Host>, HostsError> {
    let mut pool = Pool::default();
    for (i, entry) in s.split(',').enumerate() {
        let at = Location::Entry(i + 1);
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(HostsError::EmptyEntry(at));
        }
        pool.add(parse_entry(entry, at)?, at)?;
    }
    Ok(pool.hosts)
}

/// Parses a hostfile's text: one host per line as `name`, `name slots=N` or `name:N`;
/// `#` starts a comment; blank lines are skipped; repeated hosts are merged (see the
/// module docs). `Ok` holds at least one host.
///
/// # Errors
/// A line with an unusable name, a bad or repeated slot count, `max_slots=`, an unknown
/// word, a host with more than [`MAX_SLOTS`] slots in total, or no host at all. Errors
/// name the 1-based line.
pub fn parse_file(text: &str) -> Result<Vec<Host>, HostsError> {
    let mut pool = Pool::default();
    for (i, line) in text.lines().enumerate() {
        let at = Location::Line(i + 1);
        if let Some(host) = parse_line(line, at)? {
            pool.add(host, at)?;
        }
    }
    if pool.hosts.is_empty() {
        return Err(HostsError::NoHosts);
    }
    Ok(pool.hosts)
}

/// Whether `name` is this machine, so that its agent can be started without the remote
/// shell: `localhost`, a loopback address (`127.0.0.1`, `::1`), an address of one of
/// this host's interfaces, or this host's name as `gethostname` gives it, in full or
/// its short form before the first `.`. Case is ignored.
///
/// Reads the host name (and, for an address, the interfaces) on every call.
#[must_use]
pub fn is_local(name: &str) -> bool {
    let addrs = match name.parse::<IpAddr>() {
        Ok(_) => crate::netaddr::local_addrs().unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    is_local_with(name, crate::netaddr::hostname().ok().as_deref(), &addrs)
}

/// Whether `name` means this host on every host: `localhost` or a loopback address.
#[must_use]
pub fn is_loopback(name: &str) -> bool {
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// [`is_local`] with this machine's name and addresses passed in.
fn is_local_with(name: &str, hostname: Option<&str>, addrs: &[IpAddr]) -> bool {
    if name.is_empty() {
        return false;
    }
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    if let Ok(ip) = name.parse::<IpAddr>() {
        return ip.is_loopback() || addrs.contains(&ip);
    }
    let Some(full) = hostname.filter(|h| !h.is_empty()) else {
        return false;
    };
    let short = full.split_once('.').map_or(full, |(short, _)| short);
    name.eq_ignore_ascii_case(full) || name.eq_ignore_ascii_case(short)
}

/// Hosts in order of first appearance, repeats merged.
#[derive(Default)]
struct Pool {
    hosts: Vec<Host>,
    /// Lowercased name to index in `hosts`.
    index: HashMap<String, usize>,
}

impl Pool {
    fn add(&mut self, host: Host, at: Location) -> Result<(), HostsError> {
        let key = host.name.to_ascii_lowercase();
        let Some(&i) = self.index.get(&key) else {
            self.index.insert(key, self.hosts.len());
            self.hosts.push(host);
            return Ok(());
        };
        let old = &mut self.hosts[i];
        // Both terms are at most MAX_SLOTS (checked on parsing and on every sum), so the
        // sum cannot overflow.
        let total = old.slots.unwrap_or(1) + host.slots.unwrap_or(1);
        if total > MAX_SLOTS {
            return Err(HostsError::TooManySlots { at, name: old.name.clone() });
        }
        old.slots = Some(total);
        Ok(())
    }
}

/// One hostfile line: `None` if it holds no host.
fn parse_line(line: &str, at: Location) -> Result<Option<Host>, HostsError> {
    let line = line.split_once('#').map_or(line, |(before, _)| before);
    let mut words = line.split_whitespace();
    let Some(first) = words.next() else {
        return Ok(None);
    };
    let mut host = parse_entry(first, at)?;
    for word in words {
        match word.split_once('=') {
            Some(("slots", value)) => {
                if host.slots.is_some() {
                    return Err(HostsError::SlotsTwice(at));
                }
                host.slots = Some(slot_count(value).ok_or_else(|| bad_slots(at, word))?);
            }
            Some(("max_slots", _)) => return Err(HostsError::Unsupported { at, word: word.to_owned() }),
            _ => return Err(HostsError::UnknownWord { at, word: word.to_owned() }),
        }
    }
    Ok(Some(host))
}

/// `name` or `name:SLOTS`.
fn parse_entry(entry: &str, at: Location) -> Result<Host, HostsError> {
    let (name, slots) = match entry.split_once(':') {
        None => (entry, None),
        Some((name, slots)) => (name, Some(slot_count(slots).ok_or_else(|| bad_slots(at, entry))?)),
    };
    check_name(name, at)?;
    Ok(Host { name: name.to_owned(), slots })
}

fn bad_slots(at: Location, text: &str) -> HostsError {
    HostsError::BadSlots { at, text: text.to_owned() }
}

/// A slot count: ASCII digits only (no sign), 1 to [`MAX_SLOTS`].
fn slot_count(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|n| (1..=MAX_SLOTS).contains(n))
}

fn check_name(name: &str, at: Location) -> Result<(), HostsError> {
    let bad = |problem| Err(HostsError::BadName { at, name: name.to_owned(), problem });
    if name.is_empty() {
        return Err(HostsError::EmptyName(at));
    }
    if let Some(c) = name.chars().find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return bad(NameProblem::BadChar(c));
    }
    if name.len() > MAX_NAME_LEN {
        return bad(NameProblem::TooLong(name.len()));
    }
    if name.starts_with('-') {
        return bad(NameProblem::LeadingDash);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(name: &str, slots: Option<u32>) -> Host {
        Host { name: name.into(), slots }
    }

    fn message(r: Result<Vec<Host>, HostsError>) -> String {
        match r {
            Ok(hosts) => panic!("expected an error, got {hosts:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn lists() {
        assert_eq!(parse_list("node1,node2:4").unwrap(), vec![h("node1", None), h("node2", Some(4))]);
        assert_eq!(parse_list(" a , b:2 ").unwrap(), vec![h("a", None), h("b", Some(2))]);
        assert_eq!(parse_list("10.0.0.1:4096").unwrap(), vec![h("10.0.0.1", Some(4096))]);
        // Repeats merge: slots add up, a bare entry counts 1, first position kept.
        assert_eq!(parse_list("a,b:2,a,b:3,A").unwrap(), vec![h("a", Some(3)), h("b", Some(5))]);
    }

    #[test]
    fn list_errors() {
        assert_eq!(message(parse_list("")), "host list entry 1 is empty");
        assert_eq!(message(parse_list("a,,b")), "host list entry 2 is empty");
        assert_eq!(message(parse_list("a,")), "host list entry 2 is empty");
        assert_eq!(message(parse_list("a,:4")), "host list entry 2: the host name is empty");
        assert_eq!(message(parse_list("a:x")), "host list entry 1: `a:x` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_list("a:0")), "host list entry 1: `a:0` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_list("a:+4")), "host list entry 1: `a:+4` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_list("a:4097")), "host list entry 1: `a:4097` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_list("a:")), "host list entry 1: `a:` is not a slot count (1 to 4096)");
        assert_eq!(
            message(parse_list("a;rm")),
            "host list entry 1: `a;rm` is not a usable host name: it contains ';' \
             (only letters, digits, `.`, `_` and `-` may be used)"
        );
        assert_eq!(
            message(parse_list("-oProxyCommand=x")),
            "host list entry 1: `-oProxyCommand=x` is not a usable host name: it contains '=' \
             (only letters, digits, `.`, `_` and `-` may be used)"
        );
        assert_eq!(message(parse_list("-v")), "host list entry 1: `-v` is not a usable host name: it starts with `-`");
        assert_eq!(message(parse_list("a:4000,a:97")), "host list entry 2: host `a` has more than 4096 slots in total");
        assert_eq!(parse_list("a:4000,a:96").unwrap(), vec![h("a", Some(4096))]);
    }

    #[test]
    fn name_limits() {
        let long = "a".repeat(MAX_NAME_LEN);
        assert_eq!(parse_list(&long).unwrap(), vec![h(&long, None)]);
        let longer = "a".repeat(MAX_NAME_LEN + 1);
        let err = parse_list(&longer).unwrap_err();
        assert!(matches!(err, HostsError::BadName { problem: NameProblem::TooLong(254), .. }));
        // The message quotes only the start of the name.
        assert!(err.to_string().contains(&format!("`{}…`", "a".repeat(SHOWN_CHARS))), "{err}");
        // Control characters are escaped, so the message stays on one line.
        let err = message(parse_list("a\nb"));
        assert!(!err.contains('\n') && err.contains("a\\nb"), "{err}");
    }

    #[test]
    fn hostfiles() {
        let text =
            "# cluster\n\nnode1 slots=4\nnode2   # no slots\n  node3:2\t# MPICH style\nnode4 slots=8 # trailing\n";
        assert_eq!(
            parse_file(text).unwrap(),
            vec![h("node1", Some(4)), h("node2", None), h("node3", Some(2)), h("node4", Some(8))]
        );
        // A PBS_NODEFILE: one line per slot.
        let pbs = "n1\nn1\nn2\nn1\nn2\n";
        assert_eq!(parse_file(pbs).unwrap(), vec![h("n1", Some(3)), h("n2", Some(2))]);
        assert_eq!(parse_file("a\r\na slots=2\r\n").unwrap(), vec![h("a", Some(3))]);
    }

    #[test]
    fn hostfile_errors() {
        assert_eq!(
            message(parse_file("a\nb\nc slots=x\n")),
            "hostfile line 3: `slots=x` is not a slot count (1 to 4096)"
        );
        assert_eq!(message(parse_file("a:0")), "hostfile line 1: `a:0` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_file("a slots=")), "hostfile line 1: `slots=` is not a slot count (1 to 4096)");
        assert_eq!(message(parse_file("a:2 slots=4")), "hostfile line 1: slots are given more than once");
        assert_eq!(message(parse_file("a slots=2 slots=4")), "hostfile line 1: slots are given more than once");
        assert_eq!(
            message(parse_file("\na slots=4 max_slots=8")),
            "hostfile line 2: `max_slots=8` is not supported (ductile places at most `slots` ranks on a host)"
        );
        assert_eq!(message(parse_file("a cpu=4")), "hostfile line 1: `cpu=4` is not a known setting (only `slots=N`)");
        assert_eq!(message(parse_file("a b")), "hostfile line 1: `b` is not a known setting (only `slots=N`)");
        assert_eq!(
            message(parse_file("a\n$(reboot)")),
            "hostfile line 2: `$(reboot)` is not a usable host name: it contains '$' \
             (only letters, digits, `.`, `_` and `-` may be used)"
        );
        assert_eq!(message(parse_file("")), "the hostfile names no hosts");
        assert_eq!(message(parse_file("# nothing\n\n   \n")), "the hostfile names no hosts");
    }

    #[test]
    fn loopback_names_mean_this_host_everywhere() {
        for name in ["localhost", "LocalHost", "127.0.0.1", "127.1.2.3", "::1"] {
            assert!(is_loopback(name), "{name}");
        }
        for name in ["", "node1", "10.0.0.1", "localhost.example", "::2"] {
            assert!(!is_loopback(name), "{name}");
        }
    }

    #[test]
    fn local_names() {
        let addrs: Vec<IpAddr> = vec!["10.1.2.3".parse().unwrap()];
        let local = |name| is_local_with(name, Some("node7.cluster.example"), &addrs);
        for name in
            ["localhost", "LocalHost", "127.0.0.1", "::1", "node7", "NODE7", "node7.cluster.example", "10.1.2.3"]
        {
            assert!(local(name), "{name}");
        }
        for name in ["", "node8", "node7.other", "cluster", "10.1.2.4", "::2"] {
            assert!(!local(name), "{name}");
        }
        assert!(!is_local_with("node7", None, &[]));
        assert!(is_local("localhost") && is_local("127.0.0.1") && is_local("::1"));
        if let Ok(name) = crate::netaddr::hostname() {
            assert!(is_local(&name), "{name}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in ".{0,300}") {
            let _ = parse_list(&s);
            let _ = parse_file(&s);
        }

        #[test]
        fn hostfile_like_text_never_panics(s in "[a-c0-9:,=# \t\n.-]{0,80}|(slots|max_slots|[ab])[= :]?[0-9x]{0,5}") {
            let _ = parse_list(&s);
            let _ = parse_file(&s);
        }

        #[test]
        fn written_lists_read_back(hosts in proptest::collection::vec(("[a-z][a-z0-9.-]{0,8}", proptest::option::of(1u32..=100)), 1..8)) {
            let text: Vec<String> = hosts.iter().map(|(n, s)| match s {
                Some(s) => format!("{n}:{s}"),
                None => n.clone(),
            }).collect();
            let from_list = parse_list(&text.join(",")).unwrap();
            let from_file = parse_file(&text.join("\n")).unwrap();
            prop_assert_eq!(&from_list, &from_file);
            // Every slot is counted once: a bare entry counts 1 once its host repeats.
            let total: u32 = hosts.iter().map(|(_, s)| s.unwrap_or(1)).sum();
            prop_assert_eq!(from_list.iter().map(|h| h.slots.unwrap_or(1)).sum::<u32>(), total);
            for (i, host) in from_list.iter().enumerate() {
                prop_assert!(hosts.iter().any(|(n, _)| *n == host.name));
                prop_assert!(from_list[..i].iter().all(|o| !o.name.eq_ignore_ascii_case(&host.name)));
            }
        }
    }
}
