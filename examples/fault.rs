//! Failure handling demo: `fault exit R CODE` makes rank R exit with CODE while the
//! others wait for a message from it; `fault hang` makes every rank wait for a message
//! that never comes; `fault leave-crash CODE` reaches checkpoints until a shrink, where
//! every released process exits with CODE instead of leaving cleanly. The launcher must
//! end the job either way (first failing rank's code, or Ctrl-C / `--timeout`), leaving
//! no process behind.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/fault exit 2 3; echo $?`

use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut session = ductile::init()?;
    if args.first().map(String::as_str) == Some("leave-crash") {
        let code: i32 = args.get(1).context("fault leave-crash CODE")?.parse()?;
        for _ in 0..1000 {
            if let ductile::Checkpoint::Released(_) = session.checkpoint()? {
                std::process::exit(code);
            }
        }
        return Ok(session.finalize()?);
    }
    let world = session.world();
    let r = world.rank();
    world.barrier()?;
    match args.first().map(String::as_str) {
        Some("exit") => {
            let who: usize = args.get(1).context("fault exit RANK CODE")?.parse()?;
            let code: i32 = args.get(2).context("fault exit RANK CODE")?.parse()?;
            if r == who {
                std::process::exit(code);
            }
            world.recv::<u8>(Some(who), Some(1))?;
        }
        Some("hang") => {
            println!("rank {r} waiting");
            world.recv::<u8>(None, Some(1))?;
        }
        _ => bail!("usage: fault exit RANK CODE | fault hang | fault leave-crash CODE"),
    }
    session.finalize()?;
    Ok(())
}
