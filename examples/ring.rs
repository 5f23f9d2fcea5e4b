//! A token travels around the ring of ranks a number of times; each rank adds one.
//!
//! `ductile run -n 4 -- target/debug/examples/ring [LAPS]`

use anyhow::{bail, Context};

const TAG: u32 = 1;

fn main() -> anyhow::Result<()> {
    let laps: u64 =
        std::env::args().nth(1).map(|a| a.parse()).transpose().context("LAPS must be a number")?.unwrap_or(3);
    let session = ductile::init()?;
    let world = session.world();
    let (r, p) = (world.rank(), world.size());
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    // The token is received in place (`recv_into`); a message of another size would be
    // an error.
    let mut token = [0u64];
    for _ in 0..laps {
        if r == 0 {
            world.send(next, TAG, &[token[0] + 1])?;
            world.recv_into(Some(prev), Some(TAG), &mut token)?;
        } else {
            world.recv_into(Some(prev), Some(TAG), &mut token)?;
            token[0] += 1;
            world.send(next, TAG, &token)?;
        }
    }
    let token = token[0];
    if r == 0 {
        let expect = laps * p as u64;
        if token != expect {
            bail!("token is {token}, expected {expect}");
        }
        println!("ring of {p}: token went around {laps} times and reads {token}");
    }
    session.finalize()?;
    Ok(())
}
