//! Each rank says who and where it is. With `--stdin`, rank 0 also reads its standard
//! input (which `ductile run` gives it, as `mpirun` does) and says what it read.
//!
//! `ductile run -n 4 --nodes 2 -- target/debug/examples/hello`
//! `echo hi | ductile run -n 4 -- target/debug/examples/hello --stdin`
//!
//! With `--env NAME`, each rank also says on stderr what `NAME` is set to, which
//! directory it runs in (what ranks on other hosts get from `ductile run`) and its
//! network namespace. With `--cpus`, each rank also says which CPUs it may run on
//! (what `ductile run --bind-to` bound it to).

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
    let args: Vec<String> = std::env::args().collect();
    if let Some(name) = args.iter().position(|a| a == "--env").and_then(|i| args.get(i + 1)) {
        let value = std::env::var(name).unwrap_or_else(|_| "(unset)".into());
        let dir = std::env::current_dir()?;
        // Which network namespace: how the tests tell their simulated hosts apart.
        let net = std::fs::read_link("/proc/self/ns/net").map(|l| l.display().to_string()).unwrap_or_default();
        eprintln!("rank {}: {name}={value} in {}, network {net}", world.rank(), dir.display());
    }
    if args.iter().any(|a| a == "--cpus") {
        let status = std::fs::read_to_string("/proc/self/status")?;
        let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap_or("(unknown)");
        println!("rank {} may run on CPUs {}", world.rank(), cpus.trim());
    }
    if args.iter().any(|a| a == "--stdin") {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
        println!("rank {} read {} bytes: {:?}", world.rank(), text.len(), text.trim_end());
    }
    session.finalize()?;
    Ok(())
}
