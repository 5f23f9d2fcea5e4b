//! # ductile-launcher
//!
//! The `ductile` command. `ductile run` is the job **controller**: it places ranks on
//! nodes ([`layout`]), simulated on this host or one per host of `--hosts`/`--hostfile`
//! ([`hosts`]), starts one **agent** per node ([`agent`]) with a private control channel
//! ([`spawn`], [`proto`]; through a remote shell on other hosts, see
//! [`controller::remote`]), runs the bootstrap fence (every rank's
//! endpoint address gathered and the full table sent back), forwards output, and ends
//! the job as a whole: exit code 0 if every rank exits 0, else the first failing rank's
//! code, with the remaining ranks terminated. A **node world** (an agent and its ranks)
//! is one process group, so it can be ended with one signal.
//!
//! Jobs are malleable: at the ranks' checkpoints the controller applies a resource
//! change (from `--policy`, from `ductile resize` on the job's control socket, or asked
//! for by the application). What a change comes to is planned by pure code ([`plan`],
//! [`membership`]); growth starts new node worlds along a spawn tree of agents, and
//! shrinking ends whole node worlds first.

// Module docs link to private items too, for readers of `cargo doc
// --document-private-items`, where those links resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod agent;
pub mod bind;
pub mod cli;
pub mod controller;
pub mod hosts;
pub mod layout;
pub mod membership;
pub mod netaddr;
pub mod output;
pub mod plan;
pub mod policy;
pub mod preview;
pub mod proto;
pub mod report;
pub mod slurm;
pub mod spawn;
