//! Every rank contributes a vector; the allreduced sum is checked against the known
//! closed form and printed by rank 0.
//!
//! `ductile run -n 8 --nodes 4 -- target/debug/examples/allreduce [ELEMENTS]`

use anyhow::{bail, Context};
use ductile::ReduceOp;

fn main() -> anyhow::Result<()> {
    let n: usize =
        std::env::args().nth(1).map(|a| a.parse()).transpose().context("ELEMENTS must be a number")?.unwrap_or(1 << 16);
    let session = ductile::init()?;
    let world = session.world();
    let (r, p) = (world.rank() as u64, world.size() as u64);
    // Element i of rank r is r + i, so the sum over ranks is p*i + p*(p-1)/2.
    let mine: Vec<u64> = (0..n as u64).map(|i| r + i).collect();
    let sum = world.allreduce(&mine, ReduceOp::Sum)?;
    let max = world.allreduce(&[r], ReduceOp::Max)?;
    for (i, &s) in sum.iter().enumerate() {
        let expect = p * i as u64 + p * (p - 1) / 2;
        if s != expect {
            bail!("rank {r}: element {i} is {s}, expected {expect}");
        }
    }
    if max[0] != p - 1 {
        bail!("rank {r}: max rank is {}, expected {}", max[0], p - 1);
    }
    // The same over a group built from a process set: every rank but 0.
    let rest = session.pset("world")?.difference(&ductile::ProcessSet::own(0, 0))?;
    if r != 0 {
        let g = session.group(&rest)?;
        let s = g.allreduce(&[r], ReduceOp::Sum)?;
        if s[0] != p * (p - 1) / 2 {
            bail!("rank {r}: sum over {} is {}, expected {}", rest, s[0], p * (p - 1) / 2);
        }
    }
    let total: u64 = sum.iter().sum();
    if r == 0 {
        println!("allreduce over {p} ranks of {n} elements: correct; total {total}");
    }
    session.finalize()?;
    Ok(())
}
