//! A job that others try to break into: rank 0 prints its endpoint address and the job
//! id, waits until the file named by its argument exists (an outside tester creates it
//! after attacking), then every rank takes part in an allreduce whose result is checked.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/guarded /tmp/go`

use anyhow::{bail, Context};
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let go = std::env::args().nth(1).context("usage: guarded GO_FILE")?;
    let session = ductile::init()?;
    let world = session.world();
    if world.rank() == 0 {
        println!("ADDR {} JOB {}", session.local_addr(), session.info().job);
        let start = Instant::now();
        while !std::path::Path::new(&go).exists() {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("{go} did not appear within 60 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let p = world.size() as u64;
    let sum = world.allreduce(&[world.rank() as u64 + 1; 1000], ductile::ReduceOp::Sum)?;
    if sum.iter().any(|&s| s != p * (p + 1) / 2) {
        bail!("wrong sum");
    }
    if world.rank() == 0 {
        println!("guarded: result correct");
    }
    session.finalize()?;
    Ok(())
}
