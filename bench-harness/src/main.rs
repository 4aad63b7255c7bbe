//! `shardline-bench`: Shardline's bench harness.
//!
//! ```text
//!  workload (synthetic keys | ARC trace) ──► one RequestSource per connection
//!        │                                      │ (entities partitioned by entity % connections)
//!        ▼                                      ▼
//!  writer thread ── pipelined requests ──► node (native protocol) ──► reader thread
//!   (open loop: intended send times;                                  │ latency from intended
//!    closed loop: window of slots)                                    ▼ send time → HdrHistogram
//!  main thread: progress bar, scenario steps (kill / start nodes), reports (.hgrm, JSON, plot)
//! ```
//!
//! Subcommands: `run` (any load against `--connect` or `--spawn` targets)
//! and `demo` (the main job: a 3-node cluster replaying the OLTP trace),
//! `journal` (the journal against raw `pwrite` + `fdatasync`), `durable`
//! (durable counter adds per data core against that raw baseline) and
//! `pipelined` (closed-loop load in redis-benchmark's shape).
//!
//! `shardline-bench node --config FILE` (hidden) runs a node exactly as
//! `shardline node` does: the same entry point ([`shardline::cli::main`]),
//! config, signals, exit codes and allocator (mimalloc). The local clusters
//! of `--spawn` start their nodes that way, so the bench needs no second
//! build; `$SHARDLINE_BIN` names another node binary instead.

mod cluster;
mod demo;
mod driver;
mod durable;
mod journal_bench;
mod native;
mod pipelined;
mod plot;
mod report;
mod run;
mod schedule;
mod stats;
mod trace;
mod transport;
mod units;
mod verify;
mod workload;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Shardline's bench harness.
#[derive(Parser)]
#[command(name = "shardline-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Drive a cluster (running, or spawned locally) with a load and report latency.
    Run(Box<run::RunArgs>),
    /// The main job: a 3-node local cluster replays the OLTP trace against counters,
    /// verifies them, and writes demo.hgrm, demo.json and demo.svg.
    Demo(demo::DemoArgs),
    /// Journal throughput and append-to-durable latency per durability policy,
    /// against a raw sequential-write baseline measured in the same run.
    Journal(journal_bench::JournalArgs),
    /// Durable counter adds per second on one data core per durability
    /// policy and depth, with p50/p99/p99.9, against the raw write +
    /// fdatasync baseline measured in the same run.
    Durable(durable::DurableArgs),
    /// Closed-loop load in redis-benchmark's shape (one event loop; each
    /// connection writes a batch of requests and waits for its replies), for
    /// comparing a node's CPU per request with redis under the same client.
    Pipelined(pipelined::PipelinedArgs),
}

fn exit_code(verify: Option<&verify::Verdict>) -> ExitCode {
    match verify {
        Some(v) if !v.passed() => ExitCode::from(2),
        _ => ExitCode::SUCCESS,
    }
}

fn main() -> anyhow::Result<ExitCode> {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == cluster::NODE_SUBCOMMAND)
    {
        // A node of a local cluster: the `shardline` command line, as if
        // started as `shardline node ...`.
        return Ok(shardline::cli::main(
            std::iter::once("shardline".into()).chain(std::env::args_os().skip(1)),
        ));
    }
    let cli = Cli::parse();
    // The load driver's tables grow with the entities it has seen; huge-page
    // faults then stall its reader threads and every reply they delay counts
    // as latency (see `shardline::disable_transparent_huge_pages`).
    if let Err(e) = shardline::disable_transparent_huge_pages() {
        eprintln!("shardline-bench: transparent huge pages stay on: {e}");
    }
    let connector: Arc<dyn transport::Connector> = Arc::new(native::NativeConnector);
    match cli.command {
        Command::Run(args) => {
            let report = run::run(*args, connector, "run")?;
            Ok(exit_code(report.verify.as_ref()))
        }
        Command::Journal(args) => {
            journal_bench::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Durable(args) => {
            durable::run(&args, connector)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Pipelined(args) => {
            pipelined::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo(args) => {
            let report = demo::demo(args, connector)?;
            Ok(exit_code(report.verify.as_ref()))
        }
    }
}
