//! Each rank says who and where it is. With `--stdin`, rank 0 also reads its standard
//! input (which `ductile run` gives it, as `mpirun` does) and says what it read.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/hello`
//! `echo hi | ductile run -n 4 -- target/debug/examples/hello --stdin`

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
    if std::env::args().any(|a| a == "--stdin") {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
        println!("rank {} read {} bytes: {:?}", world.rank(), text.len(), text.trim_end());
    }
    session.finalize()?;
    Ok(())
}
