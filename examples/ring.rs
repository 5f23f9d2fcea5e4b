//! A token travels around the ring of ranks a number of times; each rank adds one to
//! each of its words.
//!
//! `ductile run -n 4 -- target/debug/examples/ring [LAPS] [WORDS]`

use anyhow::{bail, Context};

const TAG: u32 = 1;

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, what: &str, default: u64| -> anyhow::Result<u64> {
        let parsed = std::env::args().nth(i).map(|a| a.parse::<u64>()).transpose();
        Ok(parsed.with_context(|| format!("{what} must be a number"))?.unwrap_or(default))
    };
    let laps = arg(1, "LAPS", 3)?;
    let words = usize::try_from(arg(2, "WORDS", 1)?)?;
    if words == 0 {
        bail!("WORDS must be at least 1");
    }
    let session = ductile::init()?;
    let world = session.world();
    let (r, p) = (world.rank(), world.size());
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    // The token is received in place (`recv_into`); a message of another size would be
    // an error.
    let mut token = vec![0u64; words];
    let receive = |token: &mut [u64]| -> anyhow::Result<()> {
        let status = world.recv_into(Some(prev), Some(TAG), token)?;
        if (status.source, status.len) != (prev, 8 * words) {
            bail!("received {} bytes from rank {}, expected {} from {prev}", status.len, status.source, 8 * words);
        }
        Ok(())
    };
    for _ in 0..laps {
        if r == 0 {
            token.iter_mut().for_each(|w| *w += 1);
            world.send(next, TAG, &token)?;
            receive(&mut token)?;
        } else {
            receive(&mut token)?;
            token.iter_mut().for_each(|w| *w += 1);
            world.send(next, TAG, &token)?;
        }
    }
    if r == 0 {
        let expect = laps * p as u64;
        if let Some(i) = token.iter().position(|&w| w != expect) {
            bail!("word {i} of the token is {}, expected {expect}", token[i]);
        }
        println!("ring of {p}: token went around {laps} times and reads {}", token[0]);
    }
    session.finalize()?;
    Ok(())
}
