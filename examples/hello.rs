//! Each rank says who and where it is.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/hello`

fn main() -> anyhow::Result<()> {
    let session = ductile::init()?;
    let world = session.world();
    let info = session.info();
    println!(
        "hello from rank {} of {} on node {} of {} (job {})",
        world.rank(),
        world.size(),
        info.node.0,
        info.nodes,
        info.job
    );
    session.finalize()?;
    Ok(())
}
