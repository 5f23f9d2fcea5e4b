//! Where cargo put the workspace's binaries and examples.
//!
//! Integration tests and benches of this package cannot use `CARGO_BIN_EXE_ductile`,
//! because the `ductile` binary belongs to the launcher crate; they find it next to
//! their own executable instead (`target/<profile>/deps/<test>` → `target/<profile>/`).

use std::path::PathBuf;
use std::process::Command;

/// The `target/<profile>` directory the running test or bench was built into.
///
/// # Panics
/// When the running executable's path cannot be read (a broken installation).
#[must_use]
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the running executable");
    let deps = exe.parent().expect("executable has a directory");
    let dir = if deps.ends_with("deps") { deps.parent().expect("deps has a parent") } else { deps };
    dir.to_path_buf()
}

/// The `ductile` launcher binary.
#[must_use]
pub fn ductile_bin() -> PathBuf {
    profile_dir().join("ductile")
}

/// A compiled example of this package.
#[must_use]
pub fn example(name: &str) -> PathBuf {
    profile_dir().join("examples").join(name)
}

/// An Open MPI comparison peer built by `benches/peers/build.sh` (in `target/peers/`),
/// if it and `mpirun` are there; otherwise says loudly that the peers are skipped.
#[must_use]
pub fn mpi_peer(name: &str) -> Option<PathBuf> {
    let p = profile_dir().parent()?.join("peers").join(name);
    let mpirun = std::process::Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success());
    if p.exists() && mpirun {
        Some(p)
    } else {
        eprintln!("\n*** SKIPPED Open MPI peers: {} or mpirun missing; run benches/peers/build.sh ***\n", p.display());
        None
    }
}

/// Builds the launcher and this package's examples in the release profile, with the
/// transports this package was built with (`cargo bench` does not build other
/// packages' binaries, so a bench calls this to run the current code).
///
/// # Panics
/// When the build fails.
pub fn build_release() {
    let features: Vec<&str> =
        [("ductile-launcher/quic", cfg!(feature = "quic")), ("ductile-launcher/fabric", cfg!(feature = "fabric"))]
            .iter()
            .filter(|(_, on)| *on)
            .map(|(f, _)| *f)
            .collect();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "ductile-launcher",
        "-p",
        "ductile-suite",
        "--bins",
        "--examples",
    ]);
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    let ok = cmd.status().is_ok_and(|s| s.success());
    assert!(ok && ductile_bin().exists(), "cannot build {} and the examples", ductile_bin().display());
}
