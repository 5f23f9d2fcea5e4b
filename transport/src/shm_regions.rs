//! The `/dev/shm` regions of libfabric's `shm` provider, named `<pid>:<uid>:<endpoint>`
//! (16 MiB of address space each) after the process that opened the endpoint. libfabric 1.17
//! unlinks a region only when its endpoint is closed or a fatal signal reaches its
//! handler, so a process that calls `exit` with its endpoint open, aborts, or is killed
//! with SIGKILL leaves its region until the machine reboots. A later process that gets
//! the same pid (`pid_max` is 32768 on many systems) then crashed in `fi_enable` here,
//! whatever program it was. Hence:
//! - the launcher's agent removes a rank's regions once it has reaped the rank, and the
//!   controller those of every rank at the end of the job (an agent may have been
//!   killed before it could), skipping a pid that is alive again (reused);
//! - the fabric backend removes regions named for its own pid that this process has not
//!   mapped, before its first endpoint: no other live process in this pid namespace has
//!   that pid, and a region this process uses (a libfabric endpoint the application
//!   opened itself) is mapped.
//!
//! Only regular files of this user, named for it, are touched.

use std::path::Path;

/// Where libfabric's `shm` provider keeps its regions.
const SHM_DIR: &str = "/dev/shm";

/// Removes the `shm` regions of the processes `pids`, which have ended and been reaped;
/// a pid that is alive again belongs to another process and is skipped. Returns how
/// many were removed.
pub fn remove_ended(pids: &[u32]) -> usize {
    if pids.is_empty() {
        return 0;
    }
    remove_in(Path::new(SHM_DIR), |pid, _| pids.contains(&pid) && !alive(pid))
}

/// Removes the `shm` regions named for this process that it has not mapped: a dead
/// process with the same pid left them (see the module docs). Returns how many.
pub fn remove_own_stale() -> usize {
    let me = std::process::id();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    remove_in(Path::new(SHM_DIR), |pid, path| pid == me && !maps.contains(&*path.to_string_lossy()))
}

/// Whether `pid` is a process that has not ended (a zombie has).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}

/// Removes the regions in `dir` of this user for which `doomed(pid, path)` holds.
fn remove_in(dir: &Path, doomed: impl Fn(u32, &Path) -> bool) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    // SAFETY: getuid and geteuid have no preconditions and cannot fail.
    let (uid, euid) = unsafe { (libc::getuid(), libc::geteuid()) };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, named_uid)) = name.to_str().and_then(region_of) else { continue };
        if named_uid != uid || !doomed(pid, &entry.path()) {
            continue;
        }
        // Not following links: a region is a plain file of ours.
        let ours = entry.metadata().is_ok_and(|m| m.file_type().is_file() && m.uid() == euid);
        if ours && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!("removed {} left by process {pid}", entry.path().display());
            removed += 1;
        }
    }
    removed
}

/// The pid and uid of a region named `<pid>:<uid>:<endpoint>` (three decimal fields).
fn region_of(name: &str) -> Option<(u32, u32)> {
    let fields: Vec<&str> = name.split(':').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if fields.len() != 3 || !fields.iter().all(|f| digits(f)) {
        return None;
    }
    Some((fields[0].parse().ok()?, fields[1].parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_names_are_recognised_strictly() {
        assert_eq!(region_of("618:0:0"), Some((618, 0)));
        assert_eq!(region_of("618:1000:12"), Some((618, 1000)));
        for bad in [
            "618",
            "618:0",
            "618:",
            "618:x:0",
            ":0:0",
            "a618:0:0",
            "618:0:",
            "618:0:0:0",
            "sem.618:0:0",
            "99999999999:0:0",
            "",
        ] {
            assert_eq!(region_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_the_doomed_regions_of_this_user_are_removed() {
        let dir = std::env::temp_dir().join(format!("ductile-shm-regions-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let other = uid + 1;
        let names = [
            format!("123:{uid}:0"),
            format!("123:{uid}:1"),
            format!("123:{other}:0"),
            format!("1234:{uid}:0"),
            format!("45:{uid}:0"),
            "123".into(),
            "123:x:0".into(),
            "other".into(),
        ];
        for n in &names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        std::fs::create_dir(dir.join(format!("45:{uid}:1"))).unwrap();
        let kept = dir.join(format!("123:{uid}:1"));
        let removed = remove_in(&dir, |pid, path| (pid == 123 || pid == 45) && path != kept);
        assert_eq!(removed, 2);
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut want = vec![
            format!("123:{uid}:1"),
            format!("123:{other}:0"),
            format!("1234:{uid}:0"),
            format!("45:{uid}:1"),
            "123".into(),
            "123:x:0".into(),
            "other".into(),
        ];
        want.sort();
        assert_eq!(left, want);
        assert_eq!(remove_in(&dir.join("missing"), |_, _| true), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn live_processes_are_told_from_ended_ones() {
        assert!(alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!alive(pid));
        // Nothing of a live process is removed, whatever is asked.
        assert_eq!(remove_ended(&[std::process::id()]), 0);
    }
}
