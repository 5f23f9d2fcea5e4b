//! The `/dev/shm` regions of libfabric's `shm` provider, named `<pid>:<n>:<n>` (16 MiB
//! of address space each) after the process that opened the endpoint. libfabric 1.17
//! unlinks a region only when its endpoint is closed or a fatal signal reaches its
//! handler, so a process that calls `exit` with its endpoint open, aborts, or is killed
//! with SIGKILL leaves its region until the machine reboots. A later process that gets
//! the same pid (`pid_max` is 32768 on many systems) then crashed in `fi_enable` here,
//! whatever program it was. Hence:
//! - the launcher's agent removes a rank's regions once it has reaped the rank, and the
//!   controller those of every rank at the end of the job (an agent may have been
//!   killed before it could);
//! - the fabric backend removes regions named for its own pid before it opens its
//!   endpoint: no live process in this pid namespace can have that pid, so they are a
//!   dead process's.
//!
//! Only regular files of this user, named for the given pids, are touched.

use std::path::Path;

/// Where libfabric's `shm` provider keeps its regions.
const SHM_DIR: &str = "/dev/shm";

/// Removes the `shm` regions named for the processes `pids`, which must have ended (or be
/// this process, before it opens an endpoint); returns how many.
pub fn remove(pids: &[u32]) -> usize {
    remove_regions_in(Path::new(SHM_DIR), pids)
}

/// As [`remove`], in `dir`.
fn remove_regions_in(dir: &Path, pids: &[u32]) -> usize {
    use std::os::unix::fs::MetadataExt;
    if pids.is_empty() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(region_pid) else { continue };
        if !pids.contains(&pid) {
            continue;
        }
        // Not following links: a region is a plain file of ours.
        let ours = entry.metadata().is_ok_and(|m| m.file_type().is_file() && m.uid() == me);
        if ours && std::fs::remove_file(entry.path()).is_ok() {
            tracing::debug!("removed {} left by process {pid}", entry.path().display());
            removed += 1;
        }
    }
    removed
}

/// The pid a region's name `<pid>:<n>:<n>` starts with (digits only, at least one
/// `:<n>` after the pid).
fn region_pid(name: &str) -> Option<u32> {
    let mut parts = name.split(':');
    let pid = parts.next()?;
    let rest: Vec<&str> = parts.collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || rest.is_empty() || !rest.iter().all(|s| digits(s)) {
        return None;
    }
    pid.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_names_are_recognised_strictly() {
        assert_eq!(region_pid("618:0:0"), Some(618));
        assert_eq!(region_pid("618:12"), Some(618));
        for bad in ["618", "618:", "618:x", ":0:0", "a618:0:0", "618:0:", "sem.618:0:0", "99999999999:0:0", ""] {
            assert_eq!(region_pid(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_the_named_pids_regions_are_removed() {
        let dir = std::env::temp_dir().join(format!("ductile-cleanup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let names = ["123:0:0", "123:1:0", "1234:0:0", "123", "123:x", "other", "45:0:0"];
        for n in names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        std::fs::create_dir(dir.join("45:1:0")).unwrap();
        assert_eq!(remove_regions_in(&dir, &[123, 45]), 3);
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["123", "1234:0:0", "123:x", "45:1:0", "other"]);
        assert_eq!(remove_regions_in(&dir, &[]), 0);
        assert_eq!(remove_regions_in(&dir.join("missing"), &[1]), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
