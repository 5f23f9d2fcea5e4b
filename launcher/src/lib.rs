//! # ductile-launcher
//!
//! The `ductile` command. `ductile run` is the job **controller**: it places ranks on
//! (simulated local) nodes ([`layout`]), starts one **agent** per node ([`agent`]) with a
//! private control channel ([`spawn`], [`proto`]), runs the bootstrap fence (every rank's
//! endpoint address gathered and the full table sent back), forwards output, and ends
//! the job as a whole: exit code 0 if every rank exits 0, else the first failing rank's
//! code, with the remaining ranks terminated. A **node world** (an agent and its ranks)
//! is one process group, so it can be ended with one signal.

pub mod agent;
pub mod cli;
pub mod controller;
pub mod layout;
pub mod output;
pub mod plan;
pub mod policy;
pub mod proto;
pub mod report;
pub mod spawn;
